"""The reservation filler's store in memory (the same interface as ``ReservationStore``, the SQL's meaning:
holds only for active reservations, a taken accelerator refuses a new reservation whole), and builders for
its handler tests."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from services.reservation_filler.handlers import ReservationHandlers
from services.reservation_filler.store import HeldElsewhere, ReservationStore
from shared.contracts.envelope import EventEnvelope, new_event
from shared.contracts.ledger import AllocationEvent, ShareOut
from shared.domain.fleet import AcceleratorId
from shared.domain.quotas import Quotas
from shared.domain.reservations import LendingPolicy, Reservation, Slot, Use
from shared.infra.catalog import load_regions, load_skus
from tests.fakes import NOW, FakeRpc, FakeUnitOfWork

SKU = "H100-SXM-80GB"
REGION = "us-west-1"
GB = 10**9
SKUS = load_skus()
REGIONS = load_regions()


class FakeReservationStore(ReservationStore):
    def __init__(self) -> None:
        self.reservations: dict[str, Reservation] = {}
        self.request_ids: dict[tuple[str, str], str] = {}
        self.holds: dict[str, str] = {}  # accelerator -> reservation id
        self.slots: dict[str, Slot] = {}
        self.uses: dict[str, Use] = {}

    async def load(self, *, session: Any, reservation_id: str, lock: bool = False) -> Reservation | None:
        return self.reservations.get(reservation_id)

    async def load_by_request(self, *, session: Any, tenant: str, request_id: str) -> Reservation | None:
        rid = self.request_ids.get((tenant, request_id))
        return None if rid is None else self.reservations[rid]

    async def load_many(
        self,
        *,
        session: Any,
        tenant: str | None = None,
        ids: Iterable[str] | None = None,
        active_only: bool = True,
        lock: bool = False,
    ) -> list[Reservation]:
        wanted = None if ids is None else set(ids)
        return [
            r
            for rid, r in sorted(self.reservations.items())
            if (tenant is None or r.tenant == tenant)
            and (wanted is None or rid in wanted)
            and (r.active or not active_only)
        ]

    async def load_ticking(self, *, session: Any) -> list[Reservation]:
        return [r for r in await self.load_many(session=session) if r.preemptions or r.backoff]

    async def add(self, *, session: Any, reservation: Reservation, request_id: str | None, now: datetime) -> None:
        clash = [acc for acc in reservation.accelerators if acc in self.holds]
        if clash:
            raise HeldElsewhere(clash)
        self.reservations[reservation.id] = reservation
        self.holds.update({acc: reservation.id for acc in reservation.accelerators})
        if request_id is not None:
            self.request_ids[(reservation.tenant, request_id)] = reservation.id

    async def save(self, *, session: Any, reservation: Reservation, now: datetime) -> None:
        self.reservations[reservation.id] = reservation
        if not reservation.active:
            self.holds = {acc: rid for acc, rid in self.holds.items() if rid != reservation.id}

    async def held(self, *, session: Any) -> set[str]:
        return set(self.holds)

    async def reserved_by(self, *, session: Any, tenant: str) -> int:
        return sum(1 for rid in self.holds.values() if self.reservations[rid].tenant == tenant)

    async def set_node(self, *, session: Any, node: str, slots: Sequence[Slot]) -> None:
        self.slots = {k: s for k, s in self.slots.items() if s.node != node} | {s.id: s for s in slots}

    async def inventory(self, *, session: Any, ids: Iterable[str] | None = None) -> dict[str, Slot]:
        wanted = None if ids is None else set(ids)
        return {k: s for k, s in self.slots.items() if wanted is None or k in wanted}

    async def add_use(self, *, session: Any, use: Use) -> tuple[str, ...] | None:
        if use.allocation_id in self.uses:
            return None
        self.uses[use.allocation_id] = use
        return self._held_on(use.accelerators)

    async def remove_use(self, *, session: Any, allocation_id: str) -> tuple[Use, tuple[str, ...]] | None:
        use = self.uses.pop(allocation_id, None)
        return None if use is None else (use, self._held_on(use.accelerators))

    def _held_on(self, accelerators: Iterable[str]) -> tuple[str, ...]:
        return tuple(sorted({self.holds[acc] for acc in accelerators if acc in self.holds}))

    async def uses_on(self, *, session: Any, accelerators: Iterable[str]) -> list[Use]:
        keys = set(accelerators)
        return [u for u in self.uses.values() if u.accelerators & keys]

    async def used_by_others(self, *, session: Any, tenant: str) -> set[str]:
        return {acc for u in self.uses.values() if u.tenant != tenant for acc in u.bytes}

    async def unsent_tail(self, *, session: Any) -> int | None:
        return None  # the relay has published everything

    async def unsent_through(self, *, session: Any, seq: int) -> bool:
        return False

    # -- for the tests -----------------------------------------------------------------------------

    def node(self, name: str, *, gpus: int = 8, sku: str = SKU, region: str = REGION) -> list[str]:
        """A node of the fleet (as a TOPOLOGY event would record it); its GPU ids."""
        ids = [AcceleratorId.gpu(name, i) for i in range(gpus)]
        for acc in ids:
            self.slots[acc] = Slot(id=acc, node=name, sku=sku, region=region, cluster=f"{region}/c1")
        return ids

    def owed(self) -> list[Reservation]:
        """The reservations with preemptions owed (read at once, outside a transaction)."""
        return [r for r in self.reservations.values() if any(not p.done for p in r.preemptions)]

    def recorded(self) -> tuple[object, ...]:
        """Everything it holds, to compare before and after a refused request."""
        return (dict(self.reservations), dict(self.request_ids), dict(self.holds), dict(self.uses))


class Filler:
    """One filler's handlers on fakes: ``store``, ``uow`` (its committed events), ``rpc`` (the ledger)."""

    def __init__(
        self,
        *,
        rpc: FakeRpc | None = None,
        quotas: Quotas | None = None,
        policy: LendingPolicy | None = None,
        clock: Any = None,
        store: FakeReservationStore | None = None,
        after_record: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store or FakeReservationStore()
        self.uow = FakeUnitOfWork(clock) if clock is not None else FakeUnitOfWork()
        self.rpc = rpc or FakeRpc()
        self.handlers = ReservationHandlers(
            uow=self.uow,  # type: ignore[arg-type]
            rpc=self.rpc,
            store=self.store,
            policy=policy or LendingPolicy(fill_target=0.85, backoff_s=30.0, backoff_max_s=1800.0),
            skus=SKUS,
            regions=REGIONS,
            log=logging.getLogger("test.reservation"),
            quotas=quotas,
            after_record=after_record,
        )


def ledger_event(name: str, *, at: datetime = NOW) -> EventEnvelope:
    return new_event(type=f"t.events.ledger.{name}", source="capacity-ledger", payload={}, occurred_at=at)


def allocation(
    allocation_id: str, tenant: str, accelerators: Sequence[str], *, preemptible: bool = True
) -> AllocationEvent:
    return AllocationEvent(
        allocation_id=allocation_id,
        request_id=f"req-{allocation_id}",
        tenant=tenant,
        kind="replica",
        preemptible=preemptible,
        shares=[
            ShareOut(
                accelerator_id=acc,
                weights_bytes=10 * GB,
                kv_bytes=0,
                activation_bytes=0,
                workspace_bytes=0,
                total_bytes=10 * GB,
            )
            for acc in accelerators
        ],
    )


def later(seconds: float) -> datetime:
    return NOW + timedelta(seconds=seconds)
