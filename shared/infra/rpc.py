"""The one way a process calls another service: typed requests in, typed replies out.

Every caller (services, agents, the command line, the simulator's live mode, tests) uses
``RpcClient``: the request is a contract model, the reply is validated against the model the
subject answers with (``contracts.registry.RPCS``) or is a ``Rejected``, and the timeout comes from
settings. A transport failure (no responder, timeout) raises ``RpcError``; a refusal is a value.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NatsClient
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from pydantic import BaseModel, ValidationError

from shared.contracts.base import Rejected
from shared.contracts.fleet import FleetGetReply, FleetGetRequest
from shared.contracts.ledger import SnapshotReply, SnapshotRequest
from shared.contracts.registry import RPCS
from shared.contracts.subjects import Rpc, Subjects

ReplyT = TypeVar("ReplyT", bound=BaseModel)
PageT = TypeVar("PageT", FleetGetReply, SnapshotReply)


class RpcError(Exception):
    """No answer: nobody serves the subject, it timed out, or the reply did not parse."""

    def __init__(self, rpc: Rpc, reason: str) -> None:
        super().__init__(f"{rpc.value}: {reason}")
        self.rpc = rpc
        self.reason = reason


def parse_reply(rpc: Rpc, data: bytes, *, rejection_as_reply: bool = False) -> BaseModel:
    """A raw reply as the subject's reply model, or ``Rejected``. With ``rejection_as_reply``, a refusal
    the reply model can hold (e.g. a ``PlaceReply`` with its ``explanation``) stays that model."""
    try:
        body: Any = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RpcError(rpc, f"reply is not JSON: {exc}") from exc
    if rejection_as_reply:
        try:
            return RPCS[rpc][1].model_validate(body)
        except ValidationError:
            pass  # not the reply model's shape (e.g. an invalid request): a plain Rejected below
    try:
        if isinstance(body, dict) and body.get("status") == "rejected" and isinstance(body.get("error"), dict):
            return Rejected.model_validate(body)
        return RPCS[rpc][1].model_validate(body)
    except ValidationError as exc:
        raise RpcError(rpc, f"reply does not match its contract: {exc.errors()[:2]}") from exc


class RpcClient:
    """Request/reply over one NATS connection (given, or taken from a provider once it is up)."""

    def __init__(
        self,
        connection: NatsClient | Callable[[], NatsClient],
        subjects: Subjects,
        *,
        timeout_s: float = 5.0,
    ) -> None:
        self._connection = connection
        self.subjects = subjects
        self.timeout_s = timeout_s

    @classmethod
    async def connect(
        cls, url: str, subjects: Subjects, *, timeout_s: float = 5.0, name: str = "hetsched"
    ) -> RpcClient:
        """A client on a connection of its own (the command line, tests); close it with ``close``."""
        nc = await nats.connect(url, name=name, connect_timeout=max(1, int(timeout_s)), max_reconnect_attempts=2)
        return cls(nc, subjects, timeout_s=timeout_s)

    @property
    def nc(self) -> NatsClient:
        conn = self._connection
        return conn if isinstance(conn, NatsClient) else conn()

    async def close(self) -> None:
        if isinstance(self._connection, NatsClient):
            await self._connection.drain()

    async def call(
        self, rpc: Rpc, request: BaseModel, *, timeout_s: float | None = None, rejection_as_reply: bool = False
    ) -> BaseModel:
        """Send ``request`` on ``rpc``; the reply model, or ``Rejected`` (see ``parse_reply``)."""
        body = request.model_dump_json(exclude_none=True).encode()
        try:
            msg = await self.nc.request(self.subjects.rpc(rpc), body, timeout=timeout_s or self.timeout_s)
        except NoRespondersError as exc:
            raise RpcError(rpc, "no service answers this subject") from exc
        except NatsTimeoutError as exc:
            raise RpcError(rpc, f"no reply within {timeout_s or self.timeout_s:g} s") from exc
        return parse_reply(rpc, msg.data, rejection_as_reply=rejection_as_reply)

    async def ask(
        self,
        rpc: Rpc,
        request: BaseModel,
        reply: type[ReplyT],
        *,
        timeout_s: float | None = None,
        rejection_as_reply: bool = False,
    ) -> ReplyT | Rejected:
        """``call`` with the reply type spelled out for the type checker."""
        answer = await self.call(rpc, request, timeout_s=timeout_s, rejection_as_reply=rejection_as_reply)
        if isinstance(answer, Rejected):
            return answer
        if not isinstance(answer, reply):
            raise RpcError(rpc, f"expected {reply.__name__}, got {type(answer).__name__}")
        return answer

    async def _pages(self, rpc: Rpc, first: BaseModel, reply: type[PageT]) -> list[PageT] | Rejected:
        """Every page of a paged subject: the request is re-sent with each ``next_cursor``."""
        pages: list[PageT] = []
        request = first
        while True:
            page = await self.ask(rpc, request, reply)
            if isinstance(page, Rejected):
                return page
            pages.append(page)
            cursor = getattr(page, "next_cursor", None)
            if not cursor:
                return pages
            request = request.model_copy(update={"cursor": cursor})

    async def fleet(
        self, *, region: str | None = None, limit: int | None = None, profiles: bool = False
    ) -> FleetGetReply | Rejected:
        """Every page of ``fleet.get`` merged into one reply (pods and racks come with the first page);
        ``profiles`` asks for each node's whole profile too."""
        pages = await self._pages(
            Rpc.FLEET_GET, FleetGetRequest(region=region, limit=limit, profiles=profiles), FleetGetReply
        )
        if isinstance(pages, Rejected):
            return pages
        domains = list({d.id: d for p in pages for d in p.domains}.values())  # a domain may span pages
        return pages[0].model_copy(
            update={"nodes": [n for p in pages for n in p.nodes], "domains": domains, "next_cursor": None}
        )

    async def ledger_snapshot(self, *, node: str | None = None, limit: int | None = None) -> SnapshotReply | Rejected:
        """Every page of ``ledger.snapshot`` merged into one reply."""
        pages = await self._pages(Rpc.LEDGER_SNAPSHOT, SnapshotRequest(node=node, limit=limit), SnapshotReply)
        if isinstance(pages, Rejected):
            return pages
        return SnapshotReply(accelerators=[a for p in pages for a in p.accelerators])
