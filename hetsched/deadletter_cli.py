"""`hetsched deadletter list|replay`: what consumers gave up on (the DEADLETTER stream), and sending it again."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, TypeVar

import nats
import typer
from nats.js import JetStreamContext
from rich.console import Console
from rich.table import Table

from hetsched.stack import operator_options, read_state
from shared.contracts.streams import deadletter_stream_name
from shared.infra import deadletter
from shared.infra.settings import load_settings, nats_servers

app = typer.Typer(help="Events consumers gave up on (the DEADLETTER stream): list them, replay one.")
console = Console()
err = Console(stderr=True)
T = TypeVar("T")

DataDirOption = Annotated[Path | None, typer.Option(help="Data dir of a running `hetsched up` (to find its NATS).")]


def _run(data_dir: Path | None, work: Callable[[JetStreamContext, str], Awaitable[T]]) -> T:
    settings = load_settings(kit={"data_dir": data_dir}) if data_dir else load_settings()
    nats_url = settings.kit.nats_url or (read_state(settings) or {}).get("nats_url") or "nats://127.0.0.1:4222"
    stream = deadletter_stream_name(stream_prefix=settings.kit.stream_prefix)

    async def session() -> T:
        nc = await nats.connect(
            nats_servers(nats_url), name="hetsched-cli", max_reconnect_attempts=0, **operator_options(settings)
        )
        try:
            return await work(nc.jetstream(), stream)
        finally:
            await nc.close()

    try:
        return asyncio.run(session())
    except Exception as exc:
        err.print(f"[red]{stream} at {nats_url}: {type(exc).__name__} {exc}[/red]")
        raise typer.Exit(2) from exc


@app.command("list")
def list_(
    limit: Annotated[int, typer.Option(help="Show at most this many, oldest first.")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (bodies included).")] = False,
    data_dir: DataDirOption = None,
) -> None:
    """The dead letters still in the stream: where each came from, which consumer gave up, and why."""
    letters = _run(data_dir, lambda js, stream: deadletter.list_dead_letters(js, stream=stream, limit=limit))
    if as_json:
        rows = [
            {
                "sequence": letter.sequence,
                "original_subject": letter.original_subject,
                "original_sequence": letter.original_sequence,
                "consumer": letter.consumer,
                "deliveries": letter.deliveries,
                "error": letter.error,
                "body": letter.body.decode(errors="replace"),
            }
            for letter in letters
        ]
        console.print_json(json.dumps(rows))
        return
    table = Table("seq", "original subject", "orig seq", "consumer", "deliveries", "error")
    for letter in letters:
        table.add_row(
            str(letter.sequence),
            letter.original_subject,
            letter.original_sequence,
            letter.consumer,
            letter.deliveries,
            letter.error[:120],
        )
    console.print(table)


@app.command()
def replay(
    sequence: Annotated[int, typer.Argument(help="Sequence of the dead letter (`hetsched deadletter list`).")],
    data_dir: DataDirOption = None,
) -> None:
    """Publish a dead letter again on its original subject and remove it (consumers that applied it skip it)."""
    subject = _run(data_dir, lambda js, stream: deadletter.replay(js, stream=stream, sequence=sequence))
    console.print(f"replayed {sequence} onto {subject}")
