"""Binding and launch (issue 12 item 4): the TP rank order follows the best NVLink ring, the binding
names the NUMA node and its CPUs where the replica's GPUs share one, and the engine arguments carry the
TP/PP sizes and the ledger share as a memory fraction.

The must-show runs on real `nvidia-smi topo -m` outputs: the repository's fixtures (tests/fixtures/topo,
shared/catalog/topo) and, where present, the reference captures in ../shared/data/topo (dev machine).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import asdict
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shared.contracts.placement import EngineLaunch
from shared.contracts.placement import NodeBinding as NodeBindingContract
from shared.domain.fleet import Accelerator, NodeProfile
from shared.domain.memory import MemoryShare, per_accelerator_share
from shared.domain.placement.binding import (
    BRUTE_FORCE_MAX_GPUS,
    NoCheckpoint,
    NodeBinding,
    bind,
    checkpoint_id,
    launch,
    memory_fraction,
    ring_order,
    sglang_kv_cache_dtype,
    vllm_kv_cache_dtype,
    weights_for,
)
from shared.domain.placement.types import Decision, TpuPlacement
from shared.domain.topology import (
    LinkMatrix,
    ParsedTopology,
    TopologyParseError,
    best_tp_group,
    link_rank,
    parse_topo_matrix,
)
from tests.unit.placement.builders import models
from tests.unit.topology.builders import node as matrix

REPO = Path(__file__).resolve().parents[3]
TOPO_FOLDERS = (REPO / "tests" / "fixtures" / "topo", REPO / "shared" / "catalog" / "topo")
REFERENCE = REPO.parent / "shared" / "data" / "topo"  # real captures, only on the dev machine
H100_HBM_BYTES = 85_899_345_920  # 80 GiB (shared/catalog/skus.yaml H100-SXM-80GB)
SHARE = MemoryShare(weights=17_638_426_624, kv=10_737_418_240, activation=771_751_936, workspace=1_073_741_824)


def _parsed_topologies() -> list[tuple[str, ParsedTopology]]:
    """Every `topo -m` sample that parses (the fixture folders also hold broken ones on purpose)."""
    paths = [p for folder in TOPO_FOLDERS for p in sorted(folder.glob("*.txt"))]
    if REFERENCE.is_dir():
        paths += sorted(REFERENCE.glob("*.txt"))
    found: list[tuple[str, ParsedTopology]] = []
    for path in paths:
        with path.open(encoding="utf-8", newline="") as handle:  # newline="": CRLF fixtures stay as on disk
            try:
                found.append((path.name, parse_topo_matrix(handle.read())))
            except TopologyParseError:
                continue
    return found


def _profile(name: str, parsed: ParsedTopology) -> NodeProfile:
    """The profile the nvidia-smi provider builds from a capture (NUMA and CPU affinity per GPU)."""
    links = parsed.matrix
    return NodeProfile(
        name=name,
        region="r",
        cluster="c",
        rack="k",
        sku="H100-SXM-80GB",
        accelerators=tuple(
            Accelerator(
                index=gpu.index,
                sku="H100-SXM-80GB",
                hbm_bytes=H100_HBM_BYTES,
                numa_node=links.numa[gpu.index],
                cpu_affinity=gpu.cpu_affinity,
            )
            for gpu in parsed.gpus
        ),
        links=links,
    )


def _placed(*stages: tuple[str, ...], tp: int, backend: str = "gpu") -> Decision:
    accelerators = tuple(a for stage in stages for a in stage)
    return Decision(
        request_id="req-1",
        status="placed",
        backend=backend,
        node=accelerators[0].split("/")[0],
        tp=tp,
        accelerators=accelerators,
        share=SHARE,
        pp=len(stages),
        stages=stages if len(stages) > 1 else (),
    )


def _ring_hops(order: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(a, order[(i + 1) % len(order)]) for i, a in enumerate(order)]


SAMPLES = [
    pytest.param(name, parsed, id=name)
    for name, parsed in _parsed_topologies()
    if best_tp_group(parsed.matrix, range(parsed.gpu_count), 4) is not None
]


def test_the_real_samples_include_tp4_nodes() -> None:
    names = {name for name, _parsed in _parsed_topologies()}
    assert {"four_plus_four.txt", "cube_mesh.txt", "dgx-a100-8.txt", "tab_nic_legend.txt"} <= names
    assert len(SAMPLES) >= 5  # + gb_tray_gpu_numa_id.txt (and the reference captures where present)


@pytest.mark.parametrize(("name", "parsed"), SAMPLES)
def test_tp4_binding_on_a_real_topology_is_an_nvlinked_ring_on_one_numa_node(name: str, parsed: ParsedTopology) -> None:
    links = parsed.matrix
    group = best_tp_group(links, range(parsed.gpu_count), 4)  # what placement picks on an idle node
    assert group is not None
    profile = _profile("n1", parsed)
    decision = _placed(tuple(profile.accelerator_id(i) for i in group), tp=4)

    (binding,) = bind(decision, {"n1": profile})

    order = binding.tp_rank_order
    assert sorted(order) == sorted(group)
    assert binding.cuda_visible_devices == ",".join(str(i) for i in order)
    for a, b in _ring_hops(order):  # every hop, last -> first included, is NVLink
        assert links.is_nvlinked(a, b), f"{name}: GPU{a}-GPU{b} is {links.link(a, b).code} in ring {order}"
    # "On one NUMA node where one exists": when some 4-GPU NVLink clique sits on one NUMA node, the
    # group placement picks does too, and the binding names that node and its CPUs.
    on_one_numa = [
        c
        for c in itertools.combinations(range(parsed.gpu_count), 4)
        if all(links.is_nvlinked(a, b) for a, b in itertools.combinations(c, 2))
        and len({links.numa[i] for i in c}) == 1
        and links.numa[c[0]] is not None
    ]
    numas = {links.numa[i] for i in group}
    if on_one_numa:
        assert len(numas) == 1
    if len(numas) == 1 and None not in numas:
        assert binding.numa_node == links.numa[group[0]]
        printed = {parsed.gpus[i].cpu_affinity for i in range(parsed.gpu_count) if links.numa[i] == binding.numa_node}
        if printed - {None}:  # the capture printed this NUMA node's CPUs (a cgroup-limited one may not)
            assert binding.cpu_set in printed
            assert binding.cpu_set
        else:
            assert binding.cpu_set is None
    else:
        assert binding.numa_node is None
        assert binding.cpu_set is None
    NodeBindingContract.model_validate({**asdict(binding), "tp_rank_order": list(order)})  # fits the reply


def test_four_plus_four_binds_a_quad_to_its_numa_node_and_cpus() -> None:
    (parsed,) = [p for name, p in _parsed_topologies() if name == "four_plus_four.txt"]
    profile = _profile("hgx-01", parsed)
    decision = _placed(tuple(profile.accelerator_id(i) for i in (4, 5, 6, 7)), tp=4)

    assert bind(decision, {"hgx-01": profile}) == (
        NodeBinding(
            node="hgx-01",
            cuda_visible_devices="4,5,6,7",
            tp_rank_order=(4, 5, 6, 7),
            numa_node=1,
            cpu_set="28-55,84-111",
        ),
    )


# -- ring order -----------------------------------------------------------------------------------

RING_CASES = [
    # (name, gpus, NVLinked pairs -> n, group, expected ring, why)
    (
        "nvswitch: all alike, index order",
        8,
        {(i, j): 18 for i in range(8) for j in range(i + 1, 8)},
        (3, 1, 0, 2),
        (0, 1, 2, 3),
    ),
    # A 4-cycle 0-2-1-3-0 of NV4; 0-1 and 2-3 are SYS: index order 0,1,2,3 would hop over SYS twice.
    ("4-cycle: only the NVLinked ring", 4, {(0, 2): 4, (2, 1): 4, (1, 3): 4, (3, 0): 4}, (0, 1, 2, 3), (0, 2, 1, 3)),
    # Clique where 0-1 is the one weak pair (NV1, others NV2): the ring avoids it, 0-2-1-3-0 all NV2.
    (
        "clique: avoid the weak pair",
        4,
        {(0, 1): 1, (0, 2): 2, (0, 3): 2, (1, 2): 2, (1, 3): 2, (2, 3): 2},
        (0, 1, 2, 3),
        (0, 2, 1, 3),
    ),
    # DGX-1 quad (real 18_v100x8 capture): 0-1 NV1, 0-2 NV1, 0-3 NV2, 1-2 NV2, 1-3 NV1, 2-3 NV2. Every ring's
    # weakest hop is NV1; 0-1-2-3-0 sums 1+2+2+2 = 7, 0-2-1-3-0 sums 1+2+1+2 = 6, 0-1-3-2-0 sums 1+1+2+1 = 5.
    (
        "cube-mesh quad: most NVLinks",
        8,
        {(0, 1): 1, (0, 2): 1, (0, 3): 2, (1, 2): 2, (1, 3): 1, (2, 3): 2, (0, 4): 2},
        (0, 1, 2, 3),
        (0, 1, 2, 3),
    ),
    # Two NV12 quads joined by SYS (4+4, TP=8 across domains): two SYS hops are unavoidable; each quad is walked whole.
    (
        "4+4 across domains: two SYS hops",
        8,
        {(i, j): 12 for quad in ((0, 1, 2, 3), (4, 5, 6, 7)) for i, j in itertools.combinations(quad, 2)},
        tuple(range(8)),
        (0, 1, 2, 3, 4, 5, 6, 7),
    ),
    ("pair: sorted", 2, {(0, 1): 4}, (1, 0), (0, 1)),
    ("single GPU", 2, {}, (1,), (1,)),
]


@pytest.mark.parametrize(
    ("nodes", "nv", "group", "expected"), [c[1:] for c in RING_CASES], ids=[c[0] for c in RING_CASES]
)
def test_ring_order(
    nodes: int, nv: dict[tuple[int, int], int], group: tuple[int, ...], expected: tuple[int, ...]
) -> None:
    assert ring_order(matrix(nodes, nv), group) == expected


def test_ring_order_refuses_repeats_and_foreign_gpus() -> None:
    links = matrix(4, {(0, 1): 4})
    with pytest.raises(ValueError, match="repeat"):
        ring_order(links, (0, 0, 1))
    with pytest.raises(ValueError, match="not on this 4-GPU node"):
        ring_order(links, (0, 4))


@st.composite
def matrices(draw: st.DrawFn, max_gpus: int = 12) -> LinkMatrix:
    gpus = draw(st.integers(1, max_gpus))
    pairs = list(itertools.combinations(range(gpus), 2))
    nv = {pair: draw(st.sampled_from((1, 2, 4, 12, 18))) for pair in pairs if draw(st.booleans())}
    other = draw(st.sampled_from(("SYS", "NODE", "PHB", "PXB", "PIX")))
    return matrix(gpus, nv, other=other)


@given(data=st.data())
@settings(max_examples=150, deadline=None)
def test_ring_order_is_a_permutation_of_its_input(data: st.DataObject) -> None:
    links = data.draw(matrices())
    group = data.draw(st.lists(st.integers(0, links.gpu_count - 1), unique=True, max_size=links.gpu_count))
    order = ring_order(links, group)
    assert sorted(order) == sorted(group)
    if order:
        assert order[0] == min(group)


def _key(links: LinkMatrix, cycle: tuple[int, ...]) -> tuple[int, int]:
    hops = _ring_hops(cycle)
    return min(link_rank(links.link(a, b)) for a, b in hops), sum(links.nv_links(a, b) for a, b in hops)


@given(links=matrices(max_gpus=7))
@settings(max_examples=100, deadline=None)
def test_ring_order_maximises_the_weakest_hop_then_the_nvlinks(links: LinkMatrix) -> None:
    group = tuple(range(links.gpu_count))
    if len(group) < 3:
        return
    best = max(_key(links, (0, *rest)) for rest in itertools.permutations(group[1:]))
    assert _key(links, ring_order(links, group)) == best


def test_more_gpus_than_brute_force_take_the_greedy_walk() -> None:
    gpus = BRUTE_FORCE_MAX_GPUS + 2
    # A cycle 0-2-4-...-8-9-7-...-1-0 of NV4; every other pair PCIe: the greedy walk follows NVLink from 0.
    evens, odds = list(range(0, gpus, 2)), list(range(gpus - 1, 0, -2))
    cycle = evens + odds
    nv = {(a, cycle[(i + 1) % gpus]): 4 for i, a in enumerate(cycle)}
    order = ring_order(matrix(gpus, nv), range(gpus))
    assert sorted(order) == list(range(gpus))
    assert order[0] == 0
    links = matrix(gpus, nv)
    assert all(links.is_nvlinked(a, b) for a, b in itertools.pairwise(order))


# -- bind ----------------------------------------------------------------------------------------


def _node(name: str, links: LinkMatrix, affinity: dict[int, str] | None = None) -> NodeProfile:
    affinity = affinity or {}
    return NodeProfile(
        name=name,
        region="r",
        cluster="c",
        rack="k",
        sku="H100-SXM-80GB",
        accelerators=tuple(
            Accelerator(
                index=i,
                sku="H100-SXM-80GB",
                hbm_bytes=H100_HBM_BYTES,
                numa_node=links.numa[i],
                cpu_affinity=affinity.get(links.numa[i] or 0),
            )
            for i in range(links.gpu_count)
        ),
        links=links,
    )


QUADS = {(i, j): 12 for quad in ((0, 1, 2, 3), (4, 5, 6, 7)) for i, j in itertools.combinations(quad, 2)}
NUMA_CPUS = {0: "0-27,56-83", 1: "28-55,84-111"}


def test_pp2_on_one_node_gets_one_binding_with_both_stages_in_stage_order() -> None:
    profile = _node("hgx-01", matrix(8, QUADS, numa=[0, 0, 0, 0, 1, 1, 1, 1]), NUMA_CPUS)
    stage0 = tuple(f"hgx-01/gpu{i}" for i in (4, 5, 6, 7))
    stage1 = tuple(f"hgx-01/gpu{i}" for i in (0, 1, 2, 3))

    (binding,) = bind(_placed(stage0, stage1, tp=4), {"hgx-01": profile})

    assert binding.tp_rank_order == (4, 5, 6, 7, 0, 1, 2, 3)  # stage 0 first, each along its ring
    assert binding.cuda_visible_devices == "4,5,6,7,0,1,2,3"
    assert (binding.numa_node, binding.cpu_set) == (None, None)  # the replica spans both NUMA nodes


def test_pp2_across_nodes_gets_one_binding_per_node() -> None:
    links = matrix(8, QUADS, numa=[0, 0, 0, 0, 1, 1, 1, 1])
    nodes = {"a": _node("a", links, NUMA_CPUS), "b": _node("b", links, NUMA_CPUS)}
    decision = _placed(("b/gpu5", "b/gpu4", "b/gpu7", "b/gpu6"), ("a/gpu0", "a/gpu1", "a/gpu2", "a/gpu3"), tp=4)

    assert bind(decision, nodes) == (
        NodeBinding("b", "4,5,6,7", (4, 5, 6, 7), 1, "28-55,84-111"),
        NodeBinding("a", "0,1,2,3", (0, 1, 2, 3), 0, "0-27,56-83"),
    )


def test_cpu_set_falls_back_to_a_sibling_gpu_and_intersects_disagreeing_lists() -> None:
    links = matrix(4, {(0, 1): 4, (2, 3): 4}, numa=[0, 0, 0, 0])
    base = _node("n", links)
    accelerators = list(base.accelerators)
    accelerators[3] = Accelerator(3, "H100-SXM-80GB", H100_HBM_BYTES, numa_node=0, cpu_affinity="0-15")
    sibling = NodeProfile("n", "r", "c", "k", "H100-SXM-80GB", tuple(accelerators), links)
    (binding,) = bind(_placed(("n/gpu0", "n/gpu1"), tp=2), {"n": sibling})
    assert (binding.numa_node, binding.cpu_set) == (0, "0-15")  # GPUs 0 and 1 printed none; GPU3 did

    accelerators[0] = Accelerator(0, "H100-SXM-80GB", H100_HBM_BYTES, numa_node=0, cpu_affinity="0-7,16-23")
    accelerators[1] = Accelerator(1, "H100-SXM-80GB", H100_HBM_BYTES, numa_node=0, cpu_affinity="4-11")
    odd = NodeProfile("n", "r", "c", "k", "H100-SXM-80GB", tuple(accelerators), links)
    (binding,) = bind(_placed(("n/gpu0", "n/gpu1"), tp=2), {"n": odd})
    assert binding.cpu_set == "4-7"


def test_rejected_and_tpu_decisions_bind_nothing() -> None:
    profile = _node("n", matrix(2, {(0, 1): 4}))
    assert bind(Decision(request_id="r", status="rejected"), {"n": profile}) == ()
    tpu = Decision(
        request_id="r",
        status="placed",
        backend="tpu",
        tp=4,
        accelerators=("pod/0.0", "pod/0.1", "pod/1.0", "pod/1.1"),
        tpu=TpuPlacement("pod", (0, 0), (2, 2), ("pod/0.0", "pod/0.1", "pod/1.0", "pod/1.1")),
        share=SHARE,
    )
    assert bind(tpu, {"n": profile}) == ()


def test_a_node_without_a_profile_is_a_bug() -> None:
    with pytest.raises(ValueError, match="no profile"):
        bind(_placed(("ghost/gpu0",), tp=1), {})


# -- launch ---------------------------------------------------------------------------------------


def _arg(args: tuple[str, ...], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_worked_example_llama3_70b_fp8_tp4_on_h100() -> None:
    """docs/PLACEMENT.md "Binding and launch": the share the memory model gives, over 80 GiB."""
    spec = models()["llama3-70b"]
    share = per_accelerator_share(spec, tp=4, dtype="fp8", kv_dtype="bf16", context_tokens=8192, concurrency=16)
    # weights ceil(70,553,706,496 / 4) = 17,638,426,624; KV 2 x (8/4 heads) x 128 x 80 layers x 8192 x 16 x 2 B
    # = 10,737,418,240; activation 771,751,936; workspace 1 GiB = 1,073,741,824; total 30,221,338,624.
    assert share == SHARE and share.total == 30_221_338_624
    # 30,221,338,624 / 85,899,345,920 = 0.35182... -> 0.351 (rounded down: never more than the ledger holds)
    binding = NodeBinding("hgx-01", "0,1,2,3", (0, 1, 2, 3), 0, "0-27,56-83")
    decision = _placed(tuple(f"hgx-01/gpu{i}" for i in range(4)), tp=4)

    result = launch(
        decision,
        model=spec,
        hbm_bytes=H100_HBM_BYTES,
        context_tokens=8192,
        concurrency=16,
        dtype="fp8",
        kv_dtype="bf16",
        bindings=(binding,),
    )

    assert result.vllm == (
        "meta-llama/Meta-Llama-3-70B",
        "--tensor-parallel-size",
        "4",
        "--gpu-memory-utilization",
        "0.351",
        "--max-model-len",
        "8192",
        "--max-num-seqs",
        "16",
        "--dtype",
        "bfloat16",
        "--kv-cache-dtype",
        "auto",
        "--quantization",
        "fp8",
    )
    assert result.sglang == (
        "--model-path",
        "meta-llama/Meta-Llama-3-70B",
        "--tp-size",
        "4",
        "--mem-fraction-static",
        "0.351",
        "--context-length",
        "8192",
        "--max-running-requests",
        "16",
        "--dtype",
        "bfloat16",
        "--kv-cache-dtype",
        "auto",
        "--quantization",
        "fp8",
    )
    assert result.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    EngineLaunch(vllm=list(result.vllm), sglang=list(result.sglang), env=dict(result.env))  # fits the reply


def test_pp2_launch_names_both_sizes() -> None:
    spec = models()["llama3-70b"]
    decision = _placed(tuple(f"n/gpu{i}" for i in range(4)), tuple(f"n/gpu{i}" for i in range(4, 8)), tp=4)
    bindings = (NodeBinding("n", "0,1,2,3,4,5,6,7", tuple(range(8)), None, None),)

    result = launch(
        decision,
        model=spec,
        hbm_bytes=H100_HBM_BYTES,
        context_tokens=4096,
        concurrency=8,
        dtype="bf16",
        kv_dtype="fp8",
        bindings=bindings,
    )

    assert (_arg(result.vllm, "--tensor-parallel-size"), _arg(result.vllm, "--pipeline-parallel-size")) == ("4", "2")
    assert (_arg(result.sglang, "--tp-size"), _arg(result.sglang, "--pp-size")) == ("4", "2")
    assert (_arg(result.vllm, "--kv-cache-dtype"), _arg(result.sglang, "--kv-cache-dtype")) == ("fp8", "fp8_e4m3")
    assert _arg(result.vllm, "--dtype") == "bfloat16"
    assert "--quantization" not in result.vllm
    assert result.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"


def test_pp1_launch_has_no_pipeline_flag_and_no_bindings_no_env() -> None:
    decision = _placed(("n/gpu0",), tp=1)
    result = launch(
        decision,
        model=models()["llama3-8b"],
        hbm_bytes=H100_HBM_BYTES,
        context_tokens=4096,
        concurrency=4,
        dtype="bf16",
        kv_dtype="bf16",
        bindings=(),
    )
    assert _arg(result.vllm, "--tensor-parallel-size") == "1"
    assert "--pipeline-parallel-size" not in result.vllm and "--pp-size" not in result.sglang
    assert result.env == {}


@given(
    share=st.integers(1, 200 * 2**30),
    hbm=st.sampled_from((25_769_803_776, 51_539_607_552, H100_HBM_BYTES, 151_397_597_184, 206_158_430_208)),
)
@example(share=25_769_803_777, hbm=25_769_803_776)  # one byte over the device: floors to 1.000, still refused
@example(share=25_769_803_776, hbm=25_769_803_776)  # the whole device: 1.000
def test_memory_fraction_is_share_over_hbm_rounded_down(share: int, hbm: int) -> None:
    if not (share * 1000 >= hbm and share <= hbm):  # below 0.001 or above the device: refused
        with pytest.raises(ValueError):
            memory_fraction(share, hbm)
        return
    fraction = Decimal(memory_fraction(share, hbm))
    assert fraction.as_tuple().exponent == -3
    assert fraction <= Decimal(share) / Decimal(hbm) < fraction + Decimal("0.001")


@given(total=st.integers(2**30, 70 * 2**30))
def test_launch_memory_fraction_equals_the_ledger_share_over_hbm(total: int) -> None:
    share = MemoryShare(weights=total - 2**30, kv=0, activation=0, workspace=2**30)
    decision = Decision(
        request_id="r", status="placed", backend="gpu", tp=2, accelerators=("n/gpu0", "n/gpu1"), share=share
    )
    result = launch(
        decision,
        model=models()["llama3-8b"],
        hbm_bytes=H100_HBM_BYTES,
        context_tokens=2048,
        concurrency=1,
        dtype="bf16",
        kv_dtype="bf16",
        bindings=(),
    )
    expected = Decimal(total * 1000 // H100_HBM_BYTES) / 1000
    assert Decimal(_arg(result.vllm, "--gpu-memory-utilization") or "") == expected
    assert Decimal(_arg(result.sglang, "--mem-fraction-static") or "") == expected
    assert _arg(result.vllm, "--tensor-parallel-size") == _arg(result.sglang, "--tp-size") == "2"


def test_launch_refuses_a_decision_without_a_share() -> None:
    with pytest.raises(ValueError, match="no share"):
        launch(
            Decision(request_id="r", status="rejected"),
            model=models()["llama3-8b"],
            hbm_bytes=H100_HBM_BYTES,
            context_tokens=1,
            concurrency=1,
            dtype="bf16",
            kv_dtype="bf16",
            bindings=(),
        )


@pytest.mark.parametrize(
    ("kv", "vllm", "sglang"),
    [
        ("bf16", "auto", "auto"),
        ("fp16", "auto", "auto"),
        ("fp32", "auto", "auto"),
        ("fp8", "fp8", "fp8_e4m3"),
        ("int8", "fp8", "fp8_e4m3"),  # same one byte per element the ledger reserved
        ("fp4", "nvfp4", "fp4_e2m1"),
        ("int4", "nvfp4", "fp4_e2m1"),
    ],
)
def test_kv_cache_dtype_names(kv: str, vllm: str, sglang: str) -> None:
    assert (vllm_kv_cache_dtype(kv), sglang_kv_cache_dtype(kv)) == (vllm, sglang)


def test_unknown_kv_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        vllm_kv_cache_dtype("fp12")


def test_checkpoint_is_the_hugging_face_repo_of_the_catalog_source() -> None:
    catalog = models()
    assert checkpoint_id(catalog["llama3-70b"]) == "meta-llama/Meta-Llama-3-70B"
    assert checkpoint_id(catalog["deepseek-v3"]) == "deepseek-ai/DeepSeek-V3"
    assert all("/" in checkpoint_id(spec) for spec in catalog.values())
    unsourced = dataclasses.replace(catalog["llama3-8b"], source="hand-written")
    assert checkpoint_id(unsourced) == "llama3-8b"


def test_a_native_fp8_checkpoint_gets_no_quantization_flag() -> None:
    decision = _placed(tuple(f"n/gpu{i}" for i in range(8)), tp=8)
    result = launch(
        decision,
        model=models()["deepseek-v3"],
        hbm_bytes=151_397_597_184,
        context_tokens=4096,
        concurrency=4,
        dtype="fp8",
        kv_dtype="bf16",
        bindings=(),
    )
    assert "--quantization" not in result.vllm and "--quantization" not in result.sglang
    assert _arg(result.vllm, "--dtype") == "bfloat16"


@pytest.mark.parametrize(
    ("model", "dtype", "expected"),
    [
        ("llama3-70b", "bf16", ("meta-llama/Meta-Llama-3-70B", "bfloat16", None)),
        ("llama3-70b", "fp16", ("meta-llama/Meta-Llama-3-70B", "float16", None)),
        ("llama3-70b", "fp8", ("meta-llama/Meta-Llama-3-70B", "bfloat16", "fp8")),  # online fp8
        ("llama3.1-70b", "fp8", ("neuralmagic/Meta-Llama-3.1-70B-FP8", "auto", None)),  # listed: as it is
        ("llama3.1-8b", "int4", ("UCLA-EMC/Meta-Llama-3.1-8B-AWQ-INT4", "auto", None)),
        ("mixtral-8x7b", "int4", ("TheBloke/mixtral-8x7b-v0.1-AWQ", "auto", None)),
        ("deepseek-v3", "fp8", ("deepseek-ai/DeepSeek-V3", "bfloat16", None)),  # released in fp8
    ],
)
def test_weights_come_from_a_listed_checkpoint_the_models_own_or_online_fp8(
    model: str, dtype: str, expected: tuple[str, str, str | None]
) -> None:
    weights = weights_for(models()[model], dtype)
    assert (weights.checkpoint, weights.engine_dtype, weights.quantization) == expected


@pytest.mark.parametrize("dtype", ["int8", "int4", "fp4"])
def test_sub_8_bit_and_int8_weights_without_a_listed_checkpoint_have_none(dtype: str) -> None:
    with pytest.raises(NoCheckpoint, match=f"llama3-70b has no {dtype} checkpoint"):
        weights_for(models()["llama3-70b"], dtype)
