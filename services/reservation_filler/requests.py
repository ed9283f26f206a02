"""The tenants' requests: create, cancel and status of their reservations, and the operators' report.

A create's rules (which GPUs, clashes, the free count) are ``shared.domain.reservations.claim``; this
module loads what they need, records the reservation with its ``created`` event, and answers only once
the relay has published it (read-your-writes, docs/RESERVATIONS.md).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

from pydantic import BaseModel

from services.reservation_filler.events import emit
from services.reservation_filler.figures import Pricing, filled, rounded
from services.reservation_filler.store import HeldElsewhere, ReservationStore
from shared.contracts.base import Rejected, echo, rejected
from shared.contracts.reservation import (
    ReservationCancelReply,
    ReservationCancelRequest,
    ReservationCreateReply,
    ReservationCreateRequest,
    ReservationEventName,
    ReservationReportReply,
    ReservationReportRequest,
    ReservationStatusReply,
    ReservationStatusRequest,
    ReservationStatusView,
)
from shared.domain.errors import ErrorCode
from shared.domain.quotas import Quota, Quotas, exceeded
from shared.domain.reservations import (
    LendingPolicy,
    Refused,
    Reservation,
    Usage,
    cancel,
    claim_count,
    claim_named,
    fill_rate,
    in_use,
    refresh,
    unclaimable,
    usage,
)
from shared.infra import deadline
from shared.infra.uow import UnitOfWork, UnitOfWorkFactory

ANNOUNCE_POLL_S = 0.005
ANNOUNCE_WAIT_S = 10.0
ANNOUNCE_MARGIN_S = 0.25
"""How often, and how long at most (the caller's deadline less a margin for the answer), ``create`` waits
for the relay to publish its event."""


def new_reservation_id() -> str:
    return f"res-{uuid.uuid4().hex[:16]}"


class RequestHandlers:
    def __init__(
        self,
        *,
        uow: UnitOfWorkFactory,
        store: ReservationStore,
        policy: LendingPolicy,
        pricing: Pricing,
        quotas: Quotas | None = None,
    ) -> None:
        self._uow = uow
        self._store = store
        self._policy = policy
        self._pricing = pricing
        self._quotas = quotas or Quotas()  # per tenant: ``gpus_reserved`` is checked by ``create``

    async def create(self, request: ReservationCreateRequest) -> BaseModel:
        """Reserve ``count`` GPUs of ``sku`` in ``region`` (whole nodes first), or the ones named: none may
        be in another reservation or used by another tenant. The same ``request_id`` answers the same."""
        wrong = unclaimable(request.accelerators, sku=request.sku, skus=self._pricing.skus)
        if wrong is not None:
            return _refusal(wrong)

        async def work(uow: UnitOfWork) -> BaseModel:
            if request.request_id is not None:
                earlier = await self._store.load_by_request(
                    session=uow.session, tenant=request.tenant, request_id=request.request_id
                )
                if earlier is not None:
                    return ReservationCreateReply(
                        status="created",
                        reservation_id=earlier.id,
                        accelerators=list(earlier.accelerators),
                        duplicate=True,
                    )
            taken = await self._store.held(session=uow.session)
            others = await self._store.used_by_others(session=uow.session, tenant=request.tenant)
            if request.accelerators:
                known = await self._store.inventory(session=uow.session, ids=request.accelerators)
                claim = claim_named(request.accelerators, known=known, taken=taken, used_by_others=others)
            else:
                assert request.count is not None and request.sku is not None and request.region is not None
                inventory = await self._store.inventory(session=uow.session)
                claim = claim_count(
                    inventory.values(),
                    count=request.count,
                    sku=request.sku,
                    region=request.region,
                    taken=taken,
                    used_by_others=others,
                )
            if isinstance(claim, Refused):
                return _refusal(claim)
            # Past its tenant's quota: refused, nothing written (after the capacity checks, which answer
            # a request for more than exists as they always did).
            over = await self._over_quota(uow, request)
            if over is not None:
                return over
            reservation = Reservation(
                id=new_reservation_id(),
                tenant=request.tenant,
                policy=request.policy,
                accelerators=claim.accelerators,
                created_at=uow.now,
                sku=claim.sku,
                region=claim.region,
                spot_eviction_s=request.spot_eviction_s,
            )
            uses = await self._store.uses_on(session=uow.session, accelerators=claim.accelerators)
            reservation = replace(refresh(reservation, uses, now=uow.now, policy=self._policy), version=1)
            await self._store.add(
                session=uow.session, reservation=reservation, request_id=request.request_id, now=uow.now
            )
            emit(uow, ReservationEventName.CREATED, reservation, accelerators=list(claim.accelerators))
            return ReservationCreateReply(
                status="created", reservation_id=reservation.id, accelerators=list(claim.accelerators)
            )

        try:
            created = await self._uow.run(work)
        except HeldElsewhere as exc:  # a concurrent create took some of them first
            return _refusal(in_use(len(exc.accelerators), len(request.accelerators or ()) or request.count or 0))
        return await self._announced(created)

    async def _announced(self, reply: BaseModel) -> BaseModel:
        """Read-your-writes (docs/RESERVATIONS.md): ``created`` is answered only once the relay has
        published every event written until now, this reservation's ``created`` among them (JetStream
        acknowledged it). Placement, before it decides, waits for its view to reach the stream's end as
        it was when the request arrived, so it knows of every reservation answered before. A repeat of
        the request id waits the same: its first answer may have been lost before the event left."""
        if not isinstance(reply, ReservationCreateReply):
            return reply
        tail = await self._uow.read(lambda session: self._store.unsent_tail(session=session))
        if tail is None:  # the relay has published everything already
            return reply
        through: int = tail
        left_s = deadline.remaining_s(default_s=ANNOUNCE_WAIT_S) or 0.0
        until = time.monotonic() + left_s - min(left_s / 10, ANNOUNCE_MARGIN_S)  # the rest is the answer's
        while await self._uow.read(lambda session: self._store.unsent_through(session=session, seq=through)):
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
        used = await self._store.reserved_by(session=uow.session, tenant=request.tenant)
        over = exceeded(self._quotas, request.tenant, Quota.GPUS_RESERVED, used=used, asked=asked)
        return None if over is None else rejected(ErrorCode.QUOTA_EXCEEDED, over.message, **over.details())

    async def cancel(self, request: ReservationCancelRequest) -> BaseModel:
        async def work(uow: UnitOfWork) -> BaseModel:
            reservation = await self._store.load(session=uow.session, reservation_id=request.reservation_id, lock=True)
            if reservation is None or reservation.tenant != request.tenant:  # alike: the id says nothing
                return _no_reservation(request.reservation_id)
            if not reservation.active:
                return ReservationCancelReply(status="cancelled", reservation_id=reservation.id, already=True)
            after = cancel(reservation)
            await self._store.save(session=uow.session, reservation=after, now=uow.now)
            emit(uow, ReservationEventName.CANCELLED, after, accelerators=list(after.accelerators))
            return ReservationCancelReply(status="cancelled", reservation_id=after.id)

        return await self._uow.run(work)

    async def status(self, request: ReservationStatusRequest) -> BaseModel:
        """The tenant's reservations (only its own) with usage, fill rate and idle cost."""

        async def read(uow: UnitOfWork) -> BaseModel:
            if request.reservation_id is not None:
                one = await self._store.load(session=uow.session, reservation_id=request.reservation_id)
                if one is None or not one.active or one.tenant != request.tenant:  # alike: the id says nothing
                    return _no_reservation(request.reservation_id)
                reservations = [one]
            else:
                reservations = await self._store.load_many(session=uow.session, tenant=request.tenant)
            views: list[ReservationStatusView] = []
            usages: list[Usage] = []
            idle_cost = 0.0
            for reservation in reservations:
                uses = await self._store.uses_on(session=uow.session, accelerators=reservation.accelerators)
                current = usage(reservation, uses)
                usages.append(current)
                view = self._pricing.view(reservation, current)
                idle_cost += view.idle_cost_usd_per_hour
                views.append(view)
            return ReservationStatusReply(
                reservations=views, fill_rate=rounded(fill_rate(usages)), idle_cost_usd_per_hour=round(idle_cost, 4)
            )

        return await self._uow.run(read)

    async def report(self, request: ReservationReportRequest) -> BaseModel:
        """Operators: fill rate overall, per tenant and per cluster, and what idle reserved capacity costs."""

        async def read(uow: UnitOfWork) -> BaseModel:
            live = await filled(store=self._store, session=uow.session, pricing=self._pricing)
            by_tenant: dict[str, list[Usage]] = {}
            by_cluster: dict[str, list[Usage]] = {}
            for f in live:
                by_tenant.setdefault(f.tenant, []).append(f.usage)
                for cluster, part in f.by_cluster.items():
                    by_cluster.setdefault(cluster, []).append(part)
            total = [f.usage for f in live]
            return ReservationReportReply(
                fill_rate=rounded(fill_rate(total)),
                by_tenant={t: rounded(fill_rate(u)) or 0.0 for t, u in sorted(by_tenant.items())},
                by_cluster={c: rounded(fill_rate(u)) or 0.0 for c, u in sorted(by_cluster.items())},
                reserved=sum(u.total for u in total),
                owner_used=sum(len(u.owner_used) for u in total),
                lent=sum(len(u.lent) for u in total),
                idle_cost_usd_per_hour=round(sum(f.idle_cost_usd_per_hour for f in live), 4),
            )

        return await self._uow.run(read)


def _refusal(refused: Refused) -> Rejected:
    return rejected(refused.code, refused.message, **refused.details)


def _no_reservation(reservation_id: str) -> Rejected:
    """The answer to a reservation id the tenant does not hold: one code and one message whether it does not
    exist, has ended or is another tenant's, so an id tells no one whether it exists."""
    return rejected(ErrorCode.NOT_FOUND, f"no reservation {echo(reservation_id)} for this tenant")
