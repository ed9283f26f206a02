"""The filler's loops: the tick (re-issue preemptions the ledger has not acknowledged, re-offer GPUs whose
backoff ended, work out the metrics' figures) and the restatement of every active reservation."""

from __future__ import annotations

import asyncio
import logging

from services.reservation_filler.events import emit
from services.reservation_filler.figures import Pricing, fill_figures, filled
from services.reservation_filler.metrics import METRICS_EVERY_S, ReservationMetrics
from services.reservation_filler.reclaim import Reclaimer
from services.reservation_filler.store import ReservationStore
from shared.contracts.reservation import ReservationEventName
from shared.domain.reservations import LendingPolicy, Preemption, refresh
from shared.infra.uow import UnitOfWork, UnitOfWorkFactory


class Upkeep:
    def __init__(
        self,
        *,
        uow: UnitOfWorkFactory,
        store: ReservationStore,
        policy: LendingPolicy,
        reclaimer: Reclaimer,
        pricing: Pricing,
        log: logging.Logger,
        tick_s: float = 1.0,
        metrics: ReservationMetrics | None = None,
        restate_s: float | None = None,
    ) -> None:
        self._uow = uow
        self._store = store
        self._policy = policy
        self._reclaimer = reclaimer
        self._pricing = pricing
        self._log = log
        self._tick_s = tick_s
        # The brief's SRE metrics (fill rate per customer and cluster, overall; idle cost), worked out by the tick.
        self._metrics = metrics
        self._fill_at = -METRICS_EVERY_S
        self._restate_s = restate_s  # how often every active reservation is restated (``restate``); None: never

    async def start(self) -> None:
        """Re-issue at once what a crash left unacknowledged."""
        try:
            await self.tick_once()
        except Exception:
            self._log.exception("re-issuing preemptions at start failed; the tick will retry")

    async def tick(self) -> None:
        """Forever: re-issue preemptions the ledger has not acknowledged (after a crash or a silent ledger)
        and re-offer accelerators whose backoff ended."""
        elapsed = 0.0
        while True:
            try:
                await self.tick_once()
                if self._metrics is not None and elapsed - self._fill_at >= METRICS_EVERY_S:
                    self._fill_at = elapsed
                    live = await self._uow.read(
                        lambda session: filled(store=self._store, session=session, pricing=self._pricing)
                    )
                    self._metrics.show(fill_figures(live))
            except Exception:
                self._log.exception("reservation tick failed; retrying")
            await asyncio.sleep(self._tick_s)
            elapsed += self._tick_s

    async def tick_once(self) -> int:
        """One pass; how many preemptions it (re-)issued."""

        async def work(uow: UnitOfWork) -> list[Preemption]:
            pending: list[Preemption] = []
            due: list[str] = []
            for reservation in await self._store.load_ticking(session=uow.session):
                pending += [p for p in reservation.preemptions if not p.done]
                if reservation.lends and any(b.until <= uow.now for b in reservation.backoff.values()):
                    due.append(reservation.id)
            # Only the reservations whose backoff may have ended are locked and refreshed.
            for reservation in await self._store.load_many(session=uow.session, ids=due, lock=True):
                uses = await self._store.uses_on(session=uow.session, accelerators=reservation.accelerators)
                after = refresh(reservation, uses, now=uow.now, policy=self._policy)
                if after.version != reservation.version:
                    await self._store.save(session=uow.session, reservation=after, now=uow.now)
                    emit(uow, ReservationEventName.OFFERED, after, reason="backoff")
            return pending

        pending = await self._uow.run(work)
        await self._reclaimer.issue(pending)
        return len(pending)

    async def restate(self) -> None:
        """Forever, from the start and every ``restate_s``: publish every active reservation's whole state again
        (``restated``). Placement folds the RESERVATION stream from its first sequence at each start; the stream
        keeps events only ``HETSCHED_STREAM_RESERVATION_MAX_AGE_S`` (a quarter of which is ``restate_s``), so
        without this a reservation older than that would be missing from the fold (docs/RETENTION.md)."""
        if self._restate_s is None:
            return
        while True:
            try:
                await self.restate_once()
            except Exception:
                self._log.exception("restating the reservations failed; trying again at the next period")
            await asyncio.sleep(self._restate_s)

    async def restate_once(self) -> int:
        """One restatement, in one transaction; how many reservations it restated. The state and its version
        are unchanged: a reader holding them already ignores the event (a state no newer than its own)."""

        async def work(uow: UnitOfWork) -> int:
            reservations = await self._store.load_many(session=uow.session)
            for reservation in reservations:
                emit(
                    uow,
                    ReservationEventName.RESTATED,
                    reservation,
                    accelerators=list(reservation.accelerators),
                    reason="restated",
                )
            return len(reservations)

        return await self._uow.run(work)
