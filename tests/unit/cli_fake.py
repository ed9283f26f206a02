"""Running a CLI command with no servers: ``common.with_rpc`` hands the command's work a fake client that
records every ``ask`` and answers one reply (the CLI tests of reservations and the rebalancer)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner, Result

import hetsched.cli as cli
from hetsched.cli import common
from shared.contracts.subjects import Rpc


class FakeClient:
    """Stands in for ``RpcClient``: records every ``ask`` and answers ``reply`` (or, given a list, each
    reply in turn); ``acting`` is the credential the command connected with (None: the operator's)."""

    def __init__(self, reply: BaseModel | list[BaseModel]) -> None:
        self.replies = list(reply) if isinstance(reply, list) else None
        self.reply = reply
        self.calls: list[tuple[Rpc, BaseModel, dict[str, Any]]] = []
        self.acting: Any = None

    async def ask(self, rpc: Rpc, request: BaseModel, reply: type[BaseModel], **options: Any) -> BaseModel:
        self.calls.append((rpc, request, options))
        if self.replies is not None:
            return self.replies[len(self.calls) - 1]
        assert isinstance(self.reply, BaseModel)
        return self.reply


def run_cli(
    monkeypatch: pytest.MonkeyPatch, reply: BaseModel | list[BaseModel], *args: str, env: dict[str, str] | None = None
) -> tuple[Result, FakeClient]:
    """Run `hetsched ARGS` with ``common.with_rpc`` handing ``work`` a fake client."""
    client = FakeClient(reply)

    def with_rpc(
        _data_dir: Path | None, _what: str, work: Callable[[Any], Coroutine[Any, Any, Any]], *, acting: Any = None
    ) -> Any:
        client.acting = acting
        return asyncio.run(work(client))

    monkeypatch.setattr(common, "with_rpc", with_rpc)
    return CliRunner().invoke(cli.app, list(args), env=env), client
