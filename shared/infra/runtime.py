"""The live parts of one service process (``Runtime``): what ``build_app`` builds and ``wire`` reads."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from shared.contracts.subjects import Context, Subjects
from shared.infra.clock import Clock, system_clock
from shared.infra.follow import Follower, ReadSide
from shared.infra.metrics import ServiceMetrics
from shared.infra.outbox import OutboxRelay
from shared.infra.refusal import NatsRefused
from shared.infra.retention import Pruner
from shared.infra.rpc import RpcClient
from shared.infra.settings import Settings
from shared.infra.uow import UnitOfWorkFactory


@dataclass
class Runtime:
    """The live parts of one service process. Only wiring (``wire``, ``build_app``) sees it; handlers
    get what they use passed by keyword."""

    name: str
    schema: str
    settings: Settings
    subjects: Subjects
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    log: logging.Logger
    uow: UnitOfWorkFactory
    rpc: RpcClient
    clock: Clock = system_clock
    uses_database: bool = True
    nc: NatsClient | None = None
    js: JetStreamContext | None = None
    relay: OutboxRelay | None = None
    pruner: Pruner | None = None  # deletes outbox and inbox rows past their retention
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    # The event consumers, for their counters (redelivered, dead_lettered).
    consumers: list[Any] = field(default_factory=list)  # shared.infra.consumers.EventLoop
    # Its Prometheus metrics (``shared.infra.metrics``), served over HTTP once it starts.
    metrics: ServiceMetrics = field(default_factory=lambda: ServiceMetrics("unknown"))
    # The HTTP front door it serves once started (the gateway's base URL), for its health reply.
    http_url: str | None = None
    # Its followers (``shared.infra.follow``), built before ``wire`` so that it may hand one to what waits on it.
    read_side: ReadSide | None = None
    # Set when NATS refused its credential: the process stops and exits saying which setting to fix.
    refused: NatsRefused | None = None

    def follower(self, context: Context) -> Follower:
        """The kit's follower of ``context`` (declared in the service's ``follows``)."""
        if self.read_side is None or context not in self.read_side.followers:
            raise KeyError(f"{self.name} does not follow {context.value}")
        return self.read_side.followers[context]

    @property
    def nats(self) -> NatsClient:
        """The service's NATS connection (raises before the service has started)."""
        if self.nc is None:
            raise RuntimeError(f"{self.name}: NATS is not connected yet (the service has not started)")
        return self.nc

    @property
    def jetstream(self) -> JetStreamContext:
        if self.js is None:
            raise RuntimeError(f"{self.name}: JetStream is not available yet (the service has not started)")
        return self.js

    def wake_relay(self) -> None:
        if self.relay is not None:
            self.relay.wake()

    def spawn(self, coro: Awaitable[Any], *, name: str) -> None:
        """Run a background loop for the life of the service (cancelled at stop)."""
        self.tasks.append(asyncio.ensure_future(coro))
        self.tasks[-1].set_name(name)
