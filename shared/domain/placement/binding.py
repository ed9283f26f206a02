"""From a placed ``Decision`` to what an engine is started with: per node the GPUs, their TP rank order
along the best NVLink ring, the NUMA node and its CPUs (``bind``), and the vLLM / SGLang arguments and
environment that realise the placement (``launch``).

Why a ring: NCCL's all-reduce on a single node runs rings over the GPUs in rank order, so a TP group
whose consecutive ranks share the most NVLinks has no slow hop on its critical path. On an NVSwitch
node every order is equal (each pair has the same NV count) and the order stays the index order; on
a DGX-1 hybrid cube mesh or a bridged node the order matters (docs/PLACEMENT.md "Binding and launch").

Pure: no IO; the service hands in the decision and the node profiles it decided on.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from math import prod

from shared.domain.dtypes import compute_dtype, dtype_bytes
from shared.domain.fleet import AcceleratorId, NodeProfile
from shared.domain.models import ModelSpec
from shared.domain.placement.types import Decision
from shared.domain.topology import LinkMatrix, link_rank, parse_int_list
from shared.domain.topology.cpus import cpu_list

__all__ = [
    "BRUTE_FORCE_MAX_GPUS",
    "Launch",
    "NoCheckpoint",
    "NodeBinding",
    "Weights",
    "bind",
    "checkpoint_id",
    "launch",
    "memory_fraction",
    "ring_order",
    "sglang_kv_cache_dtype",
    "tpu_launch",
    "vllm_kv_cache_dtype",
    "weights_for",
]

BRUTE_FORCE_MAX_GPUS = 8
"""Up to this many GPUs every ring is tried ((n-1)!/2 of them: 2,520 for 8); above it a greedy
nearest-neighbour walk by link rank (no node today has more than 8 GPUs in one NVLink clique)."""


@dataclass(frozen=True, slots=True)
class NodeBinding:
    """How one node's engine process runs its part of the replica.

    ``tp_rank_order`` are GPU indices (nvidia-smi numbering) in rank order: each TP group along its
    best NVLink ring, stage after stage when the node holds several pipeline stages.
    ``cuda_visible_devices`` is the same list comma-separated, so CUDA device i is rank i.
    ``numa_node`` is set when every GPU of the replica on this node sits on that NUMA node;
    ``cpu_set`` is then that NUMA node's CPU list as nvidia-smi prints it ("0-23,48-71"), or None
    when the topology did not say (a cgroup-limited capture prints no CPU affinity).
    """

    node: str
    cuda_visible_devices: str
    tp_rank_order: tuple[int, ...]
    numa_node: int | None
    cpu_set: str | None


@dataclass(frozen=True, slots=True)
class Launch:
    """Engine arguments that realise a placement: ``vllm`` follows ``vllm serve``, ``sglang`` follows
    ``python -m sglang.launch_server`` (empty: SGLang has no launch for it, e.g. a TPU slice); ``env`` is
    the environment of the first node's process. ``checkpoint`` is what both load; ``quantization`` the
    ``--quantization`` method they apply on the fly, if any."""

    vllm: tuple[str, ...]
    sglang: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    checkpoint: str | None = None
    quantization: str | None = None


@dataclass(frozen=True, slots=True)
class Weights:
    """What the engines load for weights in a dtype: the ``checkpoint``, the ``--dtype`` they compute in,
    and the ``--quantization`` method applied while loading (None: none, or the checkpoint's config names
    its own method, which both engines read)."""

    checkpoint: str
    engine_dtype: str
    quantization: str | None


class NoCheckpoint(ValueError):
    """Weights in a dtype that needs a pre-quantised checkpoint the catalog does not list."""


# -- the ring -----------------------------------------------------------------------------------


def _ring_key(matrix: LinkMatrix, cycle: Sequence[int]) -> tuple[int, int, int]:
    """(weakest hop's link rank, NVLinks summed over the hops, link ranks summed over the hops)."""
    weakest = 1 << 30
    nv_total = 0
    rank_total = 0
    for position, a in enumerate(cycle):
        b = cycle[(position + 1) % len(cycle)]
        link = matrix.links[a][b]
        rank = link_rank(link)
        weakest = min(weakest, rank)
        nv_total += link.nv_links
        rank_total += rank
    return weakest, nv_total, rank_total


@lru_cache(maxsize=1024)
def _ring(matrix: LinkMatrix, ordered: tuple[int, ...]) -> tuple[int, ...]:
    first, rest = ordered[0], ordered[1:]
    links = {matrix.links[a][b] for a, b in itertools.combinations(ordered, 2)}
    if len(links) == 1:  # every pair alike (NVSwitch): every ring is as good, keep the index order
        return ordered
    if len(ordered) <= BRUTE_FORCE_MAX_GPUS:
        best = ordered
        best_key = _ring_key(matrix, ordered)
        # `rest` is sorted, so permutations come in lexicographic order and the first best one wins.
        for perm in itertools.permutations(rest):
            if perm[0] > perm[-1]:  # the mirror image of a ring already seen (same hops, reversed)
                continue
            cycle = (first, *perm)
            key = _ring_key(matrix, cycle)
            if key > best_key:
                best, best_key = cycle, key
        return best
    path = [first]
    left = set(rest)
    while left:
        here = path[-1]
        following = max(left, key=lambda j: (link_rank(matrix.links[here][j]), -j))
        path.append(following)
        left.remove(following)
    return tuple(path)


def ring_order(matrix: LinkMatrix, indices: Sequence[int]) -> tuple[int, ...]:
    """The GPUs of ``indices`` in the order of their best ring (a Hamiltonian cycle over them).

    Best, in order: the highest ``link_rank`` on the weakest hop (an NV hop beats any PCIe hop, NV12
    beats NV6, PIX beats SYS); then the most NVLinks summed over the hops; then the highest link rank
    summed over the hops (grades PCIe-only rings); then the lexicographically first ring starting at
    the lowest index (a ring and its mirror image are one ring). Up to ``BRUTE_FORCE_MAX_GPUS`` GPUs
    every ring is tried; above, a greedy walk from the lowest index to the best-linked unvisited GPU.
    Two or three GPUs have one ring only: they come back sorted.

    Raises ``ValueError`` for a repeated index or one outside the node.
    """
    gpus = tuple(indices)
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"GPU indices repeat: {list(gpus)}")
    outside = sorted(i for i in gpus if not 0 <= i < matrix.gpu_count)
    if outside:
        raise ValueError(f"GPUs {outside} are not on this {matrix.gpu_count}-GPU node")
    ordered = tuple(sorted(gpus))
    if len(ordered) <= 3:
        return ordered
    return _ring(matrix, ordered)


