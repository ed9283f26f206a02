"""The reservation filler's handlers, one object per idea, sharing one store, unit of work and RPC client:

- ``requests``: create, cancel, status and report (``requests.py``);
- ``reclaimer``: preempting borrowers for their owner, and asking the ledger to end them (``reclaim.py``);
- ``uses``: the TOPOLOGY and LEDGER events it follows (``uses.py``);
- ``upkeep``: the tick and the restatement (``upkeep.py``).

The rules are ``shared.domain.reservations``. Every change of a reservation is written with one RESERVATION
event carrying its whole state (``events.py``; placement folds them into its ``ReservationBook``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from services.reservation_filler.figures import Pricing
from services.reservation_filler.metrics import ReservationMetrics
from services.reservation_filler.reclaim import Reclaimer
from services.reservation_filler.requests import RequestHandlers
from services.reservation_filler.store import ReservationStore
from services.reservation_filler.upkeep import Upkeep
from services.reservation_filler.uses import UseHandlers
from shared.domain.hardware import Sku
from shared.domain.quotas import Quotas
from shared.domain.reservations import LendingPolicy
from shared.domain.routing import Region
from shared.infra.rpc import RpcClient
from shared.infra.uow import UnitOfWorkFactory


class ReservationHandlers:
    def __init__(
        self,
        *,
        uow: UnitOfWorkFactory,
        rpc: RpcClient,
        store: ReservationStore,
        policy: LendingPolicy,
        skus: Mapping[str, Sku],
        regions: Mapping[str, Region],
        tick_s: float = 1.0,
        log: logging.Logger | None = None,
        after_record: Callable[[], None] = lambda: None,
        metrics: ReservationMetrics | None = None,
        quotas: Quotas | None = None,
        restate_s: float | None = None,
    ) -> None:
        log = log or logging.getLogger("hetsched.reservation")
        pricing = Pricing(skus=skus, regions=regions)
        self.requests = RequestHandlers(uow=uow, store=store, policy=policy, pricing=pricing, quotas=quotas)
        self.reclaimer = Reclaimer(uow=uow, store=store, rpc=rpc, policy=policy, log=log, after_record=after_record)
        self.uses = UseHandlers(store=store, policy=policy)
        self.upkeep = Upkeep(
            uow=uow,
            store=store,
            policy=policy,
            reclaimer=self.reclaimer,
            pricing=pricing,
            log=log,
            tick_s=tick_s,
            metrics=metrics,
            restate_s=restate_s,
        )
