"""`hetsched asyncapi`: the AsyncAPI document of every request subject and event."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer()


@app.command()
def asyncapi(
    out: Annotated[Path | None, typer.Option(help="Write here instead of printing.")] = None,
) -> None:
    """The AsyncAPI 3.0 document of every request subject and event (as docs/asyncapi.json)."""
    from shared.contracts.asyncapi import asyncapi_document
    from shared.infra.service import hetsched_version

    text = json.dumps(asyncapi_document(version=hetsched_version()), indent=2, sort_keys=True) + "\n"
    if out is None:
        print(text, end="")
    else:
        out.write_text(text)