# -- the binding --------------------------------------------------------------------------------


def _gpu_numa(profile: NodeProfile, index: int) -> int | None:
    """The GPU's NUMA node: the accelerator's own record, else the link matrix's NUMA column."""
    for accelerator in profile.accelerators:
        if accelerator.index == index and accelerator.numa_node is not None:
            return accelerator.numa_node
    return profile.links.numa[index] if index < len(profile.links.numa) else None


def _numa_cpus(profile: NodeProfile, numa: int, gpus: Sequence[int]) -> str | None:
    """The CPU list of NUMA node ``numa``: the CPU affinity printed for the replica's GPUs, else for any
    other GPU of the node on that NUMA node (they share it); where the printed lists differ, the CPUs
    they have in common. None when no GPU on that NUMA node has a known affinity."""
    by_index = {a.index: a for a in profile.accelerators}
    known = [by_index[i].cpu_affinity for i in gpus if i in by_index and by_index[i].cpu_affinity]
    if not known:
        known = [a.cpu_affinity for a in profile.accelerators if a.cpu_affinity and _gpu_numa(profile, a.index) == numa]
    texts = sorted({text for text in known if text})
    if not texts:
        return None
    if len(texts) == 1:
        return texts[0]
    lists = [parse_int_list(text) for text in texts]
    if any(cpus is None for cpus in lists):
        return None
    common = set.intersection(*(set(cpus or ()) for cpus in lists))
    return cpu_list(sorted(common)) if common else None


