"""AdmissionHandlers with fakes: an RPC client that records any call (admission must make none: it counts
requests in memory), a fake monotonic clock, engine reports handed in directly. No servers."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from services.placement.admission import AdmissionHandlers, Fairness
from services.placement.replicas import Hold, Replica, ReplicaBook, replica_of
from shared.contracts.base import ErrorCode, Rejected
from shared.contracts.ledger import no_allocation
from shared.contracts.placement import (
    AcceleratorShare,
    AdmitReply,
    AdmitRequest,
    NodePlacement,
    PlaceReply,
    ReleaseReply,
    RenewReply,
)
from shared.contracts.subjects import Rpc, Subjects
from shared.contracts.topology import EngineStatusEvent
from shared.domain.admission import AdmitPolicy, Engine, Tenancy
from shared.infra.catalog import load_models
from shared.infra.rpc import RpcClient

MODELS = load_models()
GROUPS = {"chat": ("llama3.1-8b", "mamba2-2.7b", "mixtral-8x7b")}
GB = 10**9
log = logging.getLogger("test.admission")


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000_000.0

    def __call__(self) -> float:
        return self.ms


class NoCalls(RpcClient):
    """An RPC client that records every call and answers none: admission must not call another service."""

    def __init__(self) -> None:
        super().__init__(lambda: None, Subjects("t"))  # type: ignore[arg-type, return-value]
        self.calls: list[Rpc] = []

    async def call(self, rpc: Rpc, request: BaseModel, **_: Any) -> BaseModel:
        self.calls.append(rpc)
        raise AssertionError(f"admission called {rpc} on the request path")


def _replica(
    replica_id: str,
    model: str,
    node: str,
    *,
    kv_gb: float = 40,
    region: str = "us-west-1",
    owner: str = "platform",
    sku: str | None = None,
) -> Replica:
    """A replica of ``owner`` (by default the platform team's shared pool, which serves every tenant)."""
    spec = MODELS[model]
    from shared.domain.admission import engine_of

    return Replica(
        replica_id=replica_id,
        owner=owner,
        model=model,
        engine=engine_of(spec),
        node=node,
        region=region,
        tp=1,
        kv_pool={f"{node}/gpu0": int(kv_gb * GB)},
        sku=sku,
    )


def _status(replica: Replica, **figures: Any) -> EngineStatusEvent:
    values: dict[str, Any] = {
        "replica_id": replica.replica_id,
        "node": replica.node,
        "queue_depth": 1,
        "kv_used_bytes": 0,
        "kv_total_bytes": replica.kv_total,
        "latency_p50_ms": 90.0,
        "latency_p99_ms": 200.0,
        "healthy": True,
    }
    values.update(figures)
    return EngineStatusEvent(**values)


SHARED = Tenancy.of("own", {"platform"})  # the platform team's replicas serve every tenant


def _stack(
    *replicas: Replica,
    fairness: Fairness | None = None,
    draining: set[str] | None = None,
    tenancy: Tenancy = SHARED,
) -> tuple[AdmissionHandlers, NoCalls, Clock, ReplicaBook]:
    book = ReplicaBook(models=MODELS)
    for replica in replicas:
        book.add(replica)
    ledger = NoCalls()
    clock = Clock()
    handlers = AdmissionHandlers(
        book=book,
        rpc=ledger,
        models=MODELS,
        groups=GROUPS,
        policy=AdmitPolicy(),
        fairness=fairness or Fairness(),
        timer=clock,
        log=log,
        draining=lambda: draining if draining is not None else set(),
        tenancy=tenancy,
    )
    return handlers, ledger, clock, book


def _ask(
    request_id: str, *, tenant: str = "acme", model: str = "chat", tokens: int = 1000, **extra: Any
) -> AdmitRequest:
    return AdmitRequest(
        request_id=request_id, tenant=tenant, model=model, input_tokens=tokens, output_tokens=256, **extra
    )


async def test_a_64k_request_to_a_group_with_ssm_and_transformer_goes_to_the_ssm_replica() -> None:
    tf, ssm = _replica("r-tf", "llama3.1-8b", "n1"), _replica("r-ssm", "mamba2-2.7b", "n2")
    handlers, ledger, _clock, _book = _stack(tf, ssm)
    # The transformer is the faster and emptier one: only the long-context rule sends it to the SSM.
    handlers.on_engine_status(_status(tf, latency_p50_ms=40.0, queue_depth=0))
    handlers.on_engine_status(_status(ssm, latency_p50_ms=150.0, queue_depth=3))

    reply = await handlers.admit(_ask("long", tokens=64_000))

    assert isinstance(reply, AdmitReply) and reply.status == "admitted", reply
    assert (reply.replica_id, reply.engine, reply.model) == ("r-ssm", "ssm", "mamba2-2.7b")
    assert reply.failover == ["r-tf"]
    # A short request with no SLO goes by least cost: the idle, fast transformer.
    short = await handlers.admit(_ask("short", tokens=1000))
    assert isinstance(short, AdmitReply) and short.replica_id == "r-tf"
    # Counted in memory on the replica, for the requester; no other service was asked.
    hold = _book.holds[reply.allocation_id or ""]
    assert (hold.replica_id, hold.requester, hold.request_id) == ("r-ssm", "acme", "long")
    assert ledger.calls == []


async def test_a_replica_the_rebalancer_drains_takes_no_new_request_but_keeps_its_holds() -> None:
    """While a replica is being moved (REBALANCE `replica_draining`), new requests go to its copy; what it
    already holds (messages in flight) stays until released."""
    old, copy = _replica("r-old", "llama3.1-8b", "n1"), _replica("r-copy", "llama3.1-8b", "n2")
    draining: set[str] = set()
    handlers, _ledger, _clock, _book = _stack(old, copy, draining=draining)
    handlers.on_engine_status(_status(old, latency_p50_ms=30.0, queue_depth=0))  # the better one
    handlers.on_engine_status(_status(copy, latency_p50_ms=90.0, queue_depth=2))
    before = await handlers.admit(_ask("in-flight", tokens=1000))
    assert isinstance(before, AdmitReply) and before.replica_id == "r-old"

    draining.add("r-old")
    after = await handlers.admit(_ask("new", tokens=1000))
    assert isinstance(after, AdmitReply) and after.replica_id == "r-copy"
    assert before.allocation_id in _book.holds  # still in flight on the old one


async def test_a_stale_replica_is_never_chosen() -> None:
    tf, ssm = _replica("r-tf", "llama3.1-8b", "n1"), _replica("r-ssm", "mamba2-2.7b", "n2")
    handlers, _ledger, clock, _book = _stack(tf, ssm)
    handlers.on_engine_status(_status(ssm))
    clock.ms += 10_000
    handlers.on_engine_status(_status(tf))
    clock.ms += 6_000  # the SSM's report is 16 s old: past HETSCHED_ENGINE_STALE_S (15 s)

    reply = await handlers.admit(_ask("long", tokens=64_000))
    assert isinstance(reply, AdmitReply) and reply.replica_id == "r-tf"

    clock.ms += 10_000  # now both are stale: nothing can serve it, and waiting would not help
    none = await handlers.admit(_ask("later", tokens=1000))
    assert isinstance(none, Rejected) and none.error.code is ErrorCode.NO_CAPACITY
    assert "stale" in none.error.message

    handlers.on_engine_status(_status(ssm))  # it reports again: back in rotation
    back = await handlers.admit(_ask("again", tokens=64_000))
    assert isinstance(back, AdmitReply) and back.replica_id == "r-ssm"


async def test_a_failed_engine_fails_over_in_the_same_call_and_stays_out_until_it_reports() -> None:
    moe, tf = _replica("r-moe", "mixtral-8x7b", "n1", kv_gb=60), _replica("r-tf", "llama3.1-8b", "n2")
    handlers, _ledger, _clock, _book = _stack(moe, tf)
    handlers.on_engine_status(_status(moe, latency_p50_ms=30.0, queue_depth=0))
    handlers.on_engine_status(_status(tf, latency_p50_ms=80.0, queue_depth=0))

    first = await handlers.admit(_ask("q1"))
    assert isinstance(first, AdmitReply) and first.replica_id == "r-moe"

    # The gateway's call to the MoE engine timed out: it asks again naming the replica that failed.
    retry = await handlers.admit(_ask("q1-retry", failed_replica_id="r-moe"))
    assert isinstance(retry, AdmitReply) and retry.replica_id == "r-tf" and retry.engine == "transformer"
    other = await handlers.admit(_ask("q2"))  # still out of rotation for everyone
    assert isinstance(other, AdmitReply) and other.replica_id == "r-tf"

    handlers.on_engine_status(_status(moe, latency_p50_ms=30.0, queue_depth=0))
    back = await handlers.admit(_ask("q3"))
    assert isinstance(back, AdmitReply) and back.replica_id == "r-moe"


async def test_a_replica_whose_estimate_has_no_room_fails_over_to_the_next_one() -> None:
    """Grants since the engine's last report count on top of its reported use: the first replica fills
    before its engine reports again, and the next request goes to the next replica in the order."""
    a, b = _replica("r-a", "llama3.1-8b", "n1", kv_gb=10), _replica("r-b", "llama3.1-8b", "n2", kv_gb=10)
    handlers, ledger, _clock, book = _stack(a, b)
    handlers.on_engine_status(_status(a, latency_p50_ms=20.0, queue_depth=0, kv_used_bytes=2 * GB))
    handlers.on_engine_status(_status(b, latency_p50_ms=90.0, queue_depth=0))

    # (60,000 + 256) tokens x 128 KiB = 7.9 GB: one fits beside r-a's reported 2 GB, a second does not.
    first = await handlers.admit(_ask("x1", model="llama3.1-8b", tokens=60_000))
    second = await handlers.admit(_ask("x2", model="llama3.1-8b", tokens=60_000))
    assert isinstance(first, AdmitReply) and first.replica_id == "r-a"
    assert isinstance(second, AdmitReply) and second.replica_id == "r-b", second
    account = book.account("r-a")
    assert account is not None and account.estimate_bytes == 2 * GB + (first.kv_bytes or 0)
    assert ledger.calls == []


async def test_nothing_fits_queues_with_a_position_and_admits_when_capacity_frees() -> None:
    tf = _replica("r-tf", "llama3.1-8b", "n1")
    handlers, _ledger, _clock, _book = _stack(tf)
    handlers.on_engine_status(_status(tf, queue_depth=16))  # at the maximum queue depth

    first = await handlers.admit(_ask("w1"))
    second = await handlers.admit(_ask("w2", tenant="beta"))
    assert isinstance(first, AdmitReply) and (first.status, first.queue_position) == ("queued", 1)
    assert isinstance(second, AdmitReply) and (second.status, second.queue_position) == ("queued", 2)

    handlers.on_engine_status(_status(tf, queue_depth=0))
    assert await handlers.drain() == 2
    again = await handlers.admit(_ask("w1"))
    assert isinstance(again, AdmitReply) and again.status == "admitted" and again.replica_id == "r-tf"


async def test_the_same_request_id_answers_the_same_admission() -> None:
    tf = _replica("r-tf", "llama3.1-8b", "n1")
    handlers, ledger, _clock, _book = _stack(tf)
    handlers.on_engine_status(_status(tf))
    one = await handlers.admit(_ask("same"))
    two = await handlers.admit(_ask("same"))
    assert one == two and len(_book.holds) == 1 and ledger.calls == []


async def test_kv_is_held_until_release_and_only_its_tenant_may_release_it() -> None:
    tf = _replica("r-tf", "llama3.1-8b", "n1", kv_gb=1)
    handlers, ledger, _clock, book = _stack(tf)
    handlers.on_engine_status(_status(tf))
    reply = await handlers.admit(_ask("big", tokens=6000))
    assert isinstance(reply, AdmitReply) and reply.allocation_id is not None and reply.kv_bytes
    assert book.status(tf).held_bytes == reply.kv_bytes

    # Another tenant is answered as the ledger answers an unknown allocation: the same code and message,
    # so the id does not tell it exists; nothing changes.
    theirs = handlers.release_hold(reply.allocation_id, "mallory")
    assert theirs == no_allocation(reply.allocation_id)
    assert handlers.renew_hold(reply.allocation_id, "mallory", 600) == no_allocation(reply.allocation_id)
    assert book.status(tf).held_bytes == reply.kv_bytes
    # A long generation renews its admission (in memory), then releases it.
    renewed = handlers.renew_hold(reply.allocation_id, "acme", 600)
    assert isinstance(renewed, RenewReply) and renewed.status == "renewed" and renewed.lease_expires_at
    released = handlers.release_hold(reply.allocation_id, "acme")
    assert isinstance(released, ReleaseReply) and released.status == "released"
    assert book.status(tf).held_bytes == 0 and not book.holds
    # Idempotent: a second release, or an id never given, is the unknown-allocation answer.
    assert handlers.release_hold(reply.allocation_id, "acme") == no_allocation(reply.allocation_id)
    assert handlers.release_hold("adm-never", "acme") == no_allocation("adm-never")
    # The same request id admits anew once released.
    again = await handlers.admit(_ask("big", tokens=6000))
    assert isinstance(again, AdmitReply) and again.allocation_id not in (None, reply.allocation_id)
    assert ledger.calls == []


async def test_an_admission_not_released_within_its_lease_is_dropped() -> None:
    tf = _replica("r-tf", "llama3.1-8b", "n1", kv_gb=1)
    handlers, _ledger, clock, book = _stack(tf)
    handlers.on_engine_status(_status(tf))
    reply = await handlers.admit(_ask("gone", tokens=6000, lease_s=5))
    assert isinstance(reply, AdmitReply) and reply.allocation_id in book.holds
    clock.ms += 4_000
    await handlers.admit(_ask("other", tokens=10))
    assert reply.allocation_id in book.holds
    clock.ms += 2_000
    await handlers.admit(_ask("later", tokens=10))
    assert reply.allocation_id not in book.holds
    assert handlers.release_hold(reply.allocation_id or "", "acme") == no_allocation(reply.allocation_id or "")


async def test_after_a_restart_the_counts_come_back_from_the_engines_next_report() -> None:
    """A fresh process knows no admission; the engine's next report carries what it runs, and admission
    refuses what would take the replica past its pool."""
    tf = _replica("r-tf", "llama3.1-8b", "n1", kv_gb=10)
    handlers, ledger, _clock, book = _stack(tf)
    handlers.on_engine_status(_status(tf, queue_depth=0))
    for i in range(3):  # 3 x 7.9 GB would not fit 10 GB: one does
        await handlers.admit(_ask(f"before-{i}", model="llama3.1-8b", tokens=60_000))
    assert len(book.holds) == 1

    restarted, _ledger2, _clock2, book2 = _stack(tf)  # the same replica, an empty memory
    assert book2.holds == {} and book2.account("r-tf") is not None
    assert book2.account("r-tf").estimate_bytes == 0  # type: ignore[union-attr]
    restarted.on_engine_status(_status(tf, queue_depth=1, kv_used_bytes=8 * GB))  # what it still runs
    refused = await restarted.admit(_ask("after", model="llama3.1-8b", tokens=60_000))
    assert isinstance(refused, AdmitReply) and refused.status == "queued", refused
    small = await restarted.admit(_ask("small", model="llama3.1-8b", tokens=1000))
    assert isinstance(small, AdmitReply) and small.status == "admitted", small
    assert ledger.calls == [] and _ledger2.calls == []


async def test_unknown_model_and_a_context_too_long_for_every_replica() -> None:
    tf = _replica("r-tf", "llama3-8b", "n1")  # max_context 8192
    handlers, _ledger, _clock, _book = _stack(tf)
    handlers.on_engine_status(_status(tf))
    unknown = await handlers.admit(_ask("u", model="no-such-model"))
    assert isinstance(unknown, Rejected) and unknown.error.code is ErrorCode.UNKNOWN_MODEL
    too_long = await handlers.admit(_ask("t", model="llama3-8b", tokens=20_000))
    assert isinstance(too_long, Rejected) and too_long.error.code is ErrorCode.NO_CAPACITY
    assert "context" in too_long.error.message


async def test_a_flooding_tenant_does_not_starve_another_through_admit() -> None:
    """Two tenants, equal weights; acme asks 10x what beta asks, far more than the replica takes. Each tick
    the engine finishes two requests (its queue reports two below the maximum) and admission fills them
    from the fair queue. Max-min fair: beta asks 1 per tick of a capacity of 2, so its fair share is all of
    its own demand, half the admissions; it stays within 5% of that."""
    tf = _replica("r-tf", "llama3.1-8b", "n1", kv_gb=1000)
    handlers, _ledger, clock, book = _stack(tf, fairness=Fairness(rate_per_s=1.0, burst=1.0, ttl_s=3600))
    handlers.on_engine_status(_status(tf, queue_depth=16))  # full: everything queues
    asked = {"acme": 0, "beta": 0}
    for tick in range(200):
        clock.ms += 1000
        for n in range(10):
            asked["acme"] += 1
            await handlers.admit(_ask(f"a-{tick}-{n}", tenant="acme"))
        asked["beta"] += 1
        await handlers.admit(_ask(f"b-{tick}", tenant="beta"))
        before = len(book.holds)
        handlers.on_engine_status(_status(tf, queue_depth=14))  # two finished
        await handlers.drain()
        assert len(book.holds) - before == 2  # exactly the two free places: admitted ones count until reported
    admitted = {"acme": 0, "beta": 0}
    for hold in book.holds.values():
        admitted[hold.requester] += 1
    total = sum(admitted.values())
    fair_beta = min(asked["beta"], total / 2) / total
    assert total == 400
    assert admitted["beta"] / total == pytest.approx(fair_beta, abs=0.05), admitted


def test_a_placed_reply_becomes_a_replica_with_its_kv_pool() -> None:
    reply = PlaceReply(
        status="placed",
        request_id="p1",
        allocation_id="al-1",
        region="us-east-1",
        tp=2,
        model="llama3.1-8b",
        placements=[NodePlacement(node="n1", accelerators=["n1/gpu0", "n1/gpu1"])],
        hbm_per_accelerator=AcceleratorShare(
            weights_bytes=8 * GB, kv_bytes=20 * GB, activation_bytes=GB, workspace_bytes=GB, total_bytes=30 * GB
        ),
    )
    replica = replica_of("acme", reply, MODELS)
    assert replica is not None
    assert (replica.engine, replica.tp, replica.node, replica.region) == (Engine.TRANSFORMER, 2, "n1", "us-east-1")
    assert replica.kv_pool == {"n1/gpu0": 20 * GB, "n1/gpu1": 20 * GB}
    assert replica_of("acme", reply.model_copy(update={"model": None}), MODELS) is None


async def test_concurrent_admissions_are_counted_in_memory_without_a_call() -> None:
    """Admissions that arrive together are each answered on their own, every one counted, none asking
    another service."""
    replicas = [_replica(f"r-{i}", "llama3.1-8b", f"n{i}") for i in range(4)]
    handlers, ledger, _clock, book = _stack(*replicas)
    for replica in replicas:
        handlers.on_engine_status(_status(replica, queue_depth=0))
    replies = await asyncio.gather(*(handlers.admit(_ask(f"c-{i}", tenant=f"t{i}")) for i in range(40)))
    assert all(isinstance(r, AdmitReply) and r.status in ("admitted", "queued") for r in replies)
    assert ledger.calls == []
    admitted = [r for r in replies if isinstance(r, AdmitReply) and r.status == "admitted"]
    assert len(book.holds) == len(admitted) == len({r.allocation_id for r in admitted})


async def test_each_engine_keeps_its_guaranteed_kv_on_a_shared_node_and_lends_it_only_while_idle() -> None:
    """A transformer (60 GB of KV) and an MoE replica (20 GB) on one node: a pool of 80 GB, 40 GB guaranteed
    to each engine. The transformer borrows the idle MoE's share; once the MoE holds a request, it lends no
    more, and the transformer's next request waits although its own replica still has room."""
    tf = _replica("r-tf", "llama3.1-8b", "n1", kv_gb=60)
    moe = dataclasses.replace(_replica("r-moe", "mixtral-8x7b", "n1", kv_gb=20), kv_pool={"n1/gpu1": 20 * GB})
    handlers, _ledger, _clock, book = _stack(tf, moe)
    handlers.on_engine_status(_status(tf, queue_depth=0))
    handlers.on_engine_status(_status(moe, queue_depth=0))

    # Each transformer request holds (60,000 + 256) tokens x 128 KiB = 7.9 GB of KV.
    for i in range(6):  # 5 fit its own 40 GB; the 6th borrows from the idle MoE
        reply = await handlers.admit(_ask(f"tf-{i}", model="llama3.1-8b", tokens=60_000))
        assert isinstance(reply, AdmitReply) and reply.status == "admitted", (i, reply)
    assert book._pools["n1"].borrowed(Engine.TRANSFORMER) > 0
    handlers.on_engine_status(_status(tf, queue_depth=0))

    moe_reply = await handlers.admit(_ask("moe-1", model="mixtral-8x7b", tokens=1000))
    assert isinstance(moe_reply, AdmitReply) and moe_reply.status == "admitted"

    waiting = await handlers.admit(_ask("tf-6", model="llama3.1-8b", tokens=60_000))
    assert isinstance(waiting, AdmitReply) and waiting.status == "queued", waiting
    assert book.status(tf).kv_total_bytes - book.status(tf).held_bytes > 7.9 * GB  # its replica had room


async def test_names_the_book_does_not_know_do_not_grow_it() -> None:
    """A gateway's `failed_replica_id` or an agent's report for a replica placement never made is ignored:
    callers cannot grow admission's memory with made-up ids."""
    tf = _replica("r-tf", "llama3.1-8b", "n1")
    handlers, _ledger, _clock, book = _stack(tf)
    handlers.on_engine_status(_status(tf))
    for i in range(100):
        await handlers.admit(_ask(f"x-{i}", failed_replica_id=f"made-up-{i}"))
        handlers.on_engine_status(_status(dataclasses.replace(tf, replica_id=f"ghost-{i}")))
    assert set(book._failed) == set() and set(book._reports) == {"r-tf"}


# -- issue 23 ----------------------------------------------------------------------------------------


async def test_failed_replica_id_counts_only_from_a_tenant_holding_an_admission_on_it() -> None:
    """Row 2: globex naming acme's replica as failed is ignored (and told so); acme, who holds an
    admission on it, is heard; once acme's hold ends, acme is ignored too."""
    moe, tf = _replica("r-moe", "mixtral-8x7b", "n1", kv_gb=60), _replica("r-tf", "llama3.1-8b", "n2")
    handlers, _ledger, _clock, book = _stack(moe, tf)
    handlers.on_engine_status(_status(moe, latency_p50_ms=30.0, queue_depth=0))
    handlers.on_engine_status(_status(tf, latency_p50_ms=80.0, queue_depth=0))
    mine = await handlers.admit(_ask("a-1", tenant="acme"))
    assert isinstance(mine, AdmitReply) and mine.replica_id == "r-moe" and mine.failed_replica_ignored is None

    probe = await handlers.admit(_ask("g-1", tenant="globex", failed_replica_id="r-moe"))
    assert isinstance(probe, AdmitReply) and probe.failed_replica_ignored is True
    assert probe.replica_id == "r-moe"  # still in rotation: globex's word did not take it out
    assert "failed_replica_id ignored" in (probe.explanation or "")
    after = await handlers.admit(_ask("a-2", tenant="acme"))
    assert isinstance(after, AdmitReply) and after.replica_id == "r-moe"

    heard = await handlers.admit(_ask("a-1b", tenant="acme", failed_replica_id="r-moe"))
    assert isinstance(heard, AdmitReply) and heard.failed_replica_ignored is False
    assert heard.replica_id == "r-tf"  # acme holds admissions on r-moe: out of rotation, failed over

    handlers.on_engine_status(_status(moe, latency_p50_ms=30.0, queue_depth=0))  # back in rotation
    for reply, tenant in ((mine, "acme"), (probe, "globex"), (after, "acme")):
        assert reply.allocation_id is not None
        assert isinstance(handlers.release_hold(reply.allocation_id, tenant), ReleaseReply)
    assert not book.holds_on("r-moe", "acme")
    late = await handlers.admit(_ask("a-3", tenant="acme", model="llama3.1-8b", failed_replica_id="r-moe"))
    assert isinstance(late, AdmitReply) and late.failed_replica_ignored is True
    assert book.status(moe).healthy


async def test_an_ignored_failed_replica_id_is_said_in_a_no_capacity_rejection_too() -> None:
    tf = _replica("r-tf", "llama3.1-8b", "n1")
    handlers, _ledger, _clock, _book = _stack(tf)  # never reported: nothing can serve
    reply = await handlers.admit(_ask("g-1", tenant="globex", model="llama3.1-8b", failed_replica_id="r-tf"))
    assert isinstance(reply, Rejected) and reply.error.code is ErrorCode.NO_CAPACITY
    assert reply.error.details == {"failed_replica_ignored": True}
    assert "failed_replica_id ignored" in reply.error.message


def test_an_engine_report_counts_only_from_the_replicas_own_node_compared_exactly() -> None:
    """Row 3: the agent of `dgx-h100-0` cannot speak for a replica on `dgx-h100-02` (a prefix of its
    name), nor the agent of `dgx-h100-021` (its name is a prefix of theirs)."""
    tf = _replica("r-tf", "llama3.1-8b", "dgx-h100-02")
    book = ReplicaBook(models=MODELS)
    book.add(tf)
    assert book.report(_status(tf), now_ms=0)
    for node in ("dgx-h100-0", "dgx-h100-", "dgx-h100-021", "DGX-H100-02", ""):
        forged = _status(tf, healthy=False, queue_depth=999)
        assert not book.report(forged.model_copy(update={"node": node}), now_ms=1), node
    assert book.status(tf).healthy and book.status(tf).queue_depth == 1


def test_the_book_gives_each_fresh_engines_kv_use_and_sums_preemptions_per_model() -> None:
    tf = _replica("r-tf", "llama3.1-8b", "dgx-h100-02")
    other = _replica("r-2", "llama3.1-8b", "dgx-h100-03")
    book = ReplicaBook(models=MODELS)
    book.add(tf)
    book.add(other)
    assert book.report(_status(tf, kv_usage=0.97, preemptions=3), now_ms=0)
    # No kv_usage from this engine: its used over total bytes.
    assert book.report(_status(other, kv_used_bytes=other.kv_total // 4, preemptions=2), now_ms=1_000)
    fresh = book.kv_usage(now_ms=1_000, stale_ms=15_000)
    assert fresh.keys() == {"r-tf", "r-2"}
    assert fresh["r-tf"] == ("llama3.1-8b", 0.97)
    assert fresh["r-2"][0] == "llama3.1-8b" and fresh["r-2"][1] == pytest.approx(0.25, abs=1e-6)
    assert book.kv_usage(now_ms=15_500, stale_ms=15_000).keys() == {"r-2"}  # r-tf's report went stale
    assert book.preempted == {"llama3.1-8b": 5}


# -- the book's estimate against a fake engine, and the queue's wake-up ---------------------------------

POOL = 1000  # the replica's KV bytes, as its engine reports them (no scaling)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(  # report intervals
        st.tuples(
            st.integers(0, 1200),  # the engine's own use (more than the pool: the report says full)
            st.integers(0, 8),  # its own queue
            st.lists(st.tuples(st.integers(1, 400), st.booleans()), max_size=10),  # arrivals: size, picked up late
            st.lists(st.integers(0, 50), max_size=6),  # releases
        ),
        min_size=1,
        max_size=15,
    )
)
def test_the_books_estimate_lets_no_grant_past_the_pool_beyond_what_the_last_report_missed(
    intervals: list[tuple[int, int, list[tuple[int, bool]], list[int]]],
) -> None:
    """The account's property (tests/unit/domain/admission/test_account.py) through the book, as admission
    uses it: engine reports as events, grants as holds, releases as ended holds. Each grant is decided on the
    last report plus the grants since it, the replica's status shows those grants (held bytes, queue), and
    a grant never takes what the engine holds past its pool by more than what the last report missed."""
    replica = dataclasses.replace(_replica("r-1", "llama3.1-8b", "n1"), kv_pool={"n1/gpu0": POOL})
    book = ReplicaBook(models=MODELS)
    book.add(replica)
    live: dict[str, int] = {}
    late: set[str] = set()
    serial = 0
    for step, (own, queue, arrivals, releases) in enumerate(intervals):
        held = own + sum(n for a, n in live.items() if a not in late)
        status = _status(replica, queue_depth=queue, kv_used_bytes=min(held, POOL), kv_total_bytes=POOL)
        assert book.report(status, now_ms=step * 1000)
        reported = min(held, POOL)
        missed, late = {a for a in late if a in live}, set()
        since: set[str] = set()
        for nbytes, picked_late in arrivals:
            serial += 1
            hold = Hold(f"adm-{serial}", replica.replica_id, "acme", f"q{serial}", nbytes, granted_at_ms=step * 1000)
            expected = reported + sum(live[a] for a in since) + nbytes <= POOL
            assert book.admit(replica, hold) == expected
            if expected:
                live[hold.allocation_id] = nbytes
                since.add(hold.allocation_id)
                if picked_late:
                    late.add(hold.allocation_id)
                assert own + sum(live.values()) <= POOL + sum(live[a] for a in missed if a in live)
            seen = book.status(replica)
            assert (seen.kv_used_bytes, seen.held_bytes) == (reported, sum(live[a] for a in since))
            assert seen.queue_depth == queue + len(since)
        for index in releases:
            if live:
                allocation_id = sorted(live)[index % len(live)]
                del live[allocation_id]
                since.discard(allocation_id)
                assert book.ended(allocation_id) is not None and book.ended(allocation_id) is None
        assert book.status(replica).held_bytes == sum(live[a] for a in since)


async def test_a_release_lets_a_waiting_request_in_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing fits: the request waits in the queue. A release wakes the queue's loop, which admits it
    without waiting for its periodic pass (made an hour long here)."""
    monkeypatch.setattr("services.placement.admission.DRAIN_PERIOD_S", 3600.0)
    tf = _replica("r-tf", "llama3.1-8b", "n1", kv_gb=10)
    handlers, _ledger, _clock, book = _stack(tf)
    handlers.on_engine_status(_status(tf, queue_depth=0))
    loop = asyncio.create_task(handlers.serve_queue())
    try:
        first = await handlers.admit(_ask("big-1", model="llama3.1-8b", tokens=60_000))  # 7.9 GB of 10
        waiting = await handlers.admit(_ask("big-2", model="llama3.1-8b", tokens=60_000))
        assert isinstance(first, AdmitReply) and first.status == "admitted" and first.allocation_id
        assert isinstance(waiting, AdmitReply) and waiting.status == "queued"
        await asyncio.sleep(0.05)
        assert handlers.queue_depths() == {"acme": 1}  # still waiting: only a release (or a report) wakes it
        assert isinstance(handlers.release_hold(first.allocation_id, "acme"), ReleaseReply)
        for _ in range(100):
            if not handlers.queue_depths():
                break
            await asyncio.sleep(0.01)
        assert handlers.queue_depths() == {} and [h.request_id for h in book.holds.values()] == ["big-2"]
    finally:
        loop.cancel()


# -- tenancy: a tenant's requests land only on its own replicas (and the shared owners') ----------------


async def test_under_own_a_tenants_request_never_lands_on_another_tenants_only_replica() -> None:
    """globex's replica is the only one serving the model: acme is told `no_capacity` exactly as if there
    were none, with nothing of globex's replica in the answer; globex itself is admitted on it."""
    theirs = _replica("r-globex", "llama3.1-8b", "n1", owner="globex")
    handlers, _ledger, _clock, book = _stack(theirs, tenancy=Tenancy())
    handlers.on_engine_status(_status(theirs, queue_depth=0))

    refused = await handlers.admit(_ask("a-1", tenant="acme", model="llama3.1-8b"))
    empty, _l, _c, _b = _stack(tenancy=Tenancy())
    nothing = await empty.admit(_ask("a-1", tenant="acme", model="llama3.1-8b"))
    assert isinstance(refused, Rejected) and refused.error.code is ErrorCode.NO_CAPACITY
    assert refused == nothing  # the same code, message and details as with no replica at all
    assert "r-globex" not in refused.model_dump_json()
    assert handlers.queue_depths() == {} and book.holds == {}

    own = await handlers.admit(_ask("g-1", tenant="globex", model="llama3.1-8b"))
    assert isinstance(own, AdmitReply) and own.status == "admitted" and own.replica_id == "r-globex"


async def test_under_own_another_tenants_less_loaded_replica_is_neither_chosen_nor_named() -> None:
    """globex's replica is idle and fast, acme's own is busier: acme's request goes to its own, and neither
    the explanation nor the failover names globex's; a busy own replica queues rather than spilling over."""
    mine = _replica("r-acme", "llama3.1-8b", "n1", owner="acme")
    theirs = _replica("r-globex", "llama3.1-8b", "n2", owner="globex")
    handlers, _ledger, _clock, _book = _stack(mine, theirs, tenancy=Tenancy())
    handlers.on_engine_status(_status(mine, latency_p50_ms=150.0, queue_depth=5))
    handlers.on_engine_status(_status(theirs, latency_p50_ms=20.0, queue_depth=0))

    reply = await handlers.admit(_ask("a-1", tenant="acme", model="llama3.1-8b"))
    assert isinstance(reply, AdmitReply) and reply.status == "admitted" and reply.replica_id == "r-acme"
    assert reply.failover == []
    assert "r-globex" not in reply.model_dump_json()

    handlers.on_engine_status(_status(mine, queue_depth=16))  # acme's replica is full: acme waits for it
    waits = await handlers.admit(_ask("a-2", tenant="acme", model="llama3.1-8b"))
    assert isinstance(waits, AdmitReply) and waits.status == "queued"
    assert "r-globex" not in waits.model_dump_json()
    handlers.on_engine_status(_status(mine, healthy=False))  # nothing of its own can serve: no_capacity
    gone = await handlers.admit(_ask("a-3", tenant="acme", model="llama3.1-8b"))
    assert isinstance(gone, Rejected) and gone.error.code is ErrorCode.NO_CAPACITY
    assert "r-acme" in gone.error.message and "r-globex" not in gone.model_dump_json()


async def test_a_shared_owners_replica_serves_every_tenant_beside_its_own() -> None:
    shared = _replica("r-pool", "llama3.1-8b", "n1", owner="platform")
    theirs = _replica("r-globex", "llama3.1-8b", "n2", owner="globex")
    handlers, _ledger, _clock, _book = _stack(shared, theirs, tenancy=Tenancy.of("own", ["platform"]))
    handlers.on_engine_status(_status(shared, latency_p50_ms=150.0, queue_depth=5))
    handlers.on_engine_status(_status(theirs, latency_p50_ms=20.0, queue_depth=0))

    acme = await handlers.admit(_ask("a-1", tenant="acme", model="llama3.1-8b"))
    assert isinstance(acme, AdmitReply) and acme.replica_id == "r-pool" and acme.failover == []
    globex = await handlers.admit(_ask("g-1", tenant="globex", model="llama3.1-8b"))
    assert isinstance(globex, AdmitReply) and globex.replica_id == "r-globex" and globex.failover == ["r-pool"]
    handlers.on_engine_status(_status(theirs, healthy=False))
    spill = await handlers.admit(_ask("g-2", tenant="globex", model="llama3.1-8b"))
    assert isinstance(spill, AdmitReply) and spill.replica_id == "r-pool"


async def test_any_lets_every_tenant_use_every_replica_as_before() -> None:
    mine = _replica("r-acme", "llama3.1-8b", "n1", owner="acme")
    theirs = _replica("r-globex", "llama3.1-8b", "n2", owner="globex")
    handlers, _ledger, _clock, _book = _stack(mine, theirs, tenancy=Tenancy.of("any"))
    handlers.on_engine_status(_status(mine, latency_p50_ms=150.0, queue_depth=5))
    handlers.on_engine_status(_status(theirs, latency_p50_ms=20.0, queue_depth=0))

    reply = await handlers.admit(_ask("a-1", tenant="acme", model="llama3.1-8b"))
    assert isinstance(reply, AdmitReply) and reply.replica_id == "r-globex" and reply.failover == ["r-acme"]
    other = await handlers.admit(_ask("z-1", tenant="zeta", model="llama3.1-8b"))  # placed nothing at all
    assert isinstance(other, AdmitReply) and other.status == "admitted"


async def test_naming_another_tenants_replica_as_failed_is_ignored_and_tells_nothing_of_it() -> None:
    mine = _replica("r-acme", "llama3.1-8b", "n1", owner="acme")
    theirs = _replica("r-globex", "llama3.1-8b", "n2", owner="globex")
    handlers, _ledger, _clock, book = _stack(mine, theirs, tenancy=Tenancy())
    handlers.on_engine_status(_status(mine, queue_depth=0))
    handlers.on_engine_status(_status(theirs, queue_depth=0))
    held = await handlers.admit(_ask("g-1", tenant="globex", model="llama3.1-8b"))
    assert isinstance(held, AdmitReply) and held.replica_id == "r-globex"

    probe = await handlers.admit(_ask("a-1", tenant="acme", model="llama3.1-8b", failed_replica_id="r-globex"))
    unknown = await handlers.admit(_ask("a-2", tenant="acme", model="llama3.1-8b", failed_replica_id="r-nope"))
    for reply in (probe, unknown):  # the same answer for another tenant's replica as for one that does not exist
        assert isinstance(reply, AdmitReply) and reply.replica_id == "r-acme"
        assert reply.failed_replica_ignored is True and reply.failover == []
        assert "r-globex" not in (reply.explanation or "")
    assert book.status(theirs).healthy  # still in globex's rotation


async def test_the_admitted_reply_carries_the_replicas_sku() -> None:
    gpu = _replica("r-h100", "llama3.1-8b", "n1", sku="H100-SXM-80GB")
    handlers, _ledger, _clock, _book = _stack(gpu)
    handlers.on_engine_status(_status(gpu))
    reply = await handlers.admit(_ask("s-1", model="llama3.1-8b"))
    assert isinstance(reply, AdmitReply) and reply.status == "admitted" and reply.sku == "H100-SXM-80GB"


def test_a_placed_reply_gives_its_replica_the_sku_and_owner() -> None:
    placed = PlaceReply(
        status="placed",
        request_id="p1",
        allocation_id="al-1",
        model="llama3.1-8b",
        sku="H100-SXM-80GB",
        region="us-west-1",
        tp=1,
        placements=[NodePlacement(node="n1", accelerators=["n1/gpu0"])],
        hbm_per_accelerator=AcceleratorShare(
            weights_bytes=16 * GB, kv_bytes=40 * GB, activation_bytes=GB, workspace_bytes=GB, total_bytes=58 * GB
        ),
    )
    replica = replica_of("acme", placed, MODELS)
    assert replica is not None and (replica.owner, replica.sku) == ("acme", "H100-SXM-80GB")
    bare = replica_of("acme", placed.model_copy(update={"sku": None}), MODELS)
    assert bare is not None and bare.sku is None
