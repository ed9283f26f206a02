"""Reservations in the simulator: hard, soft and spot reservations replayed against a trace, so the
``fill_rate`` KPI measures what lending idle reserved accelerators buys (``shared.domain.reservations``
holds every rule; this module only feeds it the simulated replicas).

**Tenants.** Trace rows carry no tenant the reservation rules could use, so a replica's tenant comes
from its model: a model named in ``ReservationSetup.owner_models`` is served by that tenant, whose
replicas are not preemptible; every other model's replicas belong to one other tenant
(``SimConfig.tenant``) and are preemptible, so they may borrow the idle accelerators a soft or spot
reservation offers. (A per-request tenant would not do: a replica serves every request of its model.)

**Decisions.** Before a replica of tenant ``T`` is placed, the snapshot is masked with
``withhold(snapshot, book.withheld(T, preemptible=P))``: other tenants' reserved GPUs, except, for
preemptible work, those a lending reservation offers now. With ``reserved_first`` an owner's replica is
first tried on its own reserved GPUs alone (every other GPU withheld, asked with ``backend: gpu`` so a
TPU slice does not take it), and only then on everything it may use: a reservation is capacity its
owner's work goes to first.

**Book keeping.** After every replica placed or released the reservations are ``refresh``-ed with the
live GPU replicas as ``Use``-s (allocation id = replica id, bytes per accelerator = the decision's
share, since = the replica's start as a datetime from ``EPOCH``) and applied to a ``ReservationBook``:
borrowers, offers and backoff move as the reservation filler would move them. TPU replicas never touch
a reservation (reservations hold GPUs) and are left out.

**Reclaim.** When an owner's replica fits nowhere it may go and its reservations have borrowers,
``plan_reclaim`` picks the fewest borrowers to evict (most recently lent first); ``reclaim`` issues the
preemptions (soft: deadline now; spot: ``spot_eviction_s`` later) and backs their GPUs off. The engine
evicts a borrower at its deadline; its in-flight requests fail (``RequestOutcome.preempted``): a
preempted replica loses its KV cache, so the simplest honest outcome is the error a client would see.

**Fill rate.** ``fill_now`` is (owner use + lent use) / reserved over every reservation at one instant
(``reservations.fill_rate``); the engine takes it at its sample times and ``Kpis.fill_rate`` is their
time-weighted mean (``kpis.time_weighted_fill``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from shared.domain.placement import Decision, FleetSnapshot, PlacementRequest
from shared.domain.placement.withhold import withhold
from shared.domain.reservations import (
    POLICIES,
    LendingPolicy,
    Policy,
    ReclaimPlan,
    Reservation,
    ReservationBook,
    Slot,
    Use,
    choose,
    fill_rate,
    plan_reclaim,
    reclaim,
    refresh,
    usage,
)

EPOCH = datetime(2024, 1, 1, tzinfo=UTC)
"""Simulated millisecond 0 as a datetime (the reservation rules take datetimes)."""

Decide = Callable[[FleetSnapshot, PlacementRequest], Decision]


def at(ms: float) -> datetime:
    """Simulated time ``ms`` as a datetime."""
    return EPOCH + timedelta(milliseconds=ms)


def ms_of(when: datetime) -> float:
    """A datetime of the simulation as simulated milliseconds."""
    return (when - EPOCH) / timedelta(milliseconds=1)


@dataclass(frozen=True, slots=True)
class SimReservation:
    """One reservation of the run: explicit ``accelerators``, or ``count`` GPUs of ``sku`` (in ``region``
    when given) chosen as the filler chooses them (``reservations.choose``: whole nodes first)."""

    tenant: str
    policy: Policy
    accelerators: tuple[str, ...] = ()
    count: int | None = None
    sku: str | None = None
    region: str | None = None
    spot_eviction_s: int = 30

    def __post_init__(self) -> None:
        if not self.tenant:
            raise ValueError("a reservation needs a tenant")
        if self.policy not in POLICIES:
            raise ValueError(f"reservation policy {self.policy!r}: expected one of {', '.join(POLICIES)}")
        if bool(self.accelerators) == (self.count is not None):
            raise ValueError("a reservation gives `accelerators`, or `count` + `sku`, not both")
        if self.count is not None and (self.count <= 0 or not self.sku):
            raise ValueError(f"a reservation of {self.count} accelerators needs a positive count and a sku")
        if len(set(self.accelerators)) != len(self.accelerators):
            raise ValueError("a reservation names an accelerator twice")
        if self.spot_eviction_s < 0:
            raise ValueError(f"spot_eviction_s must be >= 0, got {self.spot_eviction_s}")


@dataclass(frozen=True, slots=True)
class ReservationSetup:
    """What ``SimConfig.reservations`` holds: the reservations, whose traffic each model is
    (``owner_models``: (model, tenant) pairs; other models are preemptible), and the lending policy."""

    reservations: tuple[SimReservation, ...]
    owner_models: tuple[tuple[str, str], ...] = ()
    lending: LendingPolicy = field(default_factory=LendingPolicy)
    reserved_first: bool = True  # an owner's replica tries its own reserved GPUs before the rest

    def __post_init__(self) -> None:
        models = [model for model, _ in self.owner_models]
        if len(set(models)) != len(models):
            raise ValueError("owner_models names a model twice")


def reserved_accelerators(snapshot: FleetSnapshot, reservations: Iterable[SimReservation]) -> list[tuple[str, ...]]:
    """The GPUs each reservation holds, in order; ValueError for an unknown GPU, a GPU reserved twice,
    or a count the fleet cannot give."""
    taken: set[str] = set()
    chosen: list[tuple[str, ...]] = []
    for n, spec in enumerate(reservations, start=1):
        if spec.accelerators:
            unknown = [acc for acc in spec.accelerators if acc not in snapshot.capacity]
            if unknown:
                raise ValueError(f"reservation {n}: unknown accelerator(s) {', '.join(unknown)}")
            accelerators = spec.accelerators
        else:
            slots = [
                Slot(id=acc.id, node=acc.node, sku=acc.sku, region="", cluster="")
                for acc in snapshot.capacity.values()
                if spec.region is None or snapshot.nodes[acc.node].region == spec.region
            ]
            found = choose(
                slots, count=spec.count or 0, sku=spec.sku or "", region="", taken=taken, used_by_others=frozenset()
            )
            if found is None:
                where = f" in {spec.region}" if spec.region else ""
                raise ValueError(f"reservation {n}: the fleet has fewer than {spec.count} free {spec.sku}{where}")
            accelerators = found
        twice = sorted(taken & set(accelerators))
        if twice:
            raise ValueError(f"reservation {n}: {', '.join(twice)} already reserved")
        taken.update(accelerators)
        chosen.append(accelerators)
    return chosen


@dataclass(frozen=True, slots=True)
class Eviction:
    """A borrower replica the owner reclaimed: leave at ``at_ms``; its GPUs are lent again at ``lend_ms``."""

    replica_id: int
    at_ms: float
    lend_ms: float
    issued: bool  # a new preemption (False: one already pending for it)


class ReservationRun:
    """The reservations of one simulation run as the filler would keep them (mutable: one per run)."""

    def __init__(self, setup: ReservationSetup, snapshot: FleetSnapshot, *, borrower: str) -> None:
        owners = {tenant for _, tenant in setup.owner_models} | {r.tenant for r in setup.reservations}
        if borrower in owners:
            raise ValueError(f"tenant {borrower!r} is the preemptible traffic's; name reservation owners otherwise")
        self.setup = setup
        self.lending = setup.lending
        self.borrower = borrower
        self.owners: Mapping[str, str] = dict(setup.owner_models)
        self.book = ReservationBook()
        self.uses: dict[str, Use] = {}
        self.preemptions = 0
        self.gpus = frozenset(snapshot.capacity)
        own: dict[str, set[str]] = {}
        for n, (spec, accelerators) in enumerate(
            zip(setup.reservations, reserved_accelerators(snapshot, setup.reservations), strict=True), start=1
        ):
            skus = {snapshot.capacity[acc].sku for acc in accelerators}
            reservation = Reservation(
                id=f"sim-res-{n}",
                tenant=spec.tenant,
                policy=spec.policy,
                accelerators=accelerators,
                created_at=EPOCH,
                sku=skus.pop() if len(skus) == 1 else None,
                region=spec.region,
                spot_eviction_s=spec.spot_eviction_s,
            )
            self.book.apply(refresh(reservation, (), now=EPOCH, policy=self.lending))
            own.setdefault(spec.tenant, set()).update(accelerators)
        self.own = {tenant: frozenset(accs) for tenant, accs in own.items()}

    # -- who asks ------------------------------------------------------------------------------------

    def tenant_of(self, model: str) -> tuple[str, bool]:
        """(tenant, preemptible) of ``model``'s replicas."""
        owner = self.owners.get(model)
        return (owner, False) if owner is not None else (self.borrower, True)

    def request_for(self, request: PlacementRequest) -> PlacementRequest:
        """``request`` as its model's tenant asks it."""
        tenant, preemptible = self.tenant_of(request.model)
        return replace(request, tenant=tenant, preemptible=preemptible)

    # -- deciding ------------------------------------------------------------------------------------

    def masked(self, snapshot: FleetSnapshot, request: PlacementRequest) -> FleetSnapshot:
        """``snapshot`` without the GPUs ``request``'s tenant may not use now."""
        return withhold(snapshot, self.book.withheld(request.tenant, preemptible=request.preemptible))

    def decide(self, snapshot: FleetSnapshot, request: PlacementRequest, decide: Decide, now_ms: float) -> Decision:
        """``decide`` on what the tenant may use; an owner's replica on its own reserved GPUs first."""
        self.expire(now_ms)
        masked = self.masked(snapshot, request)
        own = self.own.get(request.tenant) if not request.preemptible and self.setup.reserved_first else None
        if own and request.backend != "tpu":
            first = decide(withhold(masked, self.gpus - own), replace(request, backend="gpu"))
            if first.placed:
                return first
        return decide(masked, request)

    def plan(self, snapshot: FleetSnapshot, request: PlacementRequest, decide: Decide) -> ReclaimPlan | None:
        """An owner's refused replica: which borrowers of its reservations to evict (None: none helps)."""
        if request.preemptible:
            return None
        borrowed = self.book.borrowed_from(request.tenant)
        if not borrowed:
            return None
        return plan_reclaim(self.masked(snapshot, request), borrowed, lambda s: decide(s, request))

    def reclaim(self, plan: ReclaimPlan, now_ms: float) -> list[Eviction]:
        """Issue ``plan``'s preemptions (``preemptions`` counts the new ones); when each borrower leaves."""
        by_reservation: dict[str, list[str]] = {}
        for reservation, borrow in plan.evict:
            by_reservation.setdefault(reservation.id, []).append(borrow.allocation_id)
        evictions: list[Eviction] = []
        for reservation_id, allocation_ids in by_reservation.items():
            before = self.book.get(reservation_id)
            if before is None:
                continue
            pending = {a for a in allocation_ids if before.preemption(a) is not None}
            after, issued = reclaim(before, allocation_ids, now=at(now_ms), policy=self.lending)
            self.book.apply(after)
            for preemption in issued:
                lent = before.borrow(preemption.allocation_id)
                held = lent.accelerators if lent is not None else ()
                lend = max(
                    (after.backoff[acc].until for acc in held if acc in after.backoff), default=preemption.deadline_at
                )
                new = preemption.allocation_id not in pending
                self.preemptions += new
                evictions.append(
                    Eviction(
                        replica_id=int(preemption.allocation_id),
                        at_ms=ms_of(preemption.deadline_at),
                        lend_ms=ms_of(lend),
                        issued=new,
                    )
                )
        return evictions

    # -- the replicas ----------------------------------------------------------------------------------

    def placed(self, replica_id: int, model: str, decision: Decision, now_ms: float) -> None:
        """A replica started: its GPUs are a ``Use`` of its model's tenant (a TPU slice is none)."""
        if decision.tpu is not None or decision.share is None or not decision.accelerators:
            return
        tenant, preemptible = self.tenant_of(model)
        self.uses[str(replica_id)] = Use(
            allocation_id=str(replica_id),
            tenant=tenant,
            preemptible=preemptible,
            bytes={acc: decision.share.total for acc in decision.accelerators},
            since=at(now_ms),
        )
        self.refresh(now_ms)

    def released(self, replica_id: int, now_ms: float) -> None:
        if self.uses.pop(str(replica_id), None) is not None:
            self.refresh(now_ms)

    def refresh(self, now_ms: float) -> None:
        """Every reservation refreshed with the live replicas at ``now_ms`` (borrowers, offers, backoff)."""
        now = at(now_ms)
        for reservation in self.book.active():
            self.book.apply(refresh(reservation, self.uses.values(), now=now, policy=self.lending))

    def expire(self, now_ms: float) -> None:
        """Refresh when some GPU is backing off: its backoff may have run out (offers grow)."""
        if any(r.backoff for r in self.book.active()):
            self.refresh(now_ms)

    # -- the KPI -------------------------------------------------------------------------------------------

    def fill_now(self) -> float | None:
        """(owner use + lent use) / reserved over every reservation now (None: nothing reserved)."""
        uses = list(self.uses.values())
        return fill_rate([usage(r, uses) for r in self.book.active()])
