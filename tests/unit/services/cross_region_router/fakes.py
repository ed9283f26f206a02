"""The router's fake store (``RoutingStore`` in memory: what each test seeds and what the handlers wrote) and
``router()``, which builds ``RoutingHandlers`` on it with the kit's ``FakeUnitOfWork`` and ``FakeRpc``."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel

from services.cross_region_router.handlers import RoutingHandlers
from services.cross_region_router.store import Loaded, RoutingStore, StoredReplica, StoredTenant
from shared.contracts.base import ErrorCode, rejected
from shared.contracts.envelope import EventEnvelope, new_event
from shared.contracts.placement import AdmitReply, AdmitRequest, PlacementEvent, PlacementReleasedEvent, PlaceReply
from shared.contracts.routing import RouteSelectReply, RouteSelectRequest
from shared.domain.routing import Region, RoutePolicy
from shared.infra.catalog import load_models
from tests.fakes import NOW, Answer, FakeRpc, FakeUnitOfWork
from tests.unit.domain.routing.builders import world


class FakeStore(RoutingStore):
    """The router's tables as dicts. Writes made by a unit of work that later rolls back stay here (the fake
    has no transaction): tests of a rollback look at the handlers' memory, not at this."""

    def __init__(self) -> None:
        self.tenants: dict[str, StoredTenant] = {}
        self.sessions: dict[tuple[str, str], tuple[str, datetime]] = {}  # -> (region, updated at)
        self.traffic: Counter[tuple[str, str, int]] = Counter()  # (tenant, region, day) -> requests
        self.regions: dict[str, str] = {}
        self.replicas: dict[str, StoredReplica] = {}
        self.loads = 0
        self.load_fails: list[Exception] = []  # raised by the next loads, in order (Postgres not up yet)
        self.write_fails: list[Exception] = []  # raised by the next writes, before they change anything
        self.swept: list[tuple[str, Any]] = []

    def _write(self) -> None:
        if self.write_fails:
            raise self.write_fails.pop(0)

    async def load(self, *, session: Any, since_day: int, sessions_since: datetime) -> Loaded:
        self.loads += 1
        if self.load_fails:
            raise self.load_fails.pop(0)
        traffic: dict[str, dict[tuple[str, int], int]] = {}
        for (tenant, region, day), n in self.traffic.items():
            if day >= since_day:
                traffic.setdefault(tenant, {})[(region, day)] = n
        return Loaded(
            tenants=dict(self.tenants),
            sessions={key: region for key, (region, at) in self.sessions.items() if at >= sessions_since},
            traffic=traffic,
            regions=dict(self.regions),
            replicas=tuple(self.replicas[key] for key in sorted(self.replicas)),
        )

    async def save_routes(
        self,
        *,
        connection: Any,
        tenants: Mapping[str, StoredTenant],
        sessions: Mapping[tuple[str, str], str],
        now: datetime,
    ) -> None:
        self._write()
        self.tenants.update(tenants)
        self.sessions.update({key: (region, now) for key, region in sessions.items()})

    async def forget_sessions(self, *, session: Any, before: datetime) -> int:
        self._write()
        self.swept.append(("sessions", before))
        old = [key for key, (_region, at) in self.sessions.items() if at < before]
        for key in old:
            del self.sessions[key]
        return len(old)

    async def add_traffic(self, *, session: Any, counts: Mapping[tuple[str, str, int], int]) -> None:
        self._write()
        self.traffic.update(counts)

    async def forget_traffic(self, *, session: Any, before_day: int) -> None:
        self._write()
        self.swept.append(("traffic", before_day))
        for key in [key for key in self.traffic if key[2] < before_day]:
            del self.traffic[key]

    async def save_region(self, *, session: Any, region: str, state: str, now: datetime) -> None:
        self._write()
        self.regions[region] = state

    async def add_replica(self, *, session: Any, replica: StoredReplica) -> None:
        self._write()
        self.replicas.setdefault(replica.allocation_id, replica)

    async def remove_replicas(self, *, session: Any, allocation_ids: Iterable[str]) -> None:
        self._write()
        for allocation_id in allocation_ids:
            self.replicas.pop(allocation_id, None)


# -- a router on fakes ------------------------------------------------------------------------------


