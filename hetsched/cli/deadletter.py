"""`hetsched deadletter list|replay`: what consumers gave up on (the DEADLETTER stream), and sending it again."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from nats.js import JetStreamContext

from hetsched.cli import common
from hetsched.cli.common import DataDirOption, console, settings_of
from shared.contracts.streams import deadletter_stream_name
from shared.infra import deadletter

app = typer.Typer(help="Events consumers gave up on (the DEADLETTER stream): list them, replay one.")
T = TypeVar("T")


def _run(data_dir: Path | None, work: Callable[[JetStreamContext, str], Awaitable[T]]) -> T:
    """``work`` on the stack's JetStream and the DEADLETTER stream's name (no answer exits 2)."""
    stream = deadletter_stream_name(stream_prefix=settings_of(data_dir).kit.stream_prefix)
    return common.with_rpc(data_dir, f"the {stream} stream", lambda client: work(client.nc.jetstream(), stream))


@app.command("list")
def list_(
    limit: Annotated[int, typer.Option(help="Show at most this many, oldest first.")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (bodies included).")] = False,
    wide: common.WideOption = False,
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
    lines = [
        [
            str(letter.sequence),
            letter.original_subject,
            str(letter.original_sequence),
            letter.consumer,
            str(letter.deliveries),
            letter.error,
        ]
        for letter in letters
    ]
    common.table(["seq", "original subject", "orig seq", "consumer", "deliveries", "error"], lines, wide=wide)


@app.command()
def replay(
    sequence: Annotated[int, typer.Argument(help="Sequence of the dead letter (`hetsched deadletter list`).")],
    data_dir: DataDirOption = None,
) -> None:
    """Publish a dead letter again on its original subject and remove it (consumers that applied it skip it)."""
    subject = _run(data_dir, lambda js, stream: deadletter.replay(js, stream=stream, sequence=sequence))
    console.print(f"replayed {sequence} onto {subject}")