def bind(decision: Decision, nodes: Mapping[str, NodeProfile]) -> tuple[NodeBinding, ...]:
    """One ``NodeBinding`` per node the placed GPU decision uses, nodes in rank order (first seen).

    Each TP group's GPUs on a node go along their ``ring_order``; with pipeline stages a node holding
    several stages gets one binding with stage 0's GPUs first, then stage 1's, and so on. A rejected
    decision or a TPU slice binds nothing (no CUDA devices): ``()``.

    Raises ``ValueError`` when the decision names a node missing from ``nodes`` (the caller hands in
    the profiles the decision was made on, so that is a bug, not an outcome).
    """
    if not decision.placed or decision.tpu is not None or decision.backend == "tpu":
        return ()
    stages = decision.stages or (decision.accelerators,)
    per_node: dict[str, list[list[int]]] = {}
    for stage in stages:
        on_node: dict[str, list[int]] = {}
        for accelerator in stage:
            parsed = AcceleratorId.parse(accelerator)
            if parsed.gpu_index is None:  # a TPU chip id: nothing CUDA can bind
                return ()
            on_node.setdefault(parsed.host, []).append(parsed.gpu_index)
        for node, gpus in on_node.items():
            per_node.setdefault(node, []).append(gpus)
    bindings: list[NodeBinding] = []
    for node, groups in per_node.items():
        profile = nodes.get(node)
        if profile is None:
            raise ValueError(f"decision {decision.request_id}: node {node!r} has no profile")
        order = tuple(gpu for group in groups for gpu in ring_order(profile.links, group))
        numas = {_gpu_numa(profile, gpu) for gpu in order}
        numa = numas.pop() if len(numas) == 1 else None
        bindings.append(
            NodeBinding(
                node=node,
                cuda_visible_devices=",".join(str(gpu) for gpu in order),
                tp_rank_order=order,
                numa_node=numa,
                cpu_set=_numa_cpus(profile, numa, order) if numa is not None else None,
            )
        )
    return tuple(bindings)


# -- the engine arguments -----------------------------------------------------------------------

_HF_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

# --dtype: both engines take the same names (vLLM ModelDType; SGLang server_args `dtype` choices:
# auto, half, float16, bfloat16, float, float32). Quantised weights compute in bf16 (dtypes.compute_dtype).
_ENGINE_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# --kv-cache-dtype. vLLM (vllm/config/cache.py CacheDType; docs.vllm.ai engine args): "auto" = the
# model's dtype, "fp8" (= fp8_e4m3) on CUDA 11.8+, "nvfp4" for 4-bit (v0.21+, Blackwell). SGLang
# (python/sglang/srt/server_args.py `kv_cache_dtype`: auto, fp8_e5m2, fp8_e4m3, ..., fp4_e2m1) has
# no bare "fp8": fp8_e4m3 is vLLM's fp8. Every 16/32-bit KV is "auto" (the model's 16-bit dtype: the
# same bytes as the ledger holds for bf16/fp16). Neither engine has a stable int8 KV cache: int8 is
# emitted as fp8, which takes the same one byte per element the ledger reserved; int4 likewise as fp4.
_VLLM_KV = {"fp8": "fp8", "int8": "fp8", "fp4": "nvfp4", "int4": "nvfp4"}
_SGLANG_KV = {"fp8": "fp8_e4m3", "int8": "fp8_e4m3", "fp4": "fp4_e2m1", "int4": "fp4_e2m1"}


def vllm_kv_cache_dtype(kv_dtype: str) -> str:
    """vLLM's ``--kv-cache-dtype`` for a hetsched KV dtype (``ValueError`` for an unknown one)."""
    dtype_bytes(kv_dtype)  # validates the name
    return _VLLM_KV.get(kv_dtype, "auto")


def sglang_kv_cache_dtype(kv_dtype: str) -> str:
    """SGLang's ``--kv-cache-dtype`` for a hetsched KV dtype (``ValueError`` for an unknown one)."""
    dtype_bytes(kv_dtype)
    return _SGLANG_KV.get(kv_dtype, "auto")


def _engine_dtype(dtype: str) -> str:
    return _ENGINE_DTYPE[compute_dtype(dtype)]


def checkpoint_id(model: ModelSpec) -> str:
    """The model's own checkpoint: the Hugging Face repo the catalog's ``source`` starts with
    ("meta-llama/Meta-Llama-3-70B config.json (...)"), else the catalog name."""
    head = model.source.split(maxsplit=1)[0] if model.source.strip() else ""
    return head if _HF_REPO.fullmatch(head) else model.name


_PREQUANTISED_ONLY = frozenset({"int8", "int4", "fp4"})


