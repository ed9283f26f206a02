"""Invariants over random fleets and request streams (hypothesis):

* HBM is never over-committed after applying decisions, and rack power never crosses a budget;
* every pair of every TP group is NVLinked (one node's links or one multi-node fabric domain);
* TPU slices are legal, inside their pod, contiguous and disjoint;
* a rejected request changes nothing, a queued one (``queueable``) reserves nothing either;
* an exclusive TP group never shares a GPU with another replica; a shared replica joins only idle
  GPUs or GPUs held by shared replicas; pipeline stages are NVLink cliques, disjoint, and all of them
  are reserved by one ``apply`` (all or nothing); a cross-domain group stays within its cluster's budget;
* judging hosts per class decides exactly what judging them one by one decides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shared.domain.placement import Decision, FleetSnapshot, PlacementRequest, apply, decide
from shared.domain.placement.framework import DEFAULT_PROFILE
from shared.domain.placement.hosts import index_of
from shared.domain.topology.tpu import TpuSlice, is_legal_shape
from tests.unit.placement.builders import NodeBuilder, node, request, skus, snapshot, tpu_pod
from tests.unit.placement.test_decide import assert_nvlinked

UNGROUPED = dataclasses.replace(DEFAULT_PROFILE, name="per-host", group_classes=False)

KINDS: list[Callable[[NodeBuilder], NodeBuilder]] = [
    lambda b: b.nvswitch(8),
    lambda b: b.sku("H200-SXM-141GB").nvswitch(4),
    lambda b: b.four_plus_four(),
    lambda b: b.sku("A100-PCIE-80GB").pairs(4),
    lambda b: b.sku("L40S-48GB").pcie(4),
    lambda b: b.sku("V100-SXM2-32GB").cube_mesh(),
]
MODELS = ["llama3-8b", "mistral-7b-v0.1", "gemma2-9b", "llama3-70b", "mixtral-8x7b", "mamba2-2.7b", "llama3-405b"]


@st.composite
def fleets(draw: st.DrawFn) -> FleetSnapshot:
    builders: list[NodeBuilder] = []
    for i in range(draw(st.integers(0, 3))):
        builder = draw(st.sampled_from(KINDS))(node(f"n{i}")).rack(draw(st.sampled_from(["r1", "r2"])))
        for gpu in draw(st.lists(st.integers(0, 3), max_size=2, unique=True)):
            # Up to 90% of the HBM: below the 92% usable ceiling, so the start state is consistent.
            builder.reserve(gpu, skus()[builder.sku_name].hbm_bytes * draw(st.integers(1, 90)) // 100)
        if draw(st.booleans()) and draw(st.booleans()):
            builder.unavailable(draw(st.integers(0, 3)))
        builders.append(builder)
    # Sometimes a multi-node NVLink domain of 2-4 one-GPU GH200 nodes.
    for i in range(draw(st.sampled_from([0, 0, 2, 4]))):
        builders.append(node(f"gh{i}").sku("GH200-96GB").nvswitch(1).fabric("f00d").rack("r3"))
    pods = []
    if draw(st.booleans()):
        pods.append(tpu_pod("e", "v5e", draw(st.sampled_from([(4, 4), (8, 8)]))))
    if draw(st.booleans()):
        pods.append(tpu_pod("p", "v5p", (4, 4, 4)))
    if not builders and not pods:
        builders.append(node("only").nvswitch(8))
    power = draw(st.sampled_from([None, 2.0, 6.0, 40.0]))
    snap = snapshot(*builders, pods=pods, power_kw=power)
    # Sometimes a node's PCIe is busy (no cold loads there), sometimes a cluster's cross-domain budget is used.
    busy = {b.name: draw(st.sampled_from([0.0, 0.3, 0.8])) for b in builders}
    used = {"us-west-1/c1": draw(st.sampled_from([0.0, 0.0, 250e9]))}
    return snap.evolve(pcie_util={n: u for n, u in busy.items() if u}, cross_domain_used=used)


@st.composite
def one_request(draw: st.DrawFn, i: int) -> PlacementRequest:
    sharing = draw(st.sampled_from(["exclusive", "exclusive", "shared"]))
    return request(
        draw(st.sampled_from(MODELS)),
        request_id=f"r{i}",
        context_tokens=draw(st.sampled_from([256, 2048, 8192])),
        concurrency=draw(st.integers(1, 32)),
        dtype=draw(st.sampled_from([None, None, "fp8", "int4"])),
        tp=draw(st.sampled_from([None, 1] if sharing == "shared" else [None, None, 1, 2, 4, 8])),
        backend=draw(st.sampled_from(["any", "gpu"] if sharing == "shared" else ["any", "any", "gpu", "tpu"])),
        sharing=sharing,
        fallbacks=draw(st.sampled_from([(), None, ("pipeline",), ("cross_domain", "queue")])),
    )


@st.composite
def streams(draw: st.DrawFn) -> list[PlacementRequest]:
    return [draw(one_request(i)) for i in range(draw(st.integers(1, 8)))]


def _check_step(
    before: FleetSnapshot, decision: Decision, after: FleetSnapshot, slices: dict[str, list[TpuSlice]]
) -> None:
    if not decision.placed:
        assert after is before and after == before  # rejected or queued: nothing reserved
        return
    assert decision.tp is not None
    assert decision.tp * decision.pp == len(decision.accelerators) == len(set(decision.accelerators))
    for acc in decision.accelerators if decision.tpu is None else ():  # exclusivity, from the state before
        held = before.capacity[acc]
        if decision.sharing == "exclusive":
            assert held.idle, (acc, "an exclusive group took a GPU another replica holds")
        else:
            assert held.idle or held.shared, (acc, "a shared replica joined an exclusively held GPU")
        assert before.pcie_util.get(held.node, 0.0) <= 0.7, (acc, "a cold load on a node over 0.7 PCIe")
    for cap in after.capacity.values():
        assert 0 <= cap.reserved <= cap.usable, cap
    for rack, used in after.rack_power_used_w.items():
        budget = after.racks[rack].power_kw
        if budget is not None and used != before.rack_power_used_w.get(rack, 0.0):
            assert used <= budget * 1000, (rack, used, budget)
    if decision.tpu is None:
        if decision.pp > 1:
            assert len(decision.stages) == decision.pp
            assert tuple(a for stage in decision.stages for a in stage) == decision.accelerators
            for stage in decision.stages:
                assert_nvlinked(before, dataclasses.replace(decision, accelerators=stage))
        elif decision.fallback == "cross_domain":
            cluster = f"{decision.region}/{decision.cluster}"
            assert decision.cross_domain_bytes_per_s > 0
            assert after.cross_domain_used[cluster] <= 256e9
        else:
            assert_nvlinked(before, decision)
        assert decision.share is not None
        for acc in decision.accelerators:
            assert after.capacity[acc].reserved == before.capacity[acc].reserved + decision.share.total
        return
    pod = before.tpu_pods[decision.tpu.pod]
    block = decision.tpu.slice
    assert is_legal_shape(pod.grid.tpu_type, block.shape)
    assert pod.grid.fits(block) and pod.grid.is_free(block)  # inside the pod, every chip free before
    assert all(not block.overlaps(other) for other in slices.setdefault(pod.pod.name, []))
    assert len(decision.accelerators) == block.chips  # a whole axis-aligned block: contiguous
    assert decision.share is not None and decision.share.total <= pod.usable_per_chip
    slices[pod.pod.name].append(block)
    assert after.tpu_pods[pod.pod.name].grid.used_chips == pod.grid.used_chips + block.chips


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets(), streams())
def test_decisions_keep_every_invariant(snap: FleetSnapshot, requests: list[PlacementRequest]) -> None:
    slices: dict[str, list[TpuSlice]] = {}
    for req in requests:
        decision = decide(snap, req)
        event("tpu" if decision.tpu else "gpu" if decision.placed else str(decision.error_code))
        after = apply(snap, decision)
        _check_step(snap, decision, after, slices)
        snap = after


def _essentials(decision: Decision) -> tuple[object, ...]:
    # Everything but the runner-up line of the explanation, which names a class representative.
    return (decision.status, decision.error_code, decision.accelerators, decision.tp, decision.tpu,
            dict(decision.score), decision.rejections)  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets(), streams())
def test_judging_classes_equals_judging_every_host(snap: FleetSnapshot, requests: list[PlacementRequest]) -> None:
    for req in requests:
        grouped = decide(snap, req)
        assert _essentials(grouped) == _essentials(decide(snap, req, UNGROUPED))
        snap = apply(snap, grouped)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets(), streams())
def test_the_index_after_apply_equals_a_fresh_one(snap: FleetSnapshot, requests: list[PlacementRequest]) -> None:
    index_of(snap)
    for req in requests:
        snap = apply(snap, decide(snap, req))
        incremental = index_of(snap)
        fresh = index_of(FleetSnapshot(**{f: getattr(snap, f) for f in _FIELDS}))
        assert incremental.loads == fresh.loads
        assert incremental.classes == fresh.classes
        assert incremental.exclusive == fresh.exclusive


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets(), streams())
def test_decisions_on_an_updated_index_with_kept_screens_equal_fresh_ones(
    snap: FleetSnapshot, requests: list[PlacementRequest]
) -> None:
    # The index carries capacity screens from one snapshot to the next (``SnapshotIndex.screens``) and
    # groups hosts as exclusive groups see them: a decision must not tell either apart from a fresh index.
    for req in [*requests, *requests]:  # the second round asks the same shapes again: screens are reused
        kept = decide(snap, req)
        fresh = decide(FleetSnapshot(**{f: getattr(snap, f) for f in _FIELDS}), req)
        assert kept == fresh
        snap = apply(snap, kept)


_FIELDS = (
    "nodes",
    "capacity",
    "racks",
    "rack_power_used_w",
    "tpu_pods",
    "skus",
    "models",
    "pcie_util",
    "cross_domain_used",
)
