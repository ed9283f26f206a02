"""Handlers of the reservation-filler service: one async method per request subject and per event, each
reading like a sentence (parse -> load -> call the pure core -> write + outbox -> reply).

The filler learns the GPUs from TOPOLOGY events (``inventory``) and who holds what from LEDGER events
(``uses``); the rules are ``shared.domain.reservations``. Every change of a reservation is written with
one RESERVATION event carrying its whole state (placement folds them into its ``ReservationBook``).

Reclaim (placement asks, for an owner): the preemptions are written, with their ``preempted`` events,
*before* the ledger is asked to end the borrowers' allocations; the answer marks them done. A filler
killed in between finds them not done when it starts (and on every tick) and asks again:
``ledger.preempt`` is idempotent and only ever shortens a preemptible allocation's lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession

from services.reservation_filler import store
from services.reservation_filler.metrics import METRICS_EVERY_S, FillFigures, ReservationMetrics
from shared.contracts.base import Rejected, echo, rejected
from shared.contracts.envelope import EventEnvelope
from shared.contracts.ledger import AllocationEvent, LedgerPreemptReply, LedgerPreemptRequest
from shared.contracts.reservation import (
    ReservationCancelReply,
    ReservationCancelRequest,
    ReservationCreateReply,
    ReservationCreateRequest,
    ReservationEvent,
    ReservationEventName,
    ReservationReclaimReply,
    ReservationReclaimRequest,
    ReservationReportReply,
    ReservationReportRequest,
    ReservationStatusReply,
    ReservationStatusRequest,
    ReservationStatusView,
    preemption_view,
    state_of,
)
from shared.contracts.subjects import Context, Rpc
from shared.contracts.topology import NodeProfileEvent, NodeStateEvent
from shared.domain.errors import ErrorCode
from shared.domain.fleet import AcceleratorId, cluster_key
from shared.domain.hardware import Sku
from shared.domain.quotas import Quota, Quotas, exceeded
from shared.domain.reservations import (
    LendingPolicy,
    Preemption,
    Reservation,
    Slot,
    Usage,
    Use,
    cancel,
    choose,
    fill_rate,
    idle_cost_usd_per_hour,
    preemption_done,
    reclaim,
    refresh,
    usage,
)
from shared.domain.routing import Region
from shared.infra import deadline
from shared.infra.clock import Clock
from shared.infra.rpc import RpcClient, RpcError
from shared.infra.uow import UnitOfWork, UnitOfWorkFactory

PREEMPT_TIMEOUT_S = 2.0
ANNOUNCE_POLL_S = 0.005
ANNOUNCE_WAIT_S = 10.0
ANNOUNCE_MARGIN_S = 0.25
"""How often, and how long at most (the caller's deadline less a margin for the answer), ``create`` waits
for the relay to publish its event."""


@dataclass(frozen=True, slots=True)
class Filled:
    """One live reservation's use now: whole, per cluster of its accelerators, and its idle cost."""

    tenant: str
    usage: Usage
    by_cluster: Mapping[str, Usage]
    idle_cost_usd_per_hour: float


def fill_figures(filled: Sequence[Filled]) -> FillFigures:
    """The metrics' figures: fill rate per (tenant, cluster) and overall, idle cost per tenant."""
    by_scope: dict[tuple[str, str], list[Usage]] = {}
    idle: dict[str, float] = {}
    for f in filled:
        idle[f.tenant] = idle.get(f.tenant, 0.0) + f.idle_cost_usd_per_hour
        for cluster, part in f.by_cluster.items():
            by_scope.setdefault((f.tenant, cluster), []).append(part)
    return FillFigures(
        by_tenant_cluster={scope: rate for scope, u in by_scope.items() if (rate := fill_rate(u)) is not None},
        overall=fill_rate([f.usage for f in filled]),
        idle_cost_by_tenant=idle,
    )


def new_reservation_id() -> str:
    return f"res-{uuid.uuid4().hex[:16]}"


@dataclass(frozen=True, slots=True)
class _Change:
    """A reservation before and after a change, and the event that tells of it."""

    before: Reservation
    after: Reservation


def _event_name(change: _Change, allocation_id: str | None) -> ReservationEventName | None:
    """What the change is, seen from ``allocation_id``'s event: it became a borrower (``lent``), it stopped
    being one (``reclaimed``), or only the offer (or other state) moved (``offered``); None: no change."""
    if change.after.version == change.before.version:
        return None
    if allocation_id is not None:
        was = change.before.borrow(allocation_id) is not None
        now = change.after.borrow(allocation_id) is not None
        if now and not was:
            return ReservationEventName.LENT
        if was and not now:
            return ReservationEventName.RECLAIMED
    return ReservationEventName.OFFERED


class ReservationHandlers:
    def __init__(
        self,
        *,
        uow: UnitOfWorkFactory,
        rpc: RpcClient,
        clock: Clock,
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
        self._quotas = quotas or Quotas()  # per tenant: ``gpus_reserved`` is checked by ``create``
        self._restate_s = restate_s  # how often every active reservation is restated (``restate``); None: never
        self._marking: set[asyncio.Task[None]] = set()
        # The brief's SRE metrics (fill rate per customer and cluster, overall; idle cost), worked out by the tick.
        self._metrics = metrics
        self._fill_at = -METRICS_EVERY_S
        self._after_record = after_record  # a fault-injection point for tests (HETSCHED_RESERVATION_FAULT_AFTER_RECORD)
        self._uow = uow
        self._rpc = rpc
        self._clock = clock
        self._policy = policy
        self._skus = skus
        self._regions = regions
        self._tick_s = tick_s
        self._log = log or logging.getLogger("hetsched.reservation")

    # -- requests ---------------------------------------------------------------------------------

    async def create(self, request: ReservationCreateRequest) -> BaseModel:
        """Reserve ``count`` GPUs of ``sku`` in ``region`` (whole nodes first), or the ones named: none may
        be in another reservation or used by another tenant. The same ``request_id`` answers the same."""
        if request.accelerators:
            for acc in request.accelerators:
                try:
                    parsed = AcceleratorId.parse(acc)
                except ValueError:
                    return rejected(ErrorCode.INVALID_REQUEST, f"not an accelerator id: {acc[:64]!r}")
                if parsed.gpu_index is None:
                    return rejected(ErrorCode.INVALID_REQUEST, "TPU chips cannot be reserved (GPUs only for now)")
        elif request.sku not in self._skus:
            return rejected(ErrorCode.UNKNOWN_SKU, f"no SKU {request.sku!r} in the catalog")

        async def work(uow: UnitOfWork) -> BaseModel:
            if request.request_id is not None:
                earlier = await store.load_by_request(
                    session=uow.session, tenant=request.tenant, request_id=request.request_id
                )
                if earlier is not None:
                    return ReservationCreateReply(
                        status="created",
                        reservation_id=earlier.id,
                        accelerators=list(earlier.accelerators),
                        duplicate=True,
                    )
            taken = await store.held(session=uow.session)
            others = await store.used_by_others(session=uow.session, tenant=request.tenant)
            if request.accelerators:
                known = await store.inventory(session=uow.session, ids=request.accelerators)
                unknown = [acc for acc in request.accelerators if acc not in known]
                if unknown:
                    return rejected(ErrorCode.NOT_FOUND, f"no such GPU in the fleet: {', '.join(unknown[:8])}")
                clash = [acc for acc in request.accelerators if acc in taken or acc in others]
                if clash:
                    return _in_use(len(clash), len(request.accelerators))
                chosen = tuple(request.accelerators)
                slots = [known[acc] for acc in chosen]
                skus = {s.sku for s in slots}
                regions = {s.region for s in slots}
                sku = skus.pop() if len(skus) == 1 else None
                region = regions.pop() if len(regions) == 1 else None
            else:
                assert request.count is not None and request.sku is not None and request.region is not None
                inventory = await store.inventory(session=uow.session)
                picked = choose(
                    inventory.values(),
                    count=request.count,
                    sku=request.sku,
                    region=request.region,
                    taken=taken,
                    used_by_others=others,
                )
                if picked is None:
                    free = sum(
                        1
                        for s in inventory.values()
                        if s.sku == request.sku
                        and s.region == request.region
                        and s.id not in taken
                        and s.id not in others
                    )
                    return rejected(
                        ErrorCode.NO_CAPACITY,
                        f"{free} {request.sku} GPU(s) in {request.region} are neither reserved nor used by "
                        f"another tenant; {request.count} asked",
                        free=free,
                    )
                chosen, sku, region = picked, request.sku, request.region
            # Past its tenant's quota: refused, nothing written (after the capacity checks, which answer
            # a request for more than exists as they always did).
            over = await self._over_quota(uow, request)
            if over is not None:
                return over
            reservation = Reservation(
                id=new_reservation_id(),
                tenant=request.tenant,
                policy=request.policy,
                accelerators=chosen,
                created_at=uow.now,
                sku=sku,
                region=region,
                spot_eviction_s=request.spot_eviction_s,
            )
            uses = await store.uses_on(session=uow.session, accelerators=chosen)
            reservation = refresh(reservation, uses, now=uow.now, policy=self._policy)
            reservation = _first_version(reservation)
            await store.add(session=uow.session, reservation=reservation, request_id=request.request_id, now=uow.now)
            self._emit(uow, ReservationEventName.CREATED, reservation, accelerators=list(chosen))
            return ReservationCreateReply(status="created", reservation_id=reservation.id, accelerators=list(chosen))

        try:
            created = await self._uow.run(work)
        except store.HeldElsewhere as exc:  # a concurrent create took some of them first
            return _in_use(len(exc.accelerators), len(request.accelerators or ()) or request.count or 0)
        return await self._announced(created)

    async def _announced(self, reply: BaseModel) -> BaseModel:
        """Read-your-writes (docs/RESERVATIONS.md): ``created`` is answered only once the relay has
        published every event written until now, this reservation's ``created`` among them (JetStream
        acknowledged it). Placement, before it decides, waits for its view to reach the stream's end as
        it was when the request arrived, so it knows of every reservation answered before. A repeat of
        the request id waits the same: its first answer may have been lost before the event left."""
        if not isinstance(reply, ReservationCreateReply):
            return reply
        tail = await self._uow.read(lambda session: store.unsent_tail(session=session))
        if tail is None:  # the relay has published everything already
            return reply
        through: int = tail
        left_s = deadline.remaining_s(default_s=ANNOUNCE_WAIT_S) or 0.0
        until = time.monotonic() + left_s - min(left_s / 10, ANNOUNCE_MARGIN_S)  # the rest is the answer's
        while await self._uow.read(lambda session: store.unsent_through(session=session, seq=through)):
            if time.monotonic() >= until:
                return rejected(
                    ErrorCode.INTERNAL,
                    f"reservation {reply.reservation_id} is recorded, but NATS JetStream has not acknowledged its "
                    "event yet, so placement may not know of it: ask again with the same request_id (or see "
                    "reservation.status) before relying on it",
                    reservation_id=reply.reservation_id,
                )
            self._uow.wake()
            await asyncio.sleep(ANNOUNCE_POLL_S)
        return reply

    async def _over_quota(self, uow: UnitOfWork, request: ReservationCreateRequest) -> Rejected | None:
        """``quota_exceeded`` when the reservation would take its tenant past ``gpus_reserved``: the GPUs of
        its active reservations, counted under a lock per tenant to the end of the transaction (two
        concurrent creates of one tenant count one after the other)."""
        if self._quotas.limit(request.tenant, Quota.GPUS_RESERVED) is None:
            return None
        asked = len(request.accelerators) if request.accelerators else request.count or 0
        used = await store.reserved_by(session=uow.session, tenant=request.tenant)
        over = exceeded(self._quotas, request.tenant, Quota.GPUS_RESERVED, used=used, asked=asked)
        return None if over is None else rejected(ErrorCode.QUOTA_EXCEEDED, over.message, **over.details())

    async def cancel(self, request: ReservationCancelRequest) -> BaseModel:
        async def work(uow: UnitOfWork) -> BaseModel:
            reservation = await store.load(session=uow.session, reservation_id=request.reservation_id, lock=True)
            if reservation is None or reservation.tenant != request.tenant:  # alike: the id says nothing
                return _no_reservation(request.reservation_id)
            if not reservation.active:
                return ReservationCancelReply(status="cancelled", reservation_id=reservation.id, already=True)
            after = cancel(reservation)
            await store.save(session=uow.session, reservation=after, now=uow.now)
            self._emit(uow, ReservationEventName.CANCELLED, after, accelerators=list(after.accelerators))
            return ReservationCancelReply(status="cancelled", reservation_id=after.id)

        return await self._uow.run(work)

    async def status(self, request: ReservationStatusRequest) -> BaseModel:
        """The tenant's reservations (only its own) with usage, fill rate and idle cost."""

        async def read(uow: UnitOfWork) -> BaseModel:
            if request.reservation_id is not None:
                one = await store.load(session=uow.session, reservation_id=request.reservation_id)
                if one is None or not one.active or one.tenant != request.tenant:  # alike: the id says nothing
                    return _no_reservation(request.reservation_id)
                reservations = [one]
            else:
                reservations = await store.load_many(session=uow.session, tenant=request.tenant)
            views: list[ReservationStatusView] = []
            usages: list[Usage] = []
            idle_cost = 0.0
            for reservation in reservations:
                uses = await store.uses_on(session=uow.session, accelerators=reservation.accelerators)
                current = usage(reservation, uses)
                usages.append(current)
                view = self._view(reservation, current)
                idle_cost += view.idle_cost_usd_per_hour
                views.append(view)
            return ReservationStatusReply(
                reservations=views, fill_rate=_round(fill_rate(usages)), idle_cost_usd_per_hour=round(idle_cost, 4)
            )

        return await self._uow.run(read)

    async def report(self, request: ReservationReportRequest) -> BaseModel:
        """Operators: fill rate overall, per tenant and per cluster, and what idle reserved capacity costs."""

        async def read(uow: UnitOfWork) -> BaseModel:
            filled = await self._filled(uow.session)
            by_tenant: dict[str, list[Usage]] = {}
            by_cluster: dict[str, list[Usage]] = {}
            for f in filled:
                by_tenant.setdefault(f.tenant, []).append(f.usage)
                for cluster, part in f.by_cluster.items():
                    by_cluster.setdefault(cluster, []).append(part)
            total = [f.usage for f in filled]
            idle_cost = sum(f.idle_cost_usd_per_hour for f in filled)
            return ReservationReportReply(
                fill_rate=_round(fill_rate(total)),
                by_tenant={t: _round(fill_rate(u)) or 0.0 for t, u in sorted(by_tenant.items())},
                by_cluster={c: _round(fill_rate(u)) or 0.0 for c, u in sorted(by_cluster.items())},
                reserved=sum(u.total for u in total),
                owner_used=sum(len(u.owner_used) for u in total),
                lent=sum(len(u.lent) for u in total),
                idle_cost_usd_per_hour=round(idle_cost, 4),
            )

        return await self._uow.run(read)

    async def _filled(self, session: AsyncSession) -> list[Filled]:
        """Every live reservation's use now (what the report and the metrics are worked out from)."""
        reservations = await store.load_many(session=session)
        everything = {acc for r in reservations for acc in r.accelerators}
        uses = await store.uses_on(session=session, accelerators=everything)
        inventory = await store.inventory(session=session, ids=everything)
        filled: list[Filled] = []
        for reservation in reservations:
            current = usage(reservation, uses)
            filled.append(
                Filled(
                    tenant=reservation.tenant,
                    usage=current,
                    by_cluster={
                        cluster: _restricted(current, accs)
                        for cluster, accs in _by_cluster(reservation.accelerators, inventory).items()
                    },
                    idle_cost_usd_per_hour=self._view(reservation, current).idle_cost_usd_per_hour,
                )
            )
        return filled

    async def reclaim(self, request: ReservationReclaimRequest) -> BaseModel:
        """Placement, for an owner: preempt these borrowers of its reservations (LIFO was placement's
        choice). Written first, then the ledger is asked; the reply says which the ledger acknowledged."""

        async def work(uow: UnitOfWork) -> list[Preemption] | Rejected:
            reservations = await store.load_many(session=uow.session, tenant=request.tenant, lock=True)
            wanted = set(request.allocation_ids)
            issued: list[Preemption] = []
            for reservation in reservations:
                mine = [a for a in request.allocation_ids if reservation.borrow(a) is not None]
                if not mine or not reservation.lends:
                    continue
                after, preemptions = reclaim(
                    reservation, mine, now=uow.now, policy=self._policy, request_id=request.request_id
                )
                issued += preemptions
                wanted -= set(mine)
                if after.version != reservation.version:
                    await store.save(session=uow.session, reservation=after, now=uow.now)
                    for p in preemptions:
                        if reservation.preemption(p.allocation_id) is None:
                            self._emit(uow, ReservationEventName.PREEMPTED, after, preemption=p, reason="owner_demand")
            if not issued:
                return rejected(
                    ErrorCode.NOT_FOUND,
                    "none of these allocations borrows a soft or spot reservation of this tenant",
                    allocation_ids=sorted(wanted)[:64],
                )
            return issued

        outcome = await self._uow.run(work)
        if isinstance(outcome, Rejected):
            return outcome
        self._after_record()
        acknowledged = await self._issue([p for p in outcome if not p.done])
        views = [preemption_view(p if p.done else _done(p, acknowledged)) for p in outcome]
        return ReservationReclaimReply(status="preempted", preemptions=views)

    # -- the ledger's side of a preemption -------------------------------------------------------

    async def _issue(self, preemptions: Sequence[Preemption]) -> set[str]:
        """Ask the ledger to end each borrower's allocation by its deadline; mark those it acknowledged
        done. The allocation ids acknowledged."""
        if not preemptions:
            return set()

        async def one(p: Preemption) -> str | None:
            ask = LedgerPreemptRequest(
                allocation_id=p.allocation_id, deadline_at=p.deadline_at, reservation_id=p.reservation_id
            )
            try:
                answer = await self._rpc.ask(Rpc.LEDGER_PREEMPT, ask, LedgerPreemptReply, timeout_s=PREEMPT_TIMEOUT_S)
            except RpcError as exc:
                self._log.warning("ledger.preempt %s: %s (re-issued on the next tick)", p.allocation_id, exc)
                return None
            if isinstance(answer, Rejected) and answer.error.code is not ErrorCode.NOT_FOUND:
                self._log.warning("ledger.preempt %s refused: %s", p.allocation_id, answer.error.message)
            return p.allocation_id  # ended, scheduled, or gone: nothing more to ask

        acknowledged = {a for a in await asyncio.gather(*(one(p) for p in preemptions)) if a is not None}
        if acknowledged:
            # Recorded after the answer goes back (the owner's placement is waiting); a crash before it
            # only makes the next tick ask the ledger again, which answers the same.
            task = asyncio.create_task(self._mark_done({p.reservation_id for p in preemptions}, acknowledged))
            self._marking.add(task)
            task.add_done_callback(self._marked)
        return acknowledged

    def _marked(self, task: asyncio.Task[None]) -> None:
        self._marking.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._log.warning("could not record acknowledged preemptions: %s", task.exception())

    async def _mark_done(self, reservation_ids: set[str], allocation_ids: set[str]) -> None:
        async def work(uow: UnitOfWork) -> None:
            for reservation in await store.load_many(session=uow.session, ids=reservation_ids, lock=True):
                after = reservation
                acknowledged = [p for p in reservation.preemptions if p.allocation_id in allocation_ids and not p.done]
                for p in acknowledged:
                    after = preemption_done(after, p.allocation_id)
                if after.version == reservation.version:
                    continue
                await store.save(session=uow.session, reservation=after, now=uow.now)
                for p in acknowledged:  # the ledger will end it by its deadline
                    self._emit(uow, ReservationEventName.PREEMPTED, after, preemption=p, reason="acknowledged")

        await self._uow.run(work)

    async def tick(self) -> None:
        """Forever: re-issue preemptions the ledger has not acknowledged (after a crash or a silent ledger)
        and re-offer accelerators whose backoff ended."""
        elapsed = 0.0
        while True:
            try:
                await self.tick_once()
                if self._metrics is not None and elapsed - self._fill_at >= METRICS_EVERY_S:
                    self._fill_at = elapsed
                    self._metrics.show(fill_figures(await self._uow.read(self._filled)))
            except Exception:
                self._log.exception("reservation tick failed; retrying")
            await asyncio.sleep(self._tick_s)
            elapsed += self._tick_s

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
            reservations = await store.load_many(session=uow.session)
            for reservation in reservations:
                self._emit(
                    uow,
                    ReservationEventName.RESTATED,
                    reservation,
                    accelerators=list(reservation.accelerators),
                    reason="restated",
                )
            return len(reservations)

        return await self._uow.run(work)

    async def tick_once(self) -> int:
        """One pass; how many preemptions it (re-)issued."""

        async def work(uow: UnitOfWork) -> list[Preemption]:
            pending: list[Preemption] = []
            due: list[str] = []
            for reservation in await store.load_ticking(session=uow.session):
                pending += [p for p in reservation.preemptions if not p.done]
                if reservation.lends and any(b.until <= uow.now for b in reservation.backoff.values()):
                    due.append(reservation.id)
            # Only the reservations whose backoff may have ended are locked and refreshed.
            for reservation in await store.load_many(session=uow.session, ids=due, lock=True):
                uses = await store.uses_on(session=uow.session, accelerators=reservation.accelerators)
                after = refresh(reservation, uses, now=uow.now, policy=self._policy)
                if after.version != reservation.version:
                    await store.save(session=uow.session, reservation=after, now=uow.now)
                    self._emit(uow, ReservationEventName.OFFERED, after, reason="backoff")
            return pending

        pending = await self._uow.run(work)
        await self._issue(pending)
        return len(pending)

    # -- events ------------------------------------------------------------------------------------

    async def on_allocation_committed(self, *, uow: UnitOfWork, event: EventEnvelope, payload: AllocationEvent) -> None:
        """A replica's allocation: the owner's use or a borrower's on the reservations it touches."""
        use = Use(
            allocation_id=payload.allocation_id,
            tenant=payload.tenant,
            preemptible=payload.preemptible,
            bytes={s.accelerator_id: s.total for s in payload.shares},
            since=event.occurred_at,
        )
        if not await store.add_use(session=uow.session, use=use):
            return
        await self._touched(uow, use.accelerators, allocation_id=use.allocation_id)

    async def on_allocation_ended(self, *, uow: UnitOfWork, event: EventEnvelope, payload: AllocationEvent) -> None:
        """Released or expired (a preempted borrower's included): the capacity comes back."""
        use = await store.remove_use(session=uow.session, allocation_id=payload.allocation_id)
        if use is None:
            return
        reason = "expired" if event.type.endswith("expired") else "released"
        await self._touched(uow, use.accelerators, allocation_id=use.allocation_id, reason=reason)

    async def _touched(
        self, uow: UnitOfWork, accelerators: Iterable[str], *, allocation_id: str, reason: str | None = None
    ) -> None:
        for reservation in await store.reservations_on(session=uow.session, accelerators=accelerators):
            uses = await store.uses_on(session=uow.session, accelerators=reservation.accelerators)
            after = refresh(reservation, uses, now=uow.now, policy=self._policy)
            name = _event_name(_Change(reservation, after), allocation_id)
            if name is None:
                continue
            await store.save(session=uow.session, reservation=after, now=uow.now)
            borrow = reservation.borrow(allocation_id) or after.borrow(allocation_id)
            why = reason
            if name is ReservationEventName.RECLAIMED and reservation.preemption(allocation_id) is not None:
                why = "preempted"
            self._emit(
                uow,
                name,
                after,
                accelerators=list(borrow.accelerators) if borrow is not None else [],
                allocation_id=allocation_id if borrow is not None else None,
                tenant=borrow.tenant if borrow is not None else None,
                reason=why,
            )

    async def on_node_profiled(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeProfileEvent) -> None:
        profile = payload.profile
        cluster = cluster_key(profile.region, profile.cluster or "default")
        slots = [
            Slot(
                id=AcceleratorId.gpu(payload.node, a.index),
                node=payload.node,
                sku=a.sku,
                region=profile.region,
                cluster=cluster,
            )
            for a in profile.accelerators
        ]
        await store.set_node(session=uow.session, node=payload.node, slots=slots)

    async def on_node_removed(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeStateEvent) -> None:
        """Gone from the fleet: no new reservation takes its GPUs (those reserved stay, with nothing on them)."""
        await store.set_node(session=uow.session, node=payload.node, slots=[])

    async def start(self) -> None:
        """Re-issue at once what a crash left unacknowledged."""
        try:
            await self.tick_once()
        except Exception:
            self._log.exception("re-issuing preemptions at start failed; the tick will retry")

    # -- helpers -----------------------------------------------------------------------------------

    def _price(self, reservation: Reservation) -> float | None:
        if reservation.sku is None:
            return None
        region = self._regions.get(reservation.region or "")
        if region is not None and reservation.sku in region.price_usd_per_hour:
            return float(region.price_usd_per_hour[reservation.sku])
        sku = self._skus.get(reservation.sku)
        return sku.price_usd_per_hour if sku is not None else None

    def _view(self, reservation: Reservation, current: Usage) -> ReservationStatusView:
        state = state_of(reservation)
        return ReservationStatusView(
            reservation_id=reservation.id,
            tenant=reservation.tenant,
            policy=reservation.policy,
            sku=reservation.sku,
            region=reservation.region,
            accelerators=list(reservation.accelerators),
            owner_used=len(current.owner_used),
            lent=len(current.lent),
            idle=len(current.idle),
            offered=len(reservation.offered),
            fill_rate=round(current.fill_rate, 4),
            idle_cost_usd_per_hour=round(idle_cost_usd_per_hour(current, self._price(reservation)), 4),
            borrowers=state.borrowers,
            preemptions=state.preemptions,
        )

    def _emit(
        self,
        uow: UnitOfWork,
        name: ReservationEventName,
        reservation: Reservation,
        *,
        accelerators: list[str] | None = None,
        allocation_id: str | None = None,
        tenant: str | None = None,
        preemption: Preemption | None = None,
        reason: str | None = None,
    ) -> None:
        if preemption is not None:
            borrow = reservation.borrow(preemption.allocation_id)
            accelerators = list(borrow.accelerators) if borrow is not None else []
            allocation_id, tenant = preemption.allocation_id, preemption.tenant
        payload = ReservationEvent(
            reservation=state_of(reservation),
            accelerators=accelerators or [],
            allocation_id=allocation_id,
            tenant=tenant,
            reservation_id=reservation.id,
            deadline_at=preemption.deadline_at if preemption is not None else None,
            reason=reason,
        )
        uow.emit(Context.RESERVATION, name, payload, tenant=tenant or reservation.tenant, correlation_id=reservation.id)


def _in_use(count: int, asked: int) -> Rejected:
    """A create naming GPUs that are reserved or used already: how many, never which (which GPUs other
    tenants use is theirs to know)."""
    return rejected(
        ErrorCode.CONFLICT,
        f"{count} of the {asked} GPU(s) asked for are reserved already or used by another tenant",
        in_use=count,
    )


def _no_reservation(reservation_id: str) -> Rejected:
    """The answer to a reservation id the tenant does not hold: one code and one message whether it does not
    exist, has ended or is another tenant's, so an id tells no one whether it exists."""
    return rejected(ErrorCode.NOT_FOUND, f"no reservation {echo(reservation_id)} for this tenant")


def _first_version(reservation: Reservation) -> Reservation:
    return replace(reservation, version=1)


def _done(p: Preemption, acknowledged: set[str]) -> Preemption:
    return replace(p, done=p.allocation_id in acknowledged)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _by_cluster(accelerators: Iterable[str], inventory: Mapping[str, Slot]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for acc in accelerators:
        slot = inventory.get(acc)
        out.setdefault(slot.cluster if slot is not None else "unknown", set()).add(acc)
    return out


def _restricted(current: Usage, accelerators: set[str]) -> Usage:
    return Usage(
        owner_used=current.owner_used & accelerators, lent=current.lent & accelerators, idle=current.idle & accelerators
    )


__all__ = ["ReservationHandlers", "new_reservation_id"]