def weights_for(model: ModelSpec, dtype: str) -> Weights:
    """What the engines load for ``model``'s weights in ``dtype``, in this order:

    1. a checkpoint the catalog lists for ``dtype`` (``checkpoints``): loaded as it is, its config naming
       its quantisation method; a quantised one computes in the dtype its config says (``--dtype auto``:
       AWQ/GPTQ kernels that take only float16 would refuse bfloat16), a 16-bit one in ``dtype``;
    2. ``dtype`` is the catalog's ``dtype``, or 16/32-bit: the model's own checkpoint, converted by ``--dtype``;
    3. fp8 on a 16-bit checkpoint: the model's own checkpoint with ``--quantization fp8`` (both engines
       quantise to fp8 while loading);
    4. int8, int4, fp4: ``NoCheckpoint``. Neither engine quantises a 16-bit checkpoint to these as it loads
       in a way the ledger's bytes describe, and loading the 16-bit one would need 2-4x the HBM reserved.
    """
    listed = model.checkpoint_for(dtype)
    if listed is not None:
        quantised = dtype_bytes(dtype) < 2
        return Weights(listed, "auto" if quantised else _engine_dtype(dtype), None)
    own = checkpoint_id(model)
    if dtype == model.dtype or dtype_bytes(dtype) >= 2:
        return Weights(own, _engine_dtype(dtype), None)
    if dtype == "fp8":
        return Weights(own, _engine_dtype(dtype), "fp8")
    if dtype in _PREQUANTISED_ONLY:
        raise NoCheckpoint(
            f"{model.name} has no {dtype} checkpoint in the catalog (models.yaml `checkpoints.{dtype}`): {dtype} "
            f"weights need a pre-quantised checkpoint, and the {model.dtype} one would need more HBM than placed"
        )
    raise ValueError(f"unknown weights dtype {dtype!r}")


def memory_fraction(share_bytes: int, hbm_bytes: int) -> str:
    """``share_bytes / hbm_bytes`` rounded DOWN to three decimals, as text ("0.254").

    Rounded down so the engine never takes more than the ledger reserved for it. Exact integer
    arithmetic: floor(share x 1000 / hbm). ``ValueError`` when the share is not a positive part of
    the device (0 after rounding, or more than the whole HBM).
    """
    if hbm_bytes <= 0:
        raise ValueError(f"device HBM must be positive, got {hbm_bytes}")
    thousandths = share_bytes * 1000 // hbm_bytes
    if thousandths <= 0 or share_bytes > hbm_bytes:  # a byte over the device still floors to 1.000
        raise ValueError(f"a share of {share_bytes} bytes is not a usable fraction of {hbm_bytes} bytes")
    return f"{thousandths // 1000}.{thousandths % 1000:03d}"


def launch(
    decision: Decision,
    *,
    model: ModelSpec,
    hbm_bytes: int,
    context_tokens: int,
    concurrency: int,
    dtype: str,
    kv_dtype: str,
    bindings: Sequence[NodeBinding],
) -> Launch:
    """The vLLM and SGLang arguments for a placed decision, and the first node's environment.

    Sizes: TP = ``decision.tp`` (GPUs per stage), PP = ``decision.pp`` (given only when > 1). Memory:
    the ledger's share per accelerator (``decision.share.total``) over the device's HBM, rounded down
    to three decimals (``memory_fraction``), as vLLM's ``--gpu-memory-utilization`` (a per-instance
    limit, so replicas sharing a GPU each get their own) and SGLang's ``--mem-fraction-static``.
    Context and concurrency become the maximum model length and running sequences; the weights come from
    ``weights_for`` (a listed pre-quantised checkpoint, or ``--quantization fp8`` on a 16-bit one).

    The model is vLLM's positional ``model_tag``: ``vllm serve --model`` is deprecated and was an error
    in vLLM 0.8-0.9 (vllm-project/vllm#17944, #39506).

    ``env``: ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (CUDA numbers GPUs fastest-first by default; the
    binding's indices are nvidia-smi's, which follow the PCI bus order) and the first binding's
    ``CUDA_VISIBLE_DEVICES``. No NCCL variables: NCCL reads the same NVLink/PCIe topology itself, and
    forcing paths (NCCL_P2P_LEVEL, NCCL_ALGO) only ever removes its options.

    Raises ``ValueError`` for a decision without a share or a share that is no fraction of the device,
    ``NoCheckpoint`` (a ``ValueError``) for weights that need a checkpoint the catalog does not list.
    """
    if decision.share is None:
        raise ValueError(f"decision {decision.request_id} holds no share: nothing to launch")
    stages = decision.stages or (decision.accelerators,)
    tp = decision.tp or len(stages[0])
    pp = max(decision.pp, 1)
    fraction = memory_fraction(decision.share.total, hbm_bytes)
    weights = weights_for(model, dtype)
    checkpoint = weights.checkpoint
    engine_dtype = weights.engine_dtype
    quantize = ("--quantization", weights.quantization) if weights.quantization else ()

    vllm: list[str] = [checkpoint, "--tensor-parallel-size", str(tp)]
    if pp > 1:
        vllm += ["--pipeline-parallel-size", str(pp)]
    vllm += [
        "--gpu-memory-utilization",
        fraction,
        "--max-model-len",
        str(context_tokens),
        "--max-num-seqs",
        str(concurrency),
        "--dtype",
        engine_dtype,
        "--kv-cache-dtype",
        vllm_kv_cache_dtype(kv_dtype),
        *quantize,
    ]

    # SGLang flag names: python/sglang/srt/server_args.py (tp_size -> --tp-size, pp_size -> --pp-size,
    # mem_fraction_static, context_length, max_running_requests, dtype, kv_cache_dtype, quantization).
    sglang: list[str] = ["--model-path", checkpoint, "--tp-size", str(tp)]
    if pp > 1:
        sglang += ["--pp-size", str(pp)]
    sglang += [
        "--mem-fraction-static",
        fraction,
        "--context-length",
        str(context_tokens),
        "--max-running-requests",
        str(concurrency),
        "--dtype",
        engine_dtype,
        "--kv-cache-dtype",
        sglang_kv_cache_dtype(kv_dtype),
        *quantize,
    ]

    env: dict[str, str] = {}
    if bindings:
        env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": bindings[0].cuda_visible_devices}
    return Launch(
        vllm=tuple(vllm),
        sglang=tuple(sglang),
        env=env,
        checkpoint=checkpoint,
        quantization=weights.quantization,
    )


