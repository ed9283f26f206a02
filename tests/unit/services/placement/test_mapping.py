"""Placement's contract <-> domain mapping: the view seeded from `fleet.get` / `ledger.snapshot` and fed
the TOPOLOGY and LEDGER events as their contract payloads."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from services.placement.mapping import crossing, may_queue, to_commit, to_reply
from shared.contracts.fleet import FleetGetReply, NodeView, RackView, TpuPodView
from shared.contracts.ledger import (
    AcceleratorBalance,
    AcceleratorLedgerView,
    AllocationEvent,
    CapacityChangedEvent,
    CrossDomainAllocation,
    LedgerEventName,
    ShareOut,
    SnapshotReply,
)
from shared.contracts.placement import PlaceRequest
from shared.contracts.topology import (
    GpuSample,
    GpuTelemetryEvent,
    NodeProfileEvent,
    NodeStateEvent,
    TelemetryEventName,
    TopologyEventName,
    TpuPodEvent,
)
from shared.domain.errors import ErrorCode
from shared.domain.fleet import AcceleratorId
from shared.domain.memory import MemoryShare, usable_hbm
from shared.domain.placement.types import Decision, TpuPlacement
from shared.infra.fleet_view import apply_event, to_domain, view_from
from shared.infra.profiles import profile_to_payload
from tests.unit.placement.builders import models, node, skus, snapshot, tpu_pod

USABLE = usable_hbm(skus()["H100-SXM-80GB"].hbm_bytes)
GB = 10**9


def rows(name: str, *, reserved: int = 0, allocation: str | None = None) -> list[AcceleratorLedgerView]:
    return [
        AcceleratorLedgerView(
            id=AcceleratorId.gpu(name, i),
            node=name,
            hbm_usable_bytes=USABLE,
            hbm_reserved_bytes=reserved,
            allocations=[allocation] if allocation else [],
        )
        for i in range(8)
    ]


def allocation(name: str, allocation_id: str, nbytes: int, *, counts: bool = True) -> AllocationEvent:
    return AllocationEvent(
        allocation_id=allocation_id,
        request_id="r",
        tenant="t",
        kind="replica" if counts else "request",
        counts_against_hbm=counts,
        shares=[
            ShareOut(
                accelerator_id=AcceleratorId.gpu(name, 0),
                weights_bytes=nbytes,
                kv_bytes=0,
                activation_bytes=0,
                workspace_bytes=0,
                total_bytes=nbytes,
            )
        ],
    )


def test_a_view_seeded_from_the_snapshots_follows_the_events() -> None:
    profile = node("n1").nvswitch(8).profile()
    fleet = FleetGetReply(
        nodes=[
            NodeView(
                name="n1",
                region="us-west-1",
                cluster="c1",
                rack="r1",
                sku="H100-SXM-80GB",
                profile=profile_to_payload(profile),
            )
        ],
        racks=[RackView(region="us-west-1", cluster="c1", name="r1", power_kw=40.0)],
        tpu_pods=[TpuPodView(name="p1", region="us-west-1", type="v5e", shape=[2, 2], chips=4, cluster="c9")],
    )
    ledger = SnapshotReply(accelerators=rows("n1", reserved=GB, allocation="al-0"))
    view = view_from(
        fleet=fleet, profiles={"n1": profile_to_payload(profile)}, ledger=ledger, skus=skus(), models=models()
    )
    gpu0 = AcceleratorId.gpu("n1", 0)
    assert view.snapshot.capacity[gpu0].reserved == GB
    assert view.snapshot.racks[("us-west-1", "c1", "r1")].power_kw == 40.0
    assert view.pods["p1"].cluster == "c9"

    apply_event(view, LedgerEventName.ALLOCATION_COMMITTED, allocation("n1", "al-0", GB))  # in the snapshot
    apply_event(view, LedgerEventName.ALLOCATION_COMMITTED, allocation("n1", "al-1", 2 * GB))
    apply_event(view, LedgerEventName.ALLOCATION_COMMITTED, allocation("n1", "al-q", 5 * GB, counts=False))
    assert view.snapshot.capacity[gpu0].reserved == 3 * GB
    apply_event(view, LedgerEventName.ALLOCATION_EXPIRED, allocation("n1", "al-0", GB))
    assert view.snapshot.capacity[gpu0].reserved == 2 * GB

    lost = NodeStateEvent(node="n1", region="us-west-1", accelerators=[gpu0])
    apply_event(view, TopologyEventName.NODE_LOST, lost)
    assert "n1" not in view.snapshot.nodes
    apply_event(view, TopologyEventName.NODE_RECOVERED, lost)
    down = AcceleratorBalance(id=gpu0, usable_bytes=USABLE, reserved_bytes=0, available=False)
    apply_event(
        view, LedgerEventName.CAPACITY_CHANGED, CapacityChangedEvent(node="n1", reason="lost", accelerators=[down])
    )
    cap = view.snapshot.capacity[gpu0]
    assert "n1" in view.snapshot.nodes and not cap.available and cap.reserved == 2 * GB

    other = node("n2").nvswitch(8).profile()
    apply_event(
        view,
        TopologyEventName.NODE_PROFILED,
        NodeProfileEvent(
            node="n2", region="us-west-1", kind="nvswitch", fingerprint="f", profile=profile_to_payload(other)
        ),
    )
    assert "n2" in view.profiles and "n2" not in view.snapshot.nodes  # the ledger does not know its GPUs yet
    balances = [AcceleratorBalance(id=r.id, usable_bytes=USABLE, reserved_bytes=0, available=True) for r in rows("n2")]
    apply_event(
        view,
        LedgerEventName.CAPACITY_CHANGED,
        CapacityChangedEvent(node="n2", reason="profiled", accelerators=balances),
    )
    assert "n2" in view.snapshot.nodes
    apply_event(view, TopologyEventName.NODE_REMOVED, NodeStateEvent(node="n2", region="us-west-1", accelerators=[]))
    assert "n2" not in view.snapshot.nodes

    pod = TpuPodEvent(pod="p1", region="us-west-1", type="v5e", shape=[2, 2], sku="TPU-V5E", hbm_per_chip=16 * GB)
    apply_event(view, TopologyEventName.TPU_POD_PROFILED, pod)
    assert view.pods["p1"].cluster == "c9"  # kept from fleet.get: the event does not carry it


# -- issue 12: sharing, fallbacks, stages, binding, launch, estimate; the commit; the view's new figures --


def place_request(**extra: Any) -> PlaceRequest:
    body: dict[str, Any] = {"request_id": "r", "tenant": "t", "model": "llama3-70b", "context_tokens": 8192, **extra}
    return PlaceRequest.model_validate(body)


def test_the_request_maps_sharing_fallbacks_and_pipeline_depth() -> None:
    default = to_domain(place_request())
    assert (default.sharing, default.fallbacks, default.pp) == ("exclusive", None, None)  # None: the whole ladder
    exact = to_domain(place_request(fallbacks=[]))
    assert exact.fallbacks == ()
    chosen = to_domain(place_request(sharing="shared", fallbacks=["kv_quantize", "queue"], pp=None))
    assert (chosen.sharing, chosen.fallbacks) == ("shared", ("kv_quantize", "queue"))
    assert to_domain(place_request(pp=2)).pp == 2
    assert may_queue(place_request()) and may_queue(place_request(fallbacks=["queue"]))
    assert not may_queue(place_request(fallbacks=[])) and not may_queue(place_request(fallbacks=["pipeline"]))


def staged_decision(**extra: Any) -> Decision:
    """TP=4 x PP=2 on a 4+4 node: stage 0 on nv0 (gpu0-3), stage 1 on nv4 (gpu4-7)."""
    stages = (tuple(f"n1/gpu{i}" for i in range(4)), tuple(f"n1/gpu{i}" for i in range(4, 8)))
    values: dict[str, Any] = {
        "request_id": "r",
        "status": "placed",
        "backend": "gpu",
        "region": "us-west-1",
        "cluster": "c1",
        "node": "n1",
        "nodes": ("n1",),
        "sku": "H100-SXM-80GB",
        "tp": 4,
        "pp": 2,
        "stages": stages,
        "accelerators": stages[0] + stages[1],
        "share": MemoryShare(weights=18 * GB, kv=2 * GB, activation=GB, workspace=GB),
        "fallback": "pipeline",
        "estimate": {"ttft_ms": 120.0, "tpot_ms": 30.0, "tokens_per_s": 500.0, "load_time_s": 9.0},
        "explanation": ("PP=2 across n1/nv0 and n1/nv4",),
    }
    values.update(extra)
    return Decision(**values)


def test_a_staged_decision_replies_with_its_stages_binding_launch_and_estimate() -> None:
    snap = snapshot(node("n1").four_plus_four())
    reply = to_reply(staged_decision(), snapshot=snap, request=to_domain(place_request(dtype="bf16")))
    assert reply.status == "placed" and reply.pp == 2 and reply.tp == 4 and reply.fallback == "pipeline"
    assert reply.sharing == "exclusive"
    assert reply.stages is not None and [[p.node for p in stage] for stage in reply.stages] == [["n1"], ["n1"]]
    assert [stage[0].accelerators for stage in reply.stages] == [
        [f"n1/gpu{i}" for i in range(4)],
        [f"n1/gpu{i}" for i in range(4, 8)],
    ]
    assert [stage[0].domain for stage in reply.stages] == ["n1/nv0", "n1/nv4"]
    assert [p.node for p in reply.placements] == ["n1"] and len(reply.placements[0].accelerators) == 8
    assert reply.estimate is not None and reply.estimate.tpot_ms == 30.0 and reply.estimate.load_time_s == 9.0
    assert reply.binding is not None and [b.node for b in reply.binding] == ["n1"]
    assert sorted(reply.binding[0].tp_rank_order) == list(range(8))
    assert reply.launch is not None
    vllm = reply.launch.vllm
    assert vllm[vllm.index("--tensor-parallel-size") + 1] == "4"
    assert vllm[vllm.index("--pipeline-parallel-size") + 1] == "2"
    assert vllm[vllm.index("--max-model-len") + 1] == "8192"
    device = snap.nodes["n1"].accelerators[0].hbm_bytes
    assert vllm[vllm.index("--gpu-memory-utilization") + 1] == f"{22 * GB * 1000 // device / 1000:.3f}"
    assert reply.launch.env["CUDA_VISIBLE_DEVICES"] == reply.binding[0].cuda_visible_devices


def test_kv_quantised_by_the_fallback_launches_with_an_fp8_kv_cache() -> None:
    snap = snapshot(node("n1").nvswitch(8))
    decision = staged_decision(pp=1, stages=(), fallback="kv_quantize", accelerators=("n1/gpu0", "n1/gpu1"), tp=2)
    reply = to_reply(decision, snapshot=snap, request=to_domain(place_request(dtype="bf16", kv_dtype="bf16")))
    assert reply.launch is not None and reply.stages is None
    assert reply.launch.vllm[reply.launch.vllm.index("--kv-cache-dtype") + 1] == "fp8"
    plain = to_reply(replace(decision, fallback=None), snapshot=snap, request=to_domain(place_request(dtype="bf16")))
    assert plain.launch is not None and plain.launch.vllm[plain.launch.vllm.index("--kv-cache-dtype") + 1] == "auto"


def test_a_rejection_has_no_binding_and_a_dry_reply_without_the_snapshot_none_either() -> None:
    rejected = Decision(request_id="r", status="rejected", error_code=ErrorCode.NO_CAPACITY, message="full")
    snap = snapshot(node("n1").nvswitch(8))
    reply = to_reply(rejected, snapshot=snap, request=to_domain(place_request()))
    assert reply.status == "rejected" and reply.binding is None and reply.launch is None and reply.stages is None
    assert to_reply(staged_decision()).binding is None  # no snapshot: nothing to bind against


def test_the_commit_of_a_staged_decision_holds_every_stage_with_its_sharing_and_traffic() -> None:
    snap = snapshot(node("n1").four_plus_four())
    decision = staged_decision(cross_domain_bytes_per_s=12.6e9)
    commit = to_commit(place_request(), decision, snap, lease_s=60)
    assert [s.accelerator_id for s in commit.shares] == list(decision.accelerators)  # all stages, one commit
    assert commit.expected == dict.fromkeys(decision.accelerators, 0)
    assert commit.sharing == "exclusive" and commit.cross_domain_bytes_per_s == 12_600_000_000
    shared = to_commit(place_request(sharing="shared"), replace(decision, sharing="shared"), snap, lease_s=60)
    assert shared.sharing == "shared"
    assert crossing(decision) == ("c1", 12.6e9) and crossing(replace(decision, cross_domain_bytes_per_s=0)) is None


def test_the_view_seeds_and_follows_sharing_cross_domain_traffic_and_telemetry() -> None:
    profile = node("n1").nvswitch(8).profile()
    fleet = FleetGetReply(
        nodes=[
            NodeView(
                name="n1",
                region="us-west-1",
                cluster="c1",
                rack="r1",
                sku="H100-SXM-80GB",
                profile=profile_to_payload(profile),
            )
        ]
    )
    seeded = rows("n1")
    seeded[0] = seeded[0].model_copy(update={"hbm_reserved_bytes": GB, "allocations": ["al-s"], "shared": True})
    seeded[1] = seeded[1].model_copy(update={"hbm_reserved_bytes": GB, "allocations": ["al-c"]})
    ledger = SnapshotReply(
        accelerators=seeded,
        cross_domain_used={"c1": 40 * GB},
        cross_domain=[CrossDomainAllocation(allocation_id="al-c", cluster="c1", bytes_per_s=40 * GB)],
    )
    view = view_from(
        fleet=fleet,
        profiles={"n1": profile_to_payload(profile)},
        ledger=ledger,
        skus=skus(),
        models=models(),
        pcie_window_s=0,
    )
    gpu0, gpu1, gpu2 = (AcceleratorId.gpu("n1", i) for i in range(3))
    snap = view.snapshot
    assert snap.capacity[gpu0].shared and not snap.capacity[gpu1].shared
    assert snap.cross_domain_used == {"c1": 40 * GB}

    ended = allocation("n1", "al-c", GB).model_copy(
        update={"shares": [allocation("n1", "al-c", GB).shares[0].model_copy(update={"accelerator_id": gpu1})]}
    )
    apply_event(view, LedgerEventName.ALLOCATION_RELEASED, ended.model_copy(update={"cluster": "c1"}))
    assert view.snapshot.cross_domain_used == {}
    joined = allocation("n1", "al-s2", GB).model_copy(
        update={"sharing": "shared", "cluster": "c1", "cross_domain_bytes_per_s": 0}
    )
    apply_event(view, LedgerEventName.ALLOCATION_COMMITTED, joined)
    assert view.snapshot.capacity[gpu0].shared and view.snapshot.capacity[gpu0].reserved == 2 * GB
    crossing_commit = allocation("n1", "al-x", GB).model_copy(
        update={
            "shares": [allocation("n1", "al-x", GB).shares[0].model_copy(update={"accelerator_id": gpu2})],
            "cluster": "c1",
            "cross_domain_bytes_per_s": 7 * GB,
        }
    )
    apply_event(view, LedgerEventName.ALLOCATION_COMMITTED, crossing_commit)
    assert view.snapshot.cross_domain_used == {"c1": 7 * GB} and not view.snapshot.capacity[gpu2].shared

    link = 3.938e9 * 16
    telemetry = GpuTelemetryEvent(node="n1", gpus=[GpuSample(index=3, pcie_rx_bytes_per_s=0.8 * link)])
    apply_event(view, TelemetryEventName.GPU, telemetry)  # no time: not applied
    assert view.snapshot.pcie_util == {}
    apply_event(view, TelemetryEventName.GPU, telemetry, at=datetime(2026, 12, 5, tzinfo=UTC))
    assert view.snapshot.pcie_util == {"n1": pytest.approx(0.8)}


# -- launch lines: quantised weights, two GH200 nodes, a TPU slice ------------------------------------------


def gpu_decision(accelerators: tuple[str, ...], **extra: Any) -> Decision:
    return staged_decision(pp=1, stages=(), fallback=None, accelerators=accelerators, tp=len(accelerators), **extra)


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_int4_weights_load_the_listed_pre_quantised_checkpoint() -> None:
    snap = snapshot(node("n1").nvswitch(8))
    request = to_domain(place_request(model="llama3.1-8b", dtype="int4"))
    reply = to_reply(gpu_decision(("n1/gpu0",)), snapshot=snap, request=request)
    assert reply.launch is not None and reply.launch.checkpoint == "UCLA-EMC/Meta-Llama-3.1-8B-AWQ-INT4"
    assert reply.launch.vllm[0] == "UCLA-EMC/Meta-Llama-3.1-8B-AWQ-INT4"
    assert _arg(reply.launch.sglang, "--model-path") == "UCLA-EMC/Meta-Llama-3.1-8B-AWQ-INT4"
    # its config names AWQ and float16: no --quantization, and the engines take the checkpoint's dtype
    assert "--quantization" not in reply.launch.vllm and reply.launch.quantization is None
    assert _arg(reply.launch.vllm, "--dtype") == "auto" and _arg(reply.launch.sglang, "--dtype") == "auto"


def test_int4_weights_without_a_listed_checkpoint_have_no_launch_and_say_why() -> None:
    snap = snapshot(node("n1").nvswitch(8))
    request = to_domain(place_request(model="llama3-70b", dtype="int4"))
    reply = to_reply(gpu_decision(("n1/gpu0", "n1/gpu1")), snapshot=snap, request=request)
    assert reply.launch is None  # never the bf16 checkpoint on an int4 share
    assert reply.binding is not None and reply.binding[0].cuda_visible_devices == "0,1"
    assert any("no int4 checkpoint" in line and "checkpoints.int4" in line for line in reply.explanation)


def test_fp8_weights_prefer_a_listed_checkpoint_else_quantise_on_the_fly() -> None:
    snap = snapshot(node("n1").nvswitch(8))
    decision = gpu_decision(("n1/gpu0", "n1/gpu1"))
    listed = to_reply(decision, snapshot=snap, request=to_domain(place_request(model="llama3.1-70b", dtype="fp8")))
    assert listed.launch is not None and listed.launch.vllm[0] == "neuralmagic/Meta-Llama-3.1-70B-FP8"
    assert "--quantization" not in listed.launch.vllm and _arg(listed.launch.vllm, "--dtype") == "auto"
    online = to_reply(decision, snapshot=snap, request=to_domain(place_request(model="llama3-70b", dtype="fp8")))
    assert online.launch is not None and online.launch.vllm[0] == "meta-llama/Meta-Llama-3-70B"
    assert _arg(online.launch.vllm, "--quantization") == "fp8" and online.launch.quantization == "fp8"
    assert _arg(online.launch.sglang, "--quantization") == "fp8"


def test_a_replica_on_two_gh200_nodes_binds_each_node_and_shares_one_launch() -> None:
    snap = snapshot(node("gh-a").sku("GH200-96GB").nvswitch(1), node("gh-b").sku("GH200-96GB").nvswitch(1))
    decision = gpu_decision(("gh-a/gpu0", "gh-b/gpu0"), sku="GH200-96GB", node="gh-a", nodes=("gh-a", "gh-b"))
    reply = to_reply(decision, snapshot=snap, request=to_domain(place_request(model="llama3-8b", dtype="bf16")))
    assert reply.binding is not None and [(b.node, b.cuda_visible_devices) for b in reply.binding] == [
        ("gh-a", "0"),
        ("gh-b", "0"),
    ]
    assert reply.launch is not None and _arg(reply.launch.vllm, "--tensor-parallel-size") == "2"


def test_a_tpu_slice_launches_vllm_tpu_with_its_chips_as_the_tp_group() -> None:
    pod = tpu_pod("p1", shape=(4, 4))
    snap = snapshot(pods=[pod])
    chips = tuple(f"p1/0.{y}" for y in range(4))
    decision = Decision(
        request_id="r",
        status="placed",
        backend="tpu",
        region="us-west-1",
        sku="TPU-V5E",
        tp=4,
        tpu=TpuPlacement(pod="p1", origin=(0, 0), shape=(1, 4), chips=chips),
        share=MemoryShare(weights=4 * GB, kv=2 * GB, activation=GB, workspace=GB),
    )
    reply = to_reply(decision, snapshot=snap, request=to_domain(place_request(model="llama3-8b", dtype="bf16")))
    assert reply.binding is None and reply.launch is not None and reply.launch.sglang == []
    vllm = reply.launch.vllm
    assert vllm[0] == "meta-llama/Meta-Llama-3-8B" and _arg(vllm, "--tensor-parallel-size") == "4"
    hbm = snap.tpu_pods["p1"].hbm_per_chip
    assert _arg(vllm, "--gpu-memory-utilization") == f"{8 * GB * 1000 // hbm / 1000:.3f}"
    assert _arg(vllm, "--max-model-len") == "8192" and _arg(vllm, "--dtype") == "bfloat16"
    assert reply.launch.env == {"PJRT_DEVICE": "TPU"}
