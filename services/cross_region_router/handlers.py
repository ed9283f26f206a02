"""Handlers of the cross-region-router service: one async method per request subject and per event, each
reading like a sentence (parse -> load -> call the pure core -> write + outbox -> reply).

Nothing is built yet: every subject answers `not_implemented` until the request-path issue (14) lands. This class
is where those methods go; ``wire`` in app.py builds it once with its dependencies.
"""

from __future__ import annotations

from shared.infra.clock import Clock
from shared.infra.rpc import RpcClient
from shared.infra.uow import UnitOfWorkFactory


class RoutingHandlers:
    def __init__(self, *, uow: UnitOfWorkFactory, rpc: RpcClient, clock: Clock) -> None:
        self._uow = uow
        self._rpc = rpc
        self._clock = clock