def tpu_launch(
    decision: Decision,
    *,
    model: ModelSpec,
    hbm_per_chip: int | None,
    context_tokens: int,
    concurrency: int,
    dtype: str,
    kv_dtype: str,
) -> Launch:
    """vLLM's arguments for a placed TPU slice (vLLM TPU: https://docs.vllm.ai/projects/tpu/en/latest/).

    The slice's chips are one tensor-parallel group: ``--tensor-parallel-size`` = chips in the slice (the
    vLLM TPU quickstart serves a v6e-8 host with ``--tensor-parallel-size 8``). Memory, context,
    concurrency, dtype and the weights as on GPUs; the fraction is of one chip's HBM (vLLM TPU sizes its
    KV cache by ``--gpu-memory-utilization`` as on GPUs), left out when the chip's HBM is unknown.
    ``env``: ``PJRT_DEVICE=TPU``, the PyTorch/XLA runtime's device selector
    (https://docs.pytorch.org/xla/master/runtime.html), which vLLM's PyTorch/XLA TPU backend reads; the
    JAX backend ignores it. No SGLang arguments (``sglang`` empty): SGLang serves GPUs here.

    Raises ``ValueError`` for a decision without a slice or share, a KV dtype vLLM TPU has no cache for
    (4-bit), and ``NoCheckpoint`` as ``launch`` does.
    """
    if decision.tpu is None or decision.share is None:
        raise ValueError(f"decision {decision.request_id} holds no TPU slice: nothing to launch on TPU")
    chips = len(decision.tpu.chips) or prod(decision.tpu.shape)
    weights = weights_for(model, dtype)
    kv = vllm_kv_cache_dtype(kv_dtype)
    if kv not in ("auto", "fp8"):
        raise ValueError(f"vLLM TPU has no {kv_dtype} KV cache")
    vllm: list[str] = [weights.checkpoint, "--tensor-parallel-size", str(chips)]
    if hbm_per_chip:
        vllm += ["--gpu-memory-utilization", memory_fraction(decision.share.total, hbm_per_chip)]
    vllm += [
        "--max-model-len",
        str(context_tokens),
        "--max-num-seqs",
        str(concurrency),
        "--dtype",
        weights.engine_dtype,
        "--kv-cache-dtype",
        kv,
    ]
    if weights.quantization:
        vllm += ["--quantization", weights.quantization]
    return Launch(
        vllm=tuple(vllm),
        sglang=(),
        env={"PJRT_DEVICE": "TPU"},
        checkpoint=weights.checkpoint,
        quantization=weights.quantization,
    )
