"""Request/reply serving on core NATS, straight on the nats-py connection.

FastStream runs each service's lifecycle and its JetStream consumers; request subjects are served
here because they are the latency path: measured on a 2-core machine, FastStream's per-message
dependency-injection stack capped a trivial responder near 900 requests/s, which is less than the
ledger's own work allows. Every request still goes through the same typed ``dispatch``.

Deadlines (API.md "Deadlines"): each request carries ``Hetsched-Deadline`` (epoch ms), or gets
``default_deadline_ms`` from now. The handler's task sees it through ``shared.infra.deadline``; a
request whose deadline passed while it waited for a worker is dropped unanswered (its caller has
gone) and counted in ``abandoned``.

Tracing (``shared.infra.tracing``): a request's ``traceparent`` header makes its trace current while it
is served, inside a SERVER span named after the subject without its prefix (``route.select``) when
spans are exported; calls the handler makes are children of it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.trace import SpanKind

from shared.contracts.base import ErrorCode, Request, echo, rejected
from shared.contracts.subjects import Rpc, untoken
from shared.infra import deadline, tracing
from shared.infra.bus import DEFAULT_MAX_REQUEST_BYTES, REPLY_MARGIN_BYTES, dispatch

log = logging.getLogger("hetsched.requests")

_UNREADABLE = "\x00unreadable"


def _scope(subject: str, base: str) -> str | None:
    """The tenant or node a scoped subject names (``base.<token>``), None on the base subject."""
    if subject == base:
        return None
    try:
        return untoken(subject[len(base) + 1 :])
    except ValueError:  # binascii.Error and UnicodeDecodeError are ValueErrors
        return _UNREADABLE


def span_name(subject: str) -> str:
    """A request subject without its prefix (``<prefix>.route.select`` -> ``route.select``), the name of
    the spans that serve it; the subject itself when it is no known one."""
    known = [rpc.value for rpc in Rpc if subject == rpc.value or subject.endswith("." + rpc.value)]
    return max(known, key=len) if known else subject


def _refuse_scope(subject: str) -> bytes:
    return (
        rejected(ErrorCode.INVALID_REQUEST, f"unreadable scope in subject {echo(subject)}").model_dump_json().encode()
    )


@dataclass(frozen=True)
class Endpoint:
    subject: str
    queue: str
    model: type[Request]
    handler: Any
    workers: int
    # A scoped endpoint is also served on ``<subject>.<token>`` (a tenant's or a node's form): the body
    # must then name that tenant or node (``scope_of``), else the reply is ``forbidden``.
    scope_of: Callable[[Any], str | None] | None = None

    @property
    def name(self) -> str:
        """The subject without its prefix: the name of the spans serving it."""
        return span_name(self.subject)


@dataclass
class Load:
    """How busy one subject's workers are: busy slots, and since when all of them have been."""

    workers: int
    busy: int = 0
    full_since: float | None = None
    abandoned: int = 0
    served: int = 0

    def take(self, now: float) -> None:
        self.busy += 1
        if self.busy >= self.workers and self.full_since is None:
            self.full_since = now

    def give_back(self) -> None:
        self.busy -= 1
        if self.busy < self.workers:
            self.full_since = None


@dataclass
class RequestServer:
    """Serves endpoints with up to ``workers`` requests in flight each; stops by draining them."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    default_deadline_ms: float = 10_000
    monotonic: Callable[[], float] = time.monotonic
    endpoints: list[Endpoint] = field(default_factory=list)
    loads: dict[str, Load] = field(default_factory=dict)
    _subscriptions: list[Subscription] = field(default_factory=list)
    _inflight: set[asyncio.Task[None]] = field(default_factory=set)

    def add(self, endpoint: Endpoint) -> None:
        self.endpoints.append(endpoint)
        self.loads[endpoint.subject] = Load(workers=endpoint.workers)

    async def start(self, nc: Client) -> None:
        for endpoint in self.endpoints:
            callback = self._callback(endpoint, nc)
            self._subscriptions.append(await nc.subscribe(endpoint.subject, queue=endpoint.queue, cb=callback))
            if endpoint.scope_of is not None:
                self._subscriptions.append(
                    await nc.subscribe(f"{endpoint.subject}.*", queue=endpoint.queue, cb=callback)
                )

    def saturated(self, *, after_s: float) -> dict[str, float]:
        """Subjects whose every worker has been busy for longer than ``after_s``, with for how long."""
        now = self.monotonic()
        return {
            subject: now - load.full_since
            for subject, load in self.loads.items()
            if load.full_since is not None and now - load.full_since > after_s
        }

    @property
    def abandoned(self) -> int:
        """Requests dropped because their deadline passed before a worker took them."""
        return sum(load.abandoned for load in self.loads.values())

    def _deadline_of(self, msg: Msg) -> float:
        sent = deadline.parse_header((msg.headers or {}).get(deadline.HEADER))
        return sent if sent is not None else deadline.now_ms() + self.default_deadline_ms

    def _callback(self, endpoint: Endpoint, nc: Client) -> Any:
        slots = asyncio.Semaphore(endpoint.workers)
        load = self.loads[endpoint.subject]
        name = endpoint.name
        attributes = {"messaging.system": "nats", "rpc.method": name}

        async def serve(msg: Msg, until_ms: float) -> None:
            try:
                if deadline.now_ms() >= until_ms:
                    load.abandoned += 1  # the caller gave up while the request waited: no work, no reply
                    log.warning("dropped a request whose deadline had passed", extra={"subject": endpoint.subject})
                    return
                deadline.set_deadline(until_ms)  # this task's context only
                with tracing.span(
                    name, kind=SpanKind.SERVER, parent=tracing.extract(msg.headers), attributes=attributes
                ):
                    scope = _scope(msg.subject, endpoint.subject)
                    if scope is _UNREADABLE:
                        reply = _refuse_scope(msg.subject)
                    else:
                        reply = await dispatch(
                            msg.data,
                            endpoint.model,
                            endpoint.handler,
                            max_bytes=self.max_request_bytes,
                            max_reply_bytes=max(1024, nc.max_payload - REPLY_MARGIN_BYTES),
                            scope=scope,
                            scope_of=endpoint.scope_of,
                        )
                load.served += 1
                if msg.reply:
                    await msg.respond(reply)
            except Exception:  # dispatch never raises; a failed respond (connection gone) is logged
                log.exception("could not answer a request", extra={"subject": endpoint.subject})
            finally:
                load.give_back()
                slots.release()

        async def on_message(msg: Msg) -> None:
            # nats-py calls this in order; the work runs as a task so requests are served concurrently,
            # and acquiring a slot here applies back-pressure when `workers` are busy.
            until_ms = self._deadline_of(msg)
            await slots.acquire()
            load.take(self.monotonic())
            task = asyncio.create_task(serve(msg, until_ms))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

        return on_message

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            try:
                await subscription.unsubscribe()
            except Exception:
                pass
        self._subscriptions.clear()
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=10)
