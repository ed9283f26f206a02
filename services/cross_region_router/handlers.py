"""Handlers of the cross-region-router service (API.md "Request path").

``select`` reads like the route: validate -> the region by the pure rules (``shared.domain.routing.choose``:
affinity tier, a cheaper acceptable region when the affinity region is full, draining or down, fallback;
damping; in-flight sessions stay; each region priced by the SKUs of its replicas of the model) -> admit there
(``placement.admit``; a region whose admission answers ``no_capacity`` counts as full for this request and
the next tier is tried) -> remember the tenant's region (with ``route_switched`` when it changed, in one
unit of work), the session's region and the traffic (affinity) -> reply.

What it keeps in memory it loads from its own tables at start and writes through: tenants' regions and
sessions' regions before the reply (group commit; a request whose region did not change writes nothing),
traffic counts every ``HETSCHED_ROUTE_FLUSH_MS`` (statistics for affinity: a crash loses at most that
much of them). Capacity per region is learnt from events, never from another service's tables: the
replicas placement announces with their SKUs (PLACEMENT ``placement_decided``, and ``placement_released``
when one is released or its lease expires), kept in ``routing.replicas`` and folded into ``ReplicaRegions`` once the
consumer's transaction commits. Memory changes only after the transaction that writes it commits.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial

from pydantic import BaseModel

from services.cross_region_router.metrics import RouterMetrics
from services.cross_region_router.readmodel import ReplicaRegions
from services.cross_region_router.store import RoutingStore, StoredReplica, StoredTenant
from shared.contracts.base import ErrorCode, Rejected, rejected
from shared.contracts.envelope import EventEnvelope
from shared.contracts.placement import AdmitReply, AdmitRequest, PlacementEvent, PlacementReleasedEvent, Slo
from shared.contracts.routing import (
    RegionStateEvent,
    RouteCost,
    RouteRegionReply,
    RouteRegionRequest,
    RouteSelectReply,
    RouteSelectRequest,
    RouteSwitchedEvent,
    RoutingEventName,
)
from shared.contracts.subjects import Context, Rpc
from shared.domain.admission import members, unknown_model
from shared.domain.models import ModelSpec
from shared.domain.names import unknown_name
from shared.domain.routing import (
    KEPT_BY_SESSION,
    CostTerms,
    Region,
    RegionState,
    RouteAsk,
    RouteDecision,
    RoutePolicy,
    SessionRoute,
    TenantRoute,
    Traffic,
    choose,
    day_of,
    next_tenant_route,
)
from shared.infra import tracing
from shared.infra.clock import Clock
from shared.infra.grouping import Grouped
from shared.infra.locks import KeyedLocks
from shared.infra.rpc import RpcClient, RpcError
from shared.infra.uow import DriverUnitOfWork, UnitOfWork, UnitOfWorkFactory

SESSION_KEPT_S = 86400.0
"""A session not seen for this long is forgotten (its next message routes like a new one)."""
ADMIT_TIMEOUT_S = 2.0
WRITE_LANES = 2
"""Transactions writing routes at once: the requests that come meanwhile wait and go together in the next."""
WRITE_GROUP_MAX = 256


def _cost(terms: CostTerms, policy: RoutePolicy) -> RouteCost:
    w = policy.weights
    return RouteCost(
        rtt=round(terms.rtt, 4),
        price=round(terms.price, 4),
        power=round(terms.power, 4),
        affinity=round(terms.affinity, 4),
        total=round(terms.total, 4),
        weights={"rtt": w.rtt, "price": w.price, "power": w.power, "affinity": w.affinity},
        rtt_ms=terms.rtt_ms,
        price_usd_per_hour=round(terms.price_usd_per_hour, 4),
        power_usd_per_hour=round(terms.power_usd_per_hour, 4),
    )


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


@dataclass(frozen=True, slots=True)
class _Write:
    """What one routed request leaves to write: its tenant's new route (None: unchanged), its session's key
    when the session moved to ``region`` (None: unchanged), the ``route_switched`` event of a switch, and the
    trace that event continues."""

    tenant: str
    tenant_route: TenantRoute | None
    session_key: tuple[str, str] | None
    region: str
    switched: RouteSwitchedEvent | None
    request_id: str
    trace: str | None


class RoutingHandlers:
    def __init__(
        self,
        *,
        uow: UnitOfWorkFactory,
        rpc: RpcClient,
        store: RoutingStore,
        clock: Clock,
        regions: Mapping[str, Region],
        models: Mapping[str, ModelSpec],
        groups: Mapping[str, tuple[str, ...]],
        policy: RoutePolicy,
        log: logging.Logger | None = None,
        flush_s: float = 0.5,
        regions_changed: Callable[[], Mapping[str, Region] | None] = lambda: None,
        metrics: RouterMetrics | None = None,
        write_spacing_s: float = 0.0,
    ) -> None:
        self._metrics = metrics
        self._regions_changed = regions_changed
        self._uow = uow
        self._rpc = rpc
        self._store = store
        self._clock = clock
        self._regions = dict(regions)
        self._models = models
        self._groups = groups
        self._policy = policy
        self._log = log or logging.getLogger("hetsched.router")
        self._flush_s = flush_s
        self._states: dict[str, RegionState] = {}
        self._tenants: dict[str, TenantRoute] = {}
        self._sessions: dict[tuple[str, str], str] = {}
        self._seen: dict[tuple[str, str], float] = {}  # session -> last routed (epoch s)
        self._traffic: dict[str, Traffic] = {}
        self._pending: Counter[tuple[str, str, int]] = Counter()
        self._replicas = ReplicaRegions()
        self._tenants_busy = KeyedLocks()  # one route at a time per tenant: its damping sees the last switch
        # Group commit of the routes' writes; lanes start in a context of their own (each request's trace
        # travels in its write).
        self._writes: Grouped[_Write, None] = Grouped(
            self._write, max_group=WRITE_GROUP_MAX, lanes=WRITE_LANES, fresh_context=True, spacing_s=write_spacing_s
        )
        self._loaded = False

    @property
    def write_groups(self) -> int:
        """Transactions that wrote routed requests' regions so far (each for one or more requests)."""
        return self._writes.groups

    @property
    def replicas(self) -> ReplicaRegions:
        """Where replicas are, as the committed events left it (read it, never change it)."""
        return self._replicas

    # -- start -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self._load()
        except Exception:  # e.g. Postgres not up yet: the first request retries
            self._log.exception("the router could not load its state; it retries on the first request")

    async def _load(self) -> None:
        now = self._clock()
        since_day = day_of(now.timestamp()) - self._policy.affinity.window_days
        loaded = await self._uow.run(
            lambda uow: self._store.load(
                session=uow.session, since_day=since_day, sessions_since=now - timedelta(seconds=SESSION_KEPT_S)
            )
        )
        self._tenants = {t: TenantRoute(s.region, s.switched_at.timestamp()) for t, s in loaded.tenants.items()}
        self._sessions = dict(loaded.sessions)
        self._seen = dict.fromkeys(self._sessions, now.timestamp())
        self._traffic = {t: Traffic(counts) for t, counts in loaded.traffic.items()}
        self._states = {r: RegionState(s) for r, s in loaded.regions.items() if r in self._regions}
        self._replicas = ReplicaRegions((r.allocation_id, r.region, r.model, r.sku) for r in loaded.replicas)
        self._loaded = True

    # -- route.select ------------------------------------------------------------------------------------

    async def select(self, request: RouteSelectRequest) -> BaseModel:
        if not self._loaded:
            await self._load()
        if request.origin_region not in self._regions:
            return rejected(
                ErrorCode.INVALID_REQUEST, unknown_name("origin_region", request.origin_region, self._regions)
            )
        names = members(request.model, self._groups, self._models)
        if names is None:
            return rejected(ErrorCode.UNKNOWN_MODEL, unknown_model(request.model, self._groups, self._models))
        async with self._tenants_busy.hold(request.tenant):
            return await self._route(request, names)

    async def _route(self, request: RouteSelectRequest, names: tuple[str, ...]) -> BaseModel:
        now = self._clock()
        now_s = now.timestamp()
        session_key = (request.tenant, request.session_id) if request.session_id else None
        pinned = self._sessions.get(session_key) if session_key else None
        session = SessionRoute(pinned, request.in_flight) if pinned is not None else None
        traffic = self._traffic.setdefault(request.tenant, Traffic())
        full: set[str] = set()
        previous = self._tenants.get(request.tenant)
        # Each region is priced by the SKUs its replicas of the model serve on (the cheapest of them); a
        # region where none is known, at its mean price.
        skus = {region: found for region in self._regions if (found := self._replicas.skus(region, names))}
        ask = RouteAsk(
            tenant=request.tenant, origin=request.origin_region, sku=None, in_flight=request.in_flight, skus=skus
        )
        while True:
            decision = choose(
                ask,
                regions=self._regions,
                states=self._states,
                capacity=lambda region: region not in full and self._replicas.serves(region, names),
                tenant=previous,
                session=session,
                traffic=traffic,
                now_s=now_s,
                policy=self._policy,
            )
            if decision.region is None:
                # The one refusal shape; the explanation travels in the error's details.
                refusal = rejected(ErrorCode.NO_CAPACITY, decision.reason, explanation=decision.reason)
                return refusal.model_copy(update={"request_id": request.request_id})
            admission = await self._admit(request, decision) if request.admit else None
            held = decision.kept_by == KEPT_BY_SESSION and request.in_flight
            if admission is not None and _full(admission) and not held and len(full) < len(self._regions):
                full.add(decision.region)  # full there for this request: the next tier decides
                continue
            break
        moved = await self._remember(request, decision, previous, session_key, now)
        if self._metrics is not None:
            self._metrics.routed(rtt_ms=decision.rtt_ms, moved=moved)
        return RouteSelectReply(
            status="routed",
            region=decision.region,
            tier=decision.tier.value if decision.tier is not None else None,
            rtt_ms=decision.rtt_ms,
            cost=_cost(decision.cost, self._policy) if decision.cost is not None else None,
            switched=decision.switched,
            relaxed_ttft_ms=decision.relaxed_ttft_ms,
            explanation=decision.reason,
            admission=admission,
        )

    async def _admit(self, request: RouteSelectRequest, decision: RouteDecision) -> AdmitReply:
        slo = request.slo
        if decision.relaxed_ttft_ms is not None:
            slo = (slo or Slo()).model_copy(update={"ttft_ms": decision.relaxed_ttft_ms})
        ask = AdmitRequest(
            request_id=request.request_id,
            tenant=request.tenant,
            model=request.model,
            input_tokens=request.input_tokens,
            output_tokens=request.output_tokens,
            slo=slo,
            region=decision.region,
            hint=request.hint,
            session_id=request.session_id,
        )
        try:
            answer = await self._rpc.ask(Rpc.PLACEMENT_ADMIT, ask, AdmitReply, timeout_s=ADMIT_TIMEOUT_S)
        except RpcError as exc:
            return AdmitReply(status="rejected", error=rejected(ErrorCode.INTERNAL, f"admission: {exc}").error)
        if isinstance(answer, Rejected):
            return AdmitReply(status="rejected", error=answer.error)
        return answer

    async def _remember(
        self,
        request: RouteSelectRequest,
        decision: RouteDecision,
        previous: TenantRoute | None,
        session_key: tuple[str, str] | None,
        now: datetime,
    ) -> bool:
        """Keep the tenant's and the session's region; whether either moved to another region."""
        region = decision.region
        assert region is not None
        now_s = now.timestamp()
        tenant_route = next_tenant_route(previous, decision, now_s)
        tenant_changed = tenant_route is not None and tenant_route != previous
        pinned = self._sessions.get(session_key) if session_key is not None else None
        session_changed = session_key is not None and pinned != region
        moved = (decision.switched and previous is not None) or (session_changed and pinned is not None)
        if tenant_changed or session_changed:
            switched = None
            if tenant_changed and decision.switched and previous is not None and decision.cost is not None:
                switched = RouteSwitchedEvent(
                    tenant=request.tenant,
                    request_id=request.request_id,
                    session_id=request.session_id,
                    from_region=previous.region,
                    to_region=region,
                    tier=decision.tier.value if decision.tier else "fallback",
                    reason=decision.reason,
                    cost=_cost(decision.cost, self._policy),
                )
            await self._writes.submit(
                _Write(
                    tenant=request.tenant,
                    tenant_route=tenant_route if tenant_changed else None,
                    session_key=session_key if session_changed else None,
                    region=region,
                    switched=switched,
                    request_id=request.request_id,
                    trace=tracing.traceparent(),
                )
            )
        if session_key is not None:
            self._seen[session_key] = now_s
        self._traffic.setdefault(request.tenant, Traffic()).add(region, now_s)
        self._pending[(request.tenant, region, day_of(now_s))] += 1
        return moved

    async def _write(self, writes: list[_Write]) -> list[None]:
        """The regions of the requests routed meanwhile in one statement, with their ``route_switched``
        events in the same transaction (group commit, straight on the driver: ``run_on_driver``); memory
        follows once it committed. Each request holds its tenant's turn, so a tenant is in a group at most
        once."""

        async def work(uow: DriverUnitOfWork) -> None:
            tenants = {
                w.tenant: StoredTenant(w.tenant_route.region, _at(w.tenant_route.switched_at_s))
                for w in writes
                if w.tenant_route is not None
            }
            sessions = {w.session_key: w.region for w in writes if w.session_key is not None}
            await self._store.save_routes(connection=uow.connection, tenants=tenants, sessions=sessions, now=uow.now)
            for w in writes:
                if w.switched is not None:
                    uow.emit(
                        Context.ROUTING,
                        RoutingEventName.ROUTE_SWITCHED,
                        w.switched,
                        tenant=w.tenant,
                        correlation_id=w.request_id,
                        traceparent=w.trace,
                    )
                uow.after_commit(partial(self._routed, w.tenant, w.tenant_route, w.session_key, w.region))

        # Without a switch to announce, the one statement is its own transaction (no BEGIN and COMMIT).
        await self._uow.run_on_driver(work, transaction=any(w.switched is not None for w in writes))
        return [None] * len(writes)

    def _routed(
        self, tenant: str, tenant_route: TenantRoute | None, session_key: tuple[str, str] | None, region: str
    ) -> None:
        """The tenant's and the session's regions, as the transaction that wrote them committed."""
        if tenant_route is not None:
            self._tenants[tenant] = tenant_route
        if session_key is not None:
            self._sessions[session_key] = region

    # -- route.region (operators) ------------------------------------------------------------------------

    async def region(self, request: RouteRegionRequest) -> BaseModel:
        if request.region not in self._regions:
            return rejected(ErrorCode.NOT_FOUND, f"no region {request.region[:80]!r}")
        state = RegionState(request.state)
        previous = self._states.get(request.region, RegionState.UP)

        async def work(uow: UnitOfWork) -> None:
            await self._store.save_region(session=uow.session, region=request.region, state=state.value, now=uow.now)
            if state is not previous:
                uow.emit(
                    Context.ROUTING,
                    RoutingEventName.REGION_STATE_CHANGED,
                    RegionStateEvent(region=request.region, state=state.value, previous=previous.value),
                )
            uow.after_commit(lambda: self._states.update({request.region: state}))

        await self._uow.run(work)
        return RouteRegionReply(status="ok", region=request.region, state=state.value, previous=previous.value)

    # -- events: where replicas are --------------------------------------------------------------------

    async def on_placement_decided(self, *, uow: UnitOfWork, event: EventEnvelope, payload: PlacementEvent) -> None:
        reply = payload.reply
        if reply.status != "placed" or reply.allocation_id is None or reply.region is None:
            return
        replica = StoredReplica(reply.allocation_id, reply.region, payload.model, reply.sku)
        await self._store.add_replica(session=uow.session, replica=replica)
        uow.after_commit(lambda: self._replicas.add(replica.allocation_id, replica.region, replica.model, replica.sku))

    async def on_placement_released(
        self, *, uow: UnitOfWork, event: EventEnvelope, payload: PlacementReleasedEvent
    ) -> None:
        allocation_id = payload.allocation_id
        await self._store.remove_replicas(session=uow.session, allocation_ids=[allocation_id])
        uow.after_commit(lambda: self._replicas.remove(allocation_id))

    # -- the traffic flush and the forgetting --------------------------------------------------------------

    async def flush(self) -> None:
        """Loop: write the traffic counts, forget old sessions and traffic outside the window."""
        passes = 0
        while True:
            await asyncio.sleep(self._flush_s)
            self.reload_regions()
            try:
                await self.flush_once(sweep=passes % 600 == 0)
            except Exception:  # counts stay pending for the next pass
                self._log.exception("router traffic flush failed")
            passes += 1

    def reload_regions(self) -> bool:
        """Take the regions file's new prices, power and RTTs when it changed (a bad file keeps the old)."""
        try:
            regions = self._regions_changed()
        except Exception as exc:
            self._log.warning("the regions file changed but cannot be read; keeping the old", extra={"error": str(exc)})
            return False
        if regions is None:
            return False
        self._regions = dict(regions)
        self._log.info("regions reloaded", extra={"regions": sorted(self._regions)})
        return True

    async def flush_once(self, *, sweep: bool = False) -> int:
        pending, self._pending = self._pending, Counter()
        now = self._clock()

        async def work(uow: UnitOfWork) -> None:
            await self._store.add_traffic(session=uow.session, counts=pending)
            if sweep:
                await self._store.forget_sessions(session=uow.session, before=now - timedelta(seconds=SESSION_KEPT_S))
                first_day = day_of(now.timestamp()) - self._policy.affinity.window_days
                await self._store.forget_traffic(session=uow.session, before_day=first_day)

        if not pending and not sweep:
            return 0
        try:
            await self._uow.run(work)
        except Exception:
            self._pending.update(pending)
            raise
        if sweep:
            for traffic in self._traffic.values():
                traffic.prune(now.timestamp(), self._policy.affinity)
            before = now.timestamp() - SESSION_KEPT_S
            for key in [k for k in self._sessions if self._seen.get(k, 0.0) < before]:
                self._sessions.pop(key, None)
                self._seen.pop(key, None)
        return sum(pending.values())


def _full(admission: AdmitReply) -> bool:
    """Admission in that region found nothing that could take the request."""
    return (
        admission.status == "rejected" and admission.error is not None and admission.error.code == ErrorCode.NO_CAPACITY
    )
