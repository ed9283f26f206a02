"""Where replicas are: the read model (``ReplicaRegions``) and the PLACEMENT event handlers that fold into
it only once their consumer transaction commits (a batch that rolls back and replays changes nothing)."""

from __future__ import annotations

import pytest

from services.cross_region_router.readmodel import ReplicaRegions
from services.cross_region_router.store import StoredReplica
from shared.contracts.base import ErrorCode, Rejected
from shared.infra.uow import UnitOfWork
from tests.unit.services.cross_region_router.fakes import decided, released, router

LLAMA = ("llama3-8b",)


# -- the read model ---------------------------------------------------------------------------------


def test_a_region_serves_a_model_while_it_holds_one_of_its_replicas() -> None:
    replicas = ReplicaRegions([("al-1", "east", "llama3-8b", None), ("al-2", "east", "llama3-8b", None)])
    replicas.add("al-3", "west", "llama3-70b")
    assert replicas.serves("east", LLAMA) and not replicas.serves("west", LLAMA)
    assert replicas.serves("west", ("llama3-8b", "llama3-70b"))  # a group: any member
    replicas.remove("al-1")
    assert replicas.serves("east", LLAMA)  # al-2 is still there
    replicas.remove("al-2")
    assert not replicas.serves("east", LLAMA) and len(replicas) == 1


def test_adding_a_known_replica_or_removing_an_unknown_one_changes_nothing() -> None:
    replicas = ReplicaRegions()
    replicas.add("al-1", "east", "llama3-8b")
    replicas.add("al-1", "east", "llama3-8b")  # a redelivered event
    replicas.remove("al-9")
    replicas.remove("al-1")
    assert not replicas.serves("east", LLAMA) and len(replicas) == 0


# -- the events -------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_decided_replica_serves_its_region_only_once_its_transaction_committed() -> None:
    r = router()
    during: list[bool] = []

    async def consume(uow: UnitOfWork) -> None:
        await r.handlers.on_placement_decided(uow=uow, **decided("al-1", "west"))
        during.append(r.handlers.replicas.serves("west", LLAMA))

    await r.uow.run(consume)
    assert during == [False] and r.handlers.replicas.serves("west", LLAMA)
    assert not r.handlers.replicas.serves("east", LLAMA)
    assert r.store.replicas == {"al-1": StoredReplica("al-1", "west", "llama3-8b")}
    assert (await r.routed(origin_region="east")).region == "west"


@pytest.mark.asyncio
async def test_a_decided_replica_whose_transaction_rolled_back_adds_no_capacity() -> None:
    r = router()
    await r.handlers.start()  # loaded before the events (the fake store keeps rolled-back rows: no reload)
    r.uow.fail_next = RuntimeError("commit refused")
    with pytest.raises(RuntimeError):
        await r.decided("al-1", "west")
    assert not r.handlers.replicas.serves("west", LLAMA)

    async def batch(uow: UnitOfWork) -> None:  # a later event of the same batch fails: all of it rolls back
        await r.handlers.on_placement_decided(uow=uow, **decided("al-2", "eu"))
        raise RuntimeError("the next event's handler failed")

    with pytest.raises(RuntimeError):
        await r.uow.run(batch)
    assert len(r.handlers.replicas) == 0
    reply = await r.select()
    assert isinstance(reply, Rejected) and reply.error.code is ErrorCode.NO_CAPACITY


@pytest.mark.asyncio
async def test_a_replayed_batch_counts_its_replica_once_and_one_release_ends_it() -> None:
    r = router()
    r.uow.fail_next = RuntimeError("serialization failure")
    with pytest.raises(RuntimeError):
        await r.decided("al-1", "west")
    await r.decided("al-1", "west")  # the batch again
    await r.decided("al-1", "west")  # and a redelivery the inbox would skip
    assert len(r.handlers.replicas) == 1
    await r.released("al-1")
    assert not r.handlers.replicas.serves("west", LLAMA) and r.store.replicas == {}


@pytest.mark.asyncio
async def test_a_released_replica_stops_serving_its_region_once_the_release_committed() -> None:
    r = router(replicas=(("al-1", "west"), ("al-2", "eu")))
    await r.handlers.start()
    r.uow.fail_next = RuntimeError("commit refused")
    with pytest.raises(RuntimeError):
        await r.released("al-1")
    assert r.handlers.replicas.serves("west", LLAMA)  # rolled back: still there
    await r.released("al-1")
    assert not r.handlers.replicas.serves("west", LLAMA) and r.handlers.replicas.serves("eu", LLAMA)
    assert (await r.routed(origin_region="west")).region == "eu"


@pytest.mark.asyncio
async def test_a_decision_that_placed_nothing_changes_nothing() -> None:
    r = router()
    await r.uow.run(lambda uow: r.handlers.on_placement_decided(uow=uow, **decided("al-1", "west", status="queued")))
    assert r.store.replicas == {} and len(r.handlers.replicas) == 0


@pytest.mark.asyncio
async def test_a_decided_and_a_released_event_in_one_batch_leave_no_replica() -> None:
    r = router()

    async def batch(uow: UnitOfWork) -> None:
        await r.handlers.on_placement_decided(uow=uow, **decided("al-1", "west"))
        await r.handlers.on_placement_released(uow=uow, **released("al-1"))

    await r.uow.run(batch)
    assert len(r.handlers.replicas) == 0 and r.store.replicas == {}
