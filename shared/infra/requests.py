"""Request/reply serving on core NATS, straight on the nats-py connection.

FastStream runs each service's lifecycle and its JetStream consumers; request subjects are served
here because they are the latency path: measured on a 2-core machine, FastStream's per-message
dependency-injection stack capped a trivial responder near 900 requests/s, which is less than the
ledger's own work allows. Every request still goes through the same typed ``dispatch``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.contracts.base import Request
from shared.infra.bus import dispatch

log = logging.getLogger("hetsched.requests")


@dataclass(frozen=True)
class Endpoint:
    subject: str
    queue: str
    model: type[Request]
    handler: Any
    workers: int


@dataclass
class RequestServer:
    """Serves endpoints with up to ``workers`` requests in flight each; stops by draining them."""

    endpoints: list[Endpoint] = field(default_factory=list)
    _subscriptions: list[Subscription] = field(default_factory=list)
    _inflight: set[asyncio.Task[None]] = field(default_factory=set)

    def add(self, endpoint: Endpoint) -> None:
        self.endpoints.append(endpoint)

    async def start(self, nc: Client) -> None:
        for endpoint in self.endpoints:
            self._subscriptions.append(
                await nc.subscribe(endpoint.subject, queue=endpoint.queue, cb=self._callback(endpoint))
            )

    def _callback(self, endpoint: Endpoint) -> Any:
        slots = asyncio.Semaphore(endpoint.workers)

        async def serve(msg: Msg) -> None:
            try:
                reply = await dispatch(msg.data, endpoint.model, endpoint.handler)
                if msg.reply:
                    await msg.respond(reply)
            except Exception:  # dispatch never raises; a failed respond (connection gone) is logged
                log.exception("could not answer a request", extra={"subject": endpoint.subject})
            finally:
                slots.release()

        async def on_message(msg: Msg) -> None:
            # nats-py calls this in order; the work runs as a task so requests are served concurrently,
            # and acquiring a slot here applies back-pressure when `workers` are busy.
            await slots.acquire()
            task = asyncio.create_task(serve(msg))
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
