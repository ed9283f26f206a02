"""Invariants under random operation sequences (hypothesis): the pool never over-commits and keeps
guarantees, the fair queue's positions are the order it serves (and serving on arrival charges what
queueing would), selection accounts for every replica."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.domain.admission import (
    Engine,
    FairQueue,
    Grant,
    KvPool,
    ReplicaStatus,
    failover_order,
    select,
)
from tests.unit.domain.admission.builders import NOW_MS, ask, models, replica

ENGINES = list(Engine)


@settings(max_examples=200, deadline=None)
@given(
    present=st.sets(st.sampled_from(ENGINES), min_size=1),
    ops=st.lists(st.tuples(st.sampled_from(ENGINES), st.integers(0, 60), st.booleans()), max_size=60),
)
def test_the_pool_never_over_commits_and_keeps_guarantees(
    present: set[Engine], ops: list[tuple[Engine, int, bool]]
) -> None:
    pool = KvPool.split(100, sorted(present))
    held: list[Grant] = []
    for engine, nbytes, release in ops:
        if release and held:
            pool.release(held.pop(nbytes % len(held)))
        else:
            own = pool.used(engine) - pool.borrowed(engine)
            sure = pool.lent(engine) == 0 and own + nbytes <= pool.guarantees.get(engine, 0)
            grant = pool.grant(engine, nbytes)
            if sure:
                assert grant is not None, "an engine with nothing lent gets what its guarantee still covers"
            if grant is not None:
                assert grant.nbytes == nbytes and all(d is not engine for d in grant.borrowed)
                held.append(grant)
        assert pool.free() >= 0
        assert sum(pool.used(e) for e in ENGINES) + pool.free() == 100
        assert sum(pool.borrowed(e) for e in ENGINES) == sum(pool.lent(e) for e in ENGINES)
        for e in ENGINES:
            assert 0 <= pool.lent(e) <= pool.guarantees.get(e, 0)
    for grant in held:
        pool.release(grant)
    assert pool.free() == 100


@settings(max_examples=200, deadline=None)
@given(
    offers=st.lists(
        st.tuples(st.sampled_from("abc"), st.sampled_from([0.5, 1.0, 2.0, 3.0]), st.booleans()), max_size=40
    ),
    weights=st.fixed_dictionaries({"a": st.sampled_from([1.0, 2.0]), "b": st.sampled_from([0.5, 1.0])}),
    burst=st.sampled_from([0.0, 1.0, 2.0, 5.0]),
)
def test_positions_are_the_order_successive_pops_serve(
    offers: list[tuple[str, float, bool]], weights: dict[str, float], burst: float
) -> None:
    queue: FairQueue[int] = FairQueue(rate_per_s=0, burst=burst, ttl_ms=1e9, weights=weights)
    for i, (tenant, cost, pop_first) in enumerate(offers):
        if pop_first:
            queue.pop(0)
        queue.offer(f"k{i}", i, tenant=tenant, now_ms=0, cost=cost)
    expected = sorted(queue, key=lambda k: queue.position(k) or 0)
    assert sorted(queue.position(k) or 0 for k in queue) == list(range(1, len(queue) + 1))
    served = []
    while (popped := queue.pop(0)) is not None:
        served.append(popped[0])
    assert served == expected


def _charged(queue: FairQueue[int]) -> tuple[object, ...]:
    """What a fair queue has charged its tenants: its virtual time, finish tags, buckets, arrival count."""
    buckets = {t: (b.tokens, b.updated_ms) for t, b in queue._buckets.items()}
    return (queue._virtual_time, queue._last_finish, buckets, queue._seq, queue._now_ms, queue._floor)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["arrive", "arrive", "arrive", "offer", "pop", "remove", "expire"]),
            st.sampled_from("abc"),
            st.sampled_from([0.5, 1.0, 2.0]),
            st.sampled_from([0.0, 0.0, 1.0, 5.0, 40.0]),  # ms before the operation
        ),
        max_size=60,
    ),
    weights=st.fixed_dictionaries({"a": st.sampled_from([1.0, 2.0]), "b": st.sampled_from([0.5, 1.0])}),
    rate_per_s=st.sampled_from([0.0, 50.0, 200.0]),
    burst=st.sampled_from([0.0, 1.0, 2.0, 5.0]),
)
def test_serving_on_arrival_charges_what_offer_then_pop_charges(
    ops: list[tuple[str, str, float, float]], weights: dict[str, float], rate_per_s: float, burst: float
) -> None:
    """Admission serves a request at once when nothing waits (``serve_now``): the same tenants' shares and
    buckets as offering it and popping it at once, so the order every later request is served in is the
    same. Two queues take the same operations, one arriving by ``offer`` + ``pop``, one by ``serve_now``."""
    queued: FairQueue[int] = FairQueue(rate_per_s=rate_per_s, burst=burst, ttl_ms=100, weights=weights)
    served: FairQueue[int] = FairQueue(rate_per_s=rate_per_s, burst=burst, ttl_ms=100, weights=weights)
    now = 0.0
    for i, (op, tenant, cost, wait_ms) in enumerate(ops):
        now += wait_ms
        key = f"k{i}"
        if op == "arrive":
            at_once = served.serve_now(tenant, now, cost)
            assert at_once == (len(queued) == 0)
            queued.offer(key, i, tenant=tenant, now_ms=now, cost=cost)
            if at_once:
                assert queued.pop(now) == (key, i)
            else:
                served.offer(key, i, tenant=tenant, now_ms=now, cost=cost)
        elif op == "offer":
            assert queued.offer(key, i, tenant=tenant, now_ms=now, cost=cost) == served.offer(
                key, i, tenant=tenant, now_ms=now, cost=cost
            )
        elif op == "pop":
            assert queued.pop(now) == served.pop(now)
        elif op == "remove" and len(queued):
            first = next(iter(queued))
            assert queued.remove(first) == served.remove(first)
        elif op == "expire":
            assert queued.expire(now) == served.expire(now)
        assert _charged(queued) == _charged(served)
        assert [queued.position(k) for k in queued] == [served.position(k) for k in served]
    order = []
    while (popped := queued.pop(now)) is not None:
        order.append(popped)
    assert order == [served.pop(now) for _ in order] and len(served) == 0


replicas = st.builds(
    lambda rid, engine, p50, queue, used, age, healthy: replica(
        rid, engine, p50_ms=p50, queue=queue, kv_used_gib=used, age_ms=age, healthy=healthy
    ),
    rid=st.text("abcdefgh", min_size=1, max_size=3),
    engine=st.sampled_from(ENGINES),
    p50=st.floats(1, 500),
    queue=st.integers(0, 20),
    used=st.floats(0, 40),
    age=st.one_of(st.none(), st.floats(0, 30_000)),
    healthy=st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(
    fleet=st.lists(replicas, max_size=8, unique_by=lambda r: r.replica_id),
    input_tokens=st.integers(0, 100_000),
    ttft=st.one_of(st.none(), st.floats(10, 500)),
    hint=st.sampled_from(["auto", "transformer", "ssm", "moe"]),
)
def test_selection_accounts_for_every_replica(
    fleet: list[ReplicaStatus], input_tokens: int, ttft: float | None, hint: str
) -> None:
    selection = select(ask(input_tokens, 100, ttft, hint), fleet, models(), now_ms=NOW_MS)
    chosen = [c.replica.replica_id for c in selection.order]
    assert sorted(chosen + list(selection.excluded)) == sorted(r.replica_id for r in fleet)
    assert tuple(selection.order[1:]) == failover_order(selection.order[1:])
    for c in selection.order:
        r = c.replica
        assert r.healthy and r.queue_depth < 16 and r.kv_used_bytes + r.held_bytes + c.need_bytes <= r.kv_total_bytes
    if selection.order and selection.rule != "least_cost" and any(c.preferred for c in selection.order):
        assert selection.order[0].preferred  # a preferred candidate goes first whenever there is one