class FakeClock:
    """A clock the test moves (``advance``)."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


MODELS = load_models()
GROUPS = {"chat": ("llama3-8b", "llama3-70b")}


@dataclass
class Router:
    """``RoutingHandlers`` on a fake store, a fake unit of work, a scripted ``placement.admit`` and a fake
    clock; ``regions_file`` stands for the regions file (set it to what the next reload reads)."""

    handlers: RoutingHandlers
    store: FakeStore
    uow: FakeUnitOfWork
    rpc: FakeRpc
    clock: FakeClock
    regions_file: list[Mapping[str, Region] | Exception | None] = field(default_factory=list)

    async def select(self, **fields: Any) -> BaseModel:
        defaults: dict[str, Any] = {
            "request_id": f"r-{len(self.rpc.sent) + self.uow.runs}",
            "tenant": "acme",
            "origin_region": "east",
            "model": "llama3-8b",
            "input_tokens": 100,
            "output_tokens": 10,
        }
        return await self.handlers.select(RouteSelectRequest(**(defaults | fields)))

    async def routed(self, **fields: Any) -> RouteSelectReply:
        reply = await self.select(**fields)
        assert isinstance(reply, RouteSelectReply), reply
        return reply

    async def decided(
        self, allocation_id: str, region: str, model: str = "llama3-8b", *, sku: str | None = None
    ) -> None:
        """placement_decided, applied in its own (consumer) transaction."""
        await self.uow.run(
            lambda uow: self.handlers.on_placement_decided(uow=uow, **decided(allocation_id, region, model, sku=sku))
        )

    async def released(self, allocation_id: str) -> None:
        await self.uow.run(lambda uow: self.handlers.on_placement_released(uow=uow, **released(allocation_id)))


def admitted(request: BaseModel) -> AdmitReply:
    assert isinstance(request, AdmitRequest)
    return AdmitReply(status="admitted", allocation_id=f"adm-{request.request_id}", region=request.region)


def full_in(*regions: str) -> Callable[[BaseModel], BaseModel]:
    """``placement.admit``: no capacity in ``regions``, admitted elsewhere."""

    def answer(request: BaseModel) -> BaseModel:
        assert isinstance(request, AdmitRequest)
        if request.region in regions:
            return AdmitReply(status="rejected", error=rejected(ErrorCode.NO_CAPACITY, "no replica has room").error)
        return admitted(request)

    return answer


def decided(
    allocation_id: str, region: str, model: str = "llama3-8b", *, status: str = "placed", sku: str | None = None
) -> dict[str, Any]:
    """The handler arguments of a ``placement_decided`` event (a replica on ``sku``, None: not said)."""
    reply = PlaceReply(
        status=status,  # type: ignore[arg-type]
        request_id=f"p-{allocation_id}",
        allocation_id=allocation_id,
        region=region,
        sku=sku,
    )
    payload = PlacementEvent(request_id=reply.request_id, tenant="acme", model=model, reply=reply, decision_ms=0.1)
    return {"event": _envelope("placement_decided", payload), "payload": payload}


def released(allocation_id: str) -> dict[str, Any]:
    payload = PlacementReleasedEvent(allocation_id=allocation_id, tenant="acme")
    return {"event": _envelope("placement_released", payload), "payload": payload}


def _envelope(name: str, payload: BaseModel) -> EventEnvelope:
    return new_event(
        type=f"placement.{name}", source="placement", payload=payload.model_dump(mode="json"), occurred_at=NOW
    )


def router(
    *,
    regions: Mapping[str, Region] | None = None,
    admit: list[Answer] | None = None,
    policy: RoutePolicy | None = None,
    replicas: Iterable[tuple[str, str] | tuple[str, str, str]] = (),
    store: FakeStore | None = None,
) -> Router:
    """A router over the test world (east, west, eu: ``tests.unit.domain.routing.builders.world``) with a
    ``llama3-8b`` replica in each of ``replicas`` (allocation id, region[, SKU]) seeded in its table."""
    store = store or FakeStore()
    for allocation_id, region, *sku in replicas:
        store.replicas[allocation_id] = StoredReplica(allocation_id, region, "llama3-8b", sku[0] if sku else None)
    clock = FakeClock(NOW)
    uow = FakeUnitOfWork(clock, source="cross-region-router")
    rpc = FakeRpc(placement_admit=admit or [admitted])
    pending: list[Mapping[str, Region] | Exception | None] = []

    def regions_changed() -> Mapping[str, Region] | None:
        if not pending:
            return None
        change = pending.pop(0)
        if isinstance(change, Exception):
            raise change
        return change

    handlers = RoutingHandlers(
        uow=uow,  # type: ignore[arg-type]
        rpc=rpc,
        store=store,
        clock=clock,
        regions=regions if regions is not None else world(),
        models=MODELS,
        groups=GROUPS,
        policy=policy or RoutePolicy(),
        log=logging.getLogger("test.router"),
        flush_s=0.001,
        regions_changed=regions_changed,
    )
    return Router(handlers=handlers, store=store, uow=uow, rpc=rpc, clock=clock, regions_file=pending)
