"""The filler's loops on fakes: the tick re-offers GPUs whose backoff ended, the restatement publishes
every active reservation's state unchanged, the start re-issues what a crash left owed; and the inventory
follows the topology."""

from __future__ import annotations

from datetime import datetime

import pytest

from shared.contracts.envelope import new_event
from shared.contracts.ledger import LedgerPreemptReply
from shared.contracts.reservation import (
    ReservationCancelRequest,
    ReservationCreateReply,
    ReservationCreateRequest,
    ReservationReclaimRequest,
)
from shared.contracts.subjects import Rpc
from shared.contracts.topology import NodeProfileEvent, NodeStateEvent
from shared.domain.fleet import Accelerator, NodeProfile
from shared.domain.topology import LinkMatrix
from shared.infra.profiles import profile_to_payload
from shared.infra.rpc import RpcError
from tests.fakes import NOW, FakeRpc
from tests.unit.services.reservation_filler.fakes import REGION, SKU, Filler, allocation, later, ledger_event

pytestmark = pytest.mark.asyncio


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> datetime:
        return self.now


async def reserve(filler: Filler, policy: str, gpus: list[str], tenant: str = "acme") -> str:
    reply = await filler.handlers.requests.create(
        ReservationCreateRequest(tenant=tenant, policy=policy, accelerators=gpus)
    )
    assert isinstance(reply, ReservationCreateReply), reply
    return reply.reservation_id or ""


async def test_the_tick_offers_a_gpu_again_once_its_backoff_ended() -> None:
    clock = Clock()
    filler = Filler(clock=clock, rpc=FakeRpc(ledger_preempt=[LedgerPreemptReply(status="ended")]))
    gpus = filler.store.node("n1", gpus=2)
    rid = await reserve(filler, "soft", gpus)
    payload = allocation("al-1", "globex", gpus[:1])
    await filler.uow.run(
        lambda uow: filler.handlers.uses.on_allocation_committed(
            uow=uow, event=ledger_event("allocation_committed"), payload=payload
        )
    )
    await filler.handlers.reclaimer.reclaim(
        ReservationReclaimRequest(request_id="p-1", tenant="acme", allocation_ids=["al-1"])
    )
    await filler.handlers.reclaimer.settled()
    await filler.uow.run(
        lambda uow: filler.handlers.uses.on_allocation_ended(
            uow=uow, event=ledger_event("allocation_released"), payload=payload
        )
    )
    assert gpus[0] not in filler.store.reservations[rid].offered  # backing off (30 s)
    events = len(filler.uow.events)
    clock.now = later(10)
    assert await filler.handlers.upkeep.tick_once() == 0
    assert len(filler.uow.events) == events  # still backing off: nothing changes
    clock.now = later(31)
    await filler.handlers.upkeep.tick_once()
    assert gpus[0] in filler.store.reservations[rid].offered
    assert [(e["reason"], sorted(e["reservation"]["offered"])) for e in filler.uow.named("offered")][-1] == (
        "backoff",
        sorted(gpus),
    )


async def test_restating_publishes_every_active_reservation_unchanged() -> None:
    filler = Filler()
    gpus = filler.store.node("n1", gpus=3)
    first = await reserve(filler, "hard", gpus[:1])
    second = await reserve(filler, "soft", gpus[1:2], tenant="globex")
    ended = await reserve(filler, "hard", gpus[2:])
    await filler.handlers.requests.cancel(ReservationCancelRequest(tenant="acme", reservation_id=ended))
    versions = {rid: r.version for rid, r in filler.store.reservations.items()}
    assert await filler.handlers.upkeep.restate_once() == 2
    restated = filler.uow.named("restated")
    assert [e["reservation_id"] for e in restated] == sorted([first, second])
    assert all(e["reservation"]["version"] == versions[e["reservation_id"]] for e in restated)
    assert {rid: r.version for rid, r in filler.store.reservations.items()} == versions


async def test_start_reissues_what_a_crash_left_owed_and_survives_a_silent_ledger() -> None:
    filler = Filler(
        rpc=FakeRpc(ledger_preempt=[RpcError(Rpc.LEDGER_PREEMPT, "no one"), LedgerPreemptReply(status="ended")])
    )
    gpus = filler.store.node("n1", gpus=1)
    rid = await reserve(filler, "spot", gpus)
    await filler.uow.run(
        lambda uow: filler.handlers.uses.on_allocation_committed(
            uow=uow, event=ledger_event("allocation_committed"), payload=allocation("al-1", "globex", gpus)
        )
    )
    await filler.handlers.reclaimer.reclaim(
        ReservationReclaimRequest(request_id="p-1", tenant="acme", allocation_ids=["al-1"])
    )
    assert not filler.store.reservations[rid].preemptions[0].done  # as a crash before the answer leaves it
    await filler.handlers.upkeep.start()
    await filler.handlers.reclaimer.settled()
    assert filler.store.reservations[rid].preemptions[0].done
    assert [a.allocation_id for a in filler.rpc.requests(Rpc.LEDGER_PREEMPT)] == ["al-1", "al-1"]


def profile(name: str, gpus: int) -> NodeProfile:
    codes = [["X" if i == j else "NV18" for j in range(gpus)] for i in range(gpus)]
    return NodeProfile(
        name=name,
        region=REGION,
        cluster="c1",
        rack="k1",
        sku=SKU,
        accelerators=tuple(Accelerator(index=i, sku=SKU, hbm_bytes=80 * 10**9) for i in range(gpus)),
        links=LinkMatrix.from_codes(codes),
        source="nvml",
    )


async def test_the_inventory_follows_the_topology() -> None:
    filler = Filler()
    event = new_event(type="t.events.topology.node_profiled", source="topology-discovery", payload={}, occurred_at=NOW)
    node = NodeProfileEvent(
        node="n1", region=REGION, kind="fully_connected", fingerprint="f", profile=profile_to_payload(profile("n1", 2))
    )
    await filler.uow.run(lambda uow: filler.handlers.uses.on_node_profiled(uow=uow, event=event, payload=node))
    assert sorted(filler.store.slots) == ["n1/gpu0", "n1/gpu1"]
    assert {s.cluster for s in filler.store.slots.values()} == {f"{REGION}/c1"}
    gone = NodeStateEvent(node="n1", region=REGION, accelerators=["n1/gpu0", "n1/gpu1"])
    await filler.uow.run(lambda uow: filler.handlers.uses.on_node_removed(uow=uow, event=event, payload=gone))
    assert filler.store.slots == {}
    assert filler.uow.events == []  # the inventory is the filler's own: nothing to tell
