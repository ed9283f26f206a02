"""Placement's use cases, each its own module and class, sharing explicitly injected collaborators:

- ``place``: ``placement.place`` / ``placement.explain`` (``Placing``), over ``intents`` (a request id's
  intent, as one attempt writes it), ``commit`` (reserving in the ledger), ``deciding`` (the view as a
  tenant may use it), ``tally`` (quotas) and ``reclaim`` (read-your-writes on reservations, an owner's
  reclaim from borrowers);
- ``queue``: the queue of requests waiting for capacity (``PlacementQueue``);
- ``lifecycle``: release / renew, and the LEDGER events that end placement's allocations (``Lifecycle``);
- ``reconcile``: stuck intents and allocations no decision owns (``Reconciler``);
- ``admission``: ``placement.admit`` (``AdmissionHandlers``, built on its own).

``PlacementHandlers.build`` wires them (the one place that knows the graph); app.py routes to them."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.placement.admission import AdmissionHandlers
from services.placement.attempts import Ownership, Queueing
from services.placement.commit import Committer
from services.placement.deciding import Decider, View
from services.placement.first_lease import FirstLeases
from services.placement.intents import Intents
from services.placement.lifecycle import Lifecycle
from services.placement.metrics import PlacementMetrics
from services.placement.place import MAX_ATTEMPTS, WAIT_POLL_S, Placing
from services.placement.queue import PlacementQueue
from services.placement.reclaim import Reclaimer
from services.placement.reconcile import Reconciler
from services.placement.store import DecisionStore
from services.placement.tally import QuotaTally
from shared.contracts.placement import PlaceReply, PlaceRequest
from shared.domain.quotas import Quotas
from shared.domain.reservations import ReservationBook
from shared.infra.clock import Clock, MonotonicMs
from shared.infra.locks import KeyedLocks
from shared.infra.metrics import ServiceMetrics
from shared.infra.rpc import RpcClient
from shared.infra.uow import UnitOfWorkFactory


@dataclass(frozen=True, slots=True)
class PlacementHandlers:
    """Placement's use cases, wired to one another."""

    placing: Placing
    queue: PlacementQueue
    lifecycle: Lifecycle
    reconciler: Reconciler
    tally: QuotaTally
    decider: Decider
    ids: KeyedLocks  # one lock per (tenant, request id) in this process: requests with one id take turns
    first_leases: FirstLeases  # replicas on their first lease, until a renew or an engine's report

    @classmethod
    def build(
        cls,
        *,
        view: View,
        store: DecisionStore,
        uow: UnitOfWorkFactory,
        rpc: RpcClient,
        timer: MonotonicMs,
        default_lease_s: int,
        ownership: Ownership,
        clock: Clock,
        log: logging.Logger | None = None,
        after_commit: Callable[[], None] = lambda: None,
        max_attempts: int = MAX_ATTEMPTS,
        poll_s: float = WAIT_POLL_S,
        queueing: Queueing | None = None,
        admission: AdmissionHandlers | None = None,
        reservations: ReservationBook | None = None,
        holds: Callable[[str], bool] = lambda _allocation_id: False,
        throttled: Callable[[], set[str]] = set,
        metrics: PlacementMetrics | None = None,
        reservations_current: Callable[[float], Awaitable[str | None]] | None = None,
        quotas: Quotas | None = None,
        first_lease_s: int | None = None,
        direct: bool = True,
    ) -> PlacementHandlers:
        """The use cases over one view, store, unit of work and RPC client. ``reservations``: the book
        the read model folds; ``holds``: does the view still count an allocation; ``throttled``: nodes the
        rebalancer throttles; ``reservations_current``: read-your-writes (waits, at most the seconds given,
        until the book holds every reservation in the stream; None once it does, else why not);
        ``first_lease_s``: a new replica's first lease on the direct path (None: the whole lease at once);
        ``direct``: False sends every placement down the intent path (its intent written before the commit and
        its outcome after it), the path queued requests and records too large for the commit take anyway."""
        log = log or logging.getLogger("hetsched.placement")
        metrics = metrics or PlacementMetrics.create(ServiceMetrics("placement"))
        queueing = queueing or Queueing()
        reservations = reservations or ReservationBook()
        ids = KeyedLocks()
        decider = Decider(reservations=reservations, throttled=throttled, timer=timer, metrics=metrics)
        tally = QuotaTally(view=view, store=store, uow=uow, quotas=quotas or Quotas(), metrics=metrics)
        intents = Intents(
            store=store, uow=uow, ownership=ownership, queueing=queueing, tally=tally, admission=admission
        )
        first_leases = FirstLeases(store=store, uow=uow, rpc=rpc, log=log)

        def placed(request: PlaceRequest, reply: PlaceReply, lease_s: int) -> None:
            """A direct placement answered: admission may route to it, and it is on its first lease."""
            if admission is not None:
                admission.on_placed(request.tenant, reply)
            if first_lease_s is not None and lease_s > first_lease_s and reply.allocation_id is not None:
                nodes = [p.node for p in reply.placements]
                first_leases.add(reply.allocation_id, tenant=request.tenant, lease_s=lease_s, nodes=nodes)

        committer = Committer(
            rpc=rpc,
            intents=intents,
            tally=tally,
            timer=timer,
            metrics=metrics,
            default_lease_s=default_lease_s,
            after_commit=after_commit,
            first_lease_s=first_lease_s,
            placed=placed,
        )
        reclaimer = Reclaimer(
            view=view,
            decider=decider,
            intents=intents,
            rpc=rpc,
            clock=clock,
            log=log,
            reservations=reservations,
            holds=holds,
            reservations_current=reservations_current,
        )
        placing = Placing(
            view=view,
            decider=decider,
            tally=tally,
            intents=intents,
            committer=committer,
            reclaimer=reclaimer,
            ids=ids,
            ownership=ownership,
            metrics=metrics,
            max_attempts=max_attempts,
            poll_s=poll_s,
            direct=direct,
        )
        queue = PlacementQueue(
            view=view,
            decider=decider,
            tally=tally,
            intents=intents,
            placing=placing,
            reclaimer=reclaimer,
            store=store,
            uow=uow,
            ids=ids,
            clock=clock,
            queueing=queueing,
            metrics=metrics,
            log=log,
        )
        return cls(
            placing=placing,
            queue=queue,
            lifecycle=Lifecycle(
                store=store,
                uow=uow,
                rpc=rpc,
                tally=tally,
                admission=admission,
                freed=queue.wake,
                first_leases=first_leases,
                first_lease_s=first_lease_s,
            ),
            reconciler=Reconciler(store=store, uow=uow, rpc=rpc, ownership=ownership, clock=clock, log=log),
            tally=tally,
            decider=decider,
            ids=ids,
            first_leases=first_leases,
        )
