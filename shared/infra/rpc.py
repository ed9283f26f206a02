"""The one way a process calls another service: typed requests in, typed replies out.

Every caller (services, agents, the command line, the simulator's live mode, tests) uses
``RpcClient``: the request is a contract model, the reply is validated against the model the
subject answers with (``contracts.registry.RPCS``) or is a ``Rejected``, and the timeout comes from
settings. A transport failure (no responder, timeout) raises ``RpcError``; a refusal is a value.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from nats.aio.client import Client as NatsClient
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from opentelemetry.trace import SpanKind
from pydantic import BaseModel, ValidationError

from shared.contracts.base import Rejected
from shared.contracts.fleet import FleetGetReply, FleetGetRequest
from shared.contracts.ledger import SnapshotReply, SnapshotRequest
from shared.contracts.registry import RPCS
from shared.contracts.subjects import TENANT_SCOPED, Rpc, Subjects
from shared.infra import deadline, tracing
from shared.infra.refusal import ConnectionGuard
from shared.infra.refusal import connect as guarded_connect

ReplyT = TypeVar("ReplyT", bound=BaseModel)
PageT = TypeVar("PageT", FleetGetReply, SnapshotReply)
INNER_MARGIN_S = 0.25  # what an inner call leaves its outer request to answer in


class RpcError(Exception):
    """No answer: nobody serves the subject, it timed out, or the reply did not parse."""

    def __init__(self, rpc: Rpc, reason: str) -> None:
        super().__init__(f"{rpc.value}: {reason}")
        self.rpc = rpc
        self.reason = reason


def parse_reply(rpc: Rpc, data: bytes, *, rejection_as_reply: bool = False) -> BaseModel:
    """A raw reply as the subject's reply model, or ``Rejected`` (every refusal's one shape). With
    ``rejection_as_reply``, a refusal the reply model holds stays that model: only ``placement.place`` /
    ``explain`` still refuse in theirs (a ``PlaceReply`` with its ``explanation``; docs/API.md)."""
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


@dataclass
class CallStats:
    """How the recent calls to other services went, per context (``ledger``, ``fleet``, ...): what
    health reads to say a dependency is failing (its latest call got no answer) or slow (the median
    answer of its last ``window`` calls in the last ``horizon_s`` seconds is over the threshold).

    A call that got no answer counts as failing, not as slow: its wait (a timeout) is left out of the
    median, so one dependency that came back does not read slow for a minute. Failing ends with the
    next call that is answered, a health probe's included (``shared.infra.service``), or once the
    failure is older than ``horizon_s``."""

    window: int = 50
    horizon_s: float = 60.0
    calls: dict[str, deque[tuple[float, float, bool]]] = field(default_factory=dict)

    def record(self, rpc: Rpc, *, seconds: float, ok: bool, at: float | None = None) -> None:
        entry = (time.monotonic() if at is None else at, seconds, ok)
        self.calls.setdefault(rpc.value.split(".", 1)[0], deque(maxlen=self.window)).append(entry)

    def slow(self, *, slow_s: float, now: float | None = None) -> dict[str, str]:
        """Contexts whose recent calls failed or whose median took longer than ``slow_s``, and why."""
        since = (time.monotonic() if now is None else now) - self.horizon_s
        out: dict[str, str] = {}
        for context, calls in self.calls.items():
            recent = [(seconds, ok) for at, seconds, ok in calls if at >= since]
            if not recent:
                continue
            failed = sum(1 for _seconds, ok in recent if not ok)
            answered = [seconds for seconds, ok in recent if ok]
            if not recent[-1][1]:  # the latest call got no answer: it is failing now
                out[context] = f"{failed} of the last {len(recent)} calls got no answer, the latest among them"
            elif (median := statistics.median(answered)) > slow_s:
                out[context] = f"median answer {median * 1000:.0f} ms over the last {len(answered)} calls"
        return out

    def failing(self, *, now: float | None = None) -> set[str]:
        """Contexts whose latest call in the last ``horizon_s`` seconds got no answer."""
        since = (time.monotonic() if now is None else now) - self.horizon_s
        return {
            context for context, calls in self.calls.items() if calls and calls[-1][0] >= since and not calls[-1][2]
        }


class RpcClient:
    """Request/reply over one NATS connection (given, or taken from a provider once it is up)."""

    def __init__(
        self,
        connection: NatsClient | Callable[[], NatsClient],
        subjects: Subjects,
        *,
        timeout_s: float = 5.0,
        scope_by_tenant: bool = False,
        guard: ConnectionGuard | None = None,
    ) -> None:
        self._connection = connection
        self.subjects = subjects
        self.timeout_s = timeout_s
        # A gateway's client: public calls go on the subject of the request's tenant (docs/SECURITY.md).
        self.scope_by_tenant = scope_by_tenant
        self.stats = CallStats()
        self._guard = guard  # on a connection of its own: what NATS refused after it was up

    @classmethod
    async def connect(
        cls,
        url: str,
        subjects: Subjects,
        *,
        timeout_s: float = 5.0,
        name: str = "hetsched",
        scope_by_tenant: bool = False,
        operator: bool = False,
        **options: Any,
    ) -> RpcClient:
        """A client on a connection of its own (the command line, tests, gateways); close it with
        ``close``. ``options`` go to ``nats.connect`` (``shared.infra.identity.connect_options``: the
        NKey seed, the inbox prefix, TLS). NATS refusing the credential raises ``NatsRefused`` at once
        (``shared.infra.refusal``; ``operator``: the command line, whose fix is the operator's seed); a
        refusal of its inbox shows when a call gets no answer."""
        guard = ConnectionGuard.of(url, options, operator=operator)
        nc = await guarded_connect(
            url,
            guard,
            name=name,
            connect_timeout=max(1, int(timeout_s)),
            max_reconnect_attempts=2,
            **options,
        )
        return cls(nc, subjects, timeout_s=timeout_s, scope_by_tenant=scope_by_tenant, guard=guard)

    @property
    def nc(self) -> NatsClient:
        conn = self._connection
        return conn if isinstance(conn, NatsClient) else conn()

    async def close(self) -> None:
        if isinstance(self._connection, NatsClient):
            await self._connection.drain()

    async def call(
        self,
        rpc: Rpc,
        request: BaseModel,
        *,
        timeout_s: float | None = None,
        rejection_as_reply: bool = False,
        scope: str | None = None,
    ) -> BaseModel:
        """Send ``request`` on ``rpc``; the reply model, or ``Rejected`` (see ``parse_reply``). With
        ``scope`` (a tenant or a node) it goes on the scoped subject, the one a gateway's or an agent's
        permissions allow (``Subjects.scoped``); else ``scope_by_tenant`` picks the request's tenant.

        The request carries its deadline (``Hetsched-Deadline``): now + the timeout, or, when this
        call is made on behalf of a request whose deadline is nearer, a little before that one, so an
        inner call never outlives the outer one. It carries the current trace context too
        (``traceparent``, ``shared.infra.tracing``), so the server's span joins the caller's trace."""
        timeout = self.inner_timeout_s(timeout_s or self.timeout_s)
        if timeout <= 0:
            raise RpcError(rpc, "the deadline of the request this call serves has passed")
        body = request.model_dump_json(exclude_none=True).encode()
        subject = self._subject(rpc, request, scope)
        with tracing.span(
            rpc.value, kind=SpanKind.CLIENT, attributes={"messaging.system": "nats", "rpc.method": rpc.value}
        ):
            headers = tracing.inject({deadline.HEADER: str(int(deadline.now_ms() + timeout * 1000))})
            started = time.monotonic()
            try:
                msg = await self.nc.request(subject, body, timeout=timeout, headers=headers)
            except NoRespondersError as exc:
                self.stats.record(rpc, seconds=time.monotonic() - started, ok=False)
                raise RpcError(rpc, "no service answers this subject") from exc
            except NatsTimeoutError as exc:
                self.stats.record(rpc, seconds=time.monotonic() - started, ok=False)
                if self._guard is not None and self._guard.refused is not None:
                    raise self._guard.refused from exc  # no answer could come: say which setting to fix
                raise RpcError(rpc, f"no reply within {timeout:g} s") from exc
        self.stats.record(rpc, seconds=time.monotonic() - started, ok=True)
        return parse_reply(rpc, msg.data, rejection_as_reply=rejection_as_reply)

    @staticmethod
    def inner_timeout_s(timeout_s: float) -> float:
        """``timeout_s``, cut to what is left of the current request's deadline less a margin for the
        outer reply (a tenth of it, at most 250 ms); 0 when nothing is left."""
        left = deadline.remaining_s()
        if left is None:
            return timeout_s
        return max(0.0, min(timeout_s, left - min(left / 10, INNER_MARGIN_S)))

    def _subject(self, rpc: Rpc, request: BaseModel, scope: str | None) -> str:
        if scope is None and self.scope_by_tenant and rpc in TENANT_SCOPED:
            scope = getattr(request, "tenant", None)
        return self.subjects.scoped(rpc, scope) if scope is not None else self.subjects.rpc(rpc)

    async def ask(
        self,
        rpc: Rpc,
        request: BaseModel,
        reply: type[ReplyT],
        *,
        timeout_s: float | None = None,
        rejection_as_reply: bool = False,
        scope: str | None = None,
    ) -> ReplyT | Rejected:
        """``call`` with the reply type spelled out for the type checker."""
        answer = await self.call(rpc, request, timeout_s=timeout_s, rejection_as_reply=rejection_as_reply, scope=scope)
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
        # The cross-domain figures cover the whole fleet on every page: the last page's are the newest.
        last = pages[-1] if pages else SnapshotReply()
        return SnapshotReply(
            accelerators=[a for p in pages for a in p.accelerators],
            cross_domain_used=last.cross_domain_used,
            cross_domain=last.cross_domain,
        )
