"""The fallback ladder (API.md ``fallbacks``; the brief's order): when the exact request fits nowhere,

1. ``kv_quantize``: the KV cache in fp8 (one byte per element) instead of the request's 16-bit dtype;
2. ``pipeline``: pipeline stages, each an NVLink clique of ``tp`` idle GPUs (e.g. TP=4 x PP=2 on a 4+4
   node), on one node or on nodes of one cluster; every stage holds 1/pp of the layers (weights and
   KV), and every stage boundary costs a hop of the batch's activations per token;
3. ``cross_domain``: one TP group over several NVLink domains of a node, when the share of its TP
   traffic that crosses domains is at most ``max_fraction`` (0.2, the brief's limit) and the cluster's
   cross-domain budget (256 GB/s, weighted by SLO: tight SLOs may use all of it, batch work half) holds it;
4. ``queue``: refused for capacity, but the service may queue it (``Decision.queueable``).

Each step is tried on its own against the same snapshot, in the order the request gives (absent: all
four in this order; ``[]``: the exact request or a rejection). The step that fits is named in
``Decision.fallback`` and priced in the explanation. docs/PLACEMENT.md has the arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Final

from shared.domain.fleet import cluster_key
from shared.domain.hardware import Sku
from shared.domain.memory import DEFAULT_WORKSPACE_BYTES, MemoryShare, dtype_bytes, per_accelerator_share
from shared.domain.models import ModelSpec
from shared.domain.placement.filters.demand import gpu_share, tp_fits_heads
from shared.domain.placement.filters.hbm import with_room
from shared.domain.placement.filters.nvlink_group import best_group, fabric_group
from shared.domain.placement.filters.pcie_budget import GB_PER_S_PER_LANE
from shared.domain.placement.filters.pcie_load import NAME as PCIE_LOAD
from shared.domain.placement.framework import (
    GB,
    Candidate,
    Code,
    CycleState,
    Demand,
    Framework,
    StateKey,
    typed_config,
)
from shared.domain.placement.hosts import GpuHost, GpuLoad, HostKind, SnapshotIndex
from shared.domain.placement.perf import Perf, perf_of
from shared.domain.placement.types import FALLBACKS, Decision, ErrorCode, FleetSnapshot, PlacementRequest
from shared.domain.topology.tpu import TpuGrid

NAME: Final = "ladder"
PP_DEGREES: Final = (2, 4, 8)
ACTIVATION_BYTES: Final = 2  # activations cross stage boundaries and all-reduces in 16-bit
NIC_BYTES_PER_S: Final = 50e9  # a 400 Gb/s NIC between nodes (stages on two nodes)
HOP_OVERHEAD_MS: Final = 0.01  # a send/receive launch per stage boundary and step
WEIGHT_LOAD_BYTES_PER_S: Final = 5e9  # the brief: cold loads budgeted at about 5 GB/s per GPU


@dataclass(frozen=True, slots=True)
class LadderConfig:
    """Defaults from the brief; the service may override them (profile config ``ladder``)."""

    cross_domain_budget_bytes_per_s: float = 256e9  # per cluster: 80% of 8 NDR IB links
    cross_domain_warn: float = 0.9  # note when a cluster passes 90% of its budget
    cross_domain_max_fraction: float = 0.2  # at most 20% of a replica's TP traffic crosses domains
    tight_slo_tpot_ms: float = 50.0  # an SLO at or under this is "tight"
    weight_tight: float = 1.0  # share of the budget each class of work may fill
    weight_default: float = 0.8
    weight_batch: float = 0.5


def ladder_config(raw: Mapping[str, object]) -> LadderConfig:
    return typed_config(LadderConfig, NAME, raw) if raw else _DEFAULTS  # most profiles set none: no validation


_DEFAULTS: Final = LadderConfig()


FIXED_REASONS: Final = frozenset(
    code.value
    for code in (
        Code.BACKEND_UNSUPPORTED,
        Code.SKU_NOT_ALLOWED,
        Code.REGION_MISMATCH,
        Code.FORBIDDEN,
        Code.NO_TPU_SHAPE,
    )
)
"""Refusals of the host-scope filters: a host's fixed facts, which neither a fallback nor time changes."""

Exact = Callable[[PlacementRequest], Decision]
Fits = Callable[[PlacementRequest], bool]
"""Whether ``Exact`` would place the request (the same filters, no scores, no explanation)."""
OnEmpty = Callable[[PlacementRequest], bool]
"""Whether the request would be placed on the fleet emptied (``emptied``): the queue step's question."""


def emptied(snapshot: FleetSnapshot) -> FleetSnapshot:
    """The same fleet with nothing reserved, no rack power drawn, no TPU chip taken, no cross-domain
    traffic and quiet PCIe: what "it would fit once capacity frees" is judged against. Kept in the
    snapshot's frame, which the snapshots ``apply`` and ``evolve`` derive from it (and it from its
    ancestors) share while the fleet's frame stays: a refusal under load does not rebuild it."""
    frame = snapshot._memo.frame
    if frame.empty is None:
        capacity = {a: replace(c, reserved=0, shared=False) for a, c in snapshot.capacity.items()}
        pods = {n: replace(p, grid=TpuGrid.empty(p.grid.tpu_type, p.pod.shape)) for n, p in snapshot.tpu_pods.items()}
        frame.empty = FleetSnapshot(
            snapshot.nodes,
            capacity,
            snapshot.racks,
            {},
            pods,
            snapshot.skus,
            snapshot.models,
            {},
            {},
            snapshot.known_regions,
        )
    return frame.empty


def with_fallbacks(
    snapshot: FleetSnapshot,
    request: PlacementRequest,
    exact: Exact,
    framework: Framework,
    state: CycleState,
    demand: Demand,
    index: SnapshotIndex,
    config: LadderConfig,
    on_empty: OnEmpty | None = None,
    fits: Fits | None = None,
) -> Decision:
    """``exact(request)`` or, refused for capacity, the first fallback step that fits. ``fits``, when
    given, answers for ``exact`` whether a variant of the request (the KV quantised) is placed, so a
    variant that fits nowhere costs a screen, not a refusal with its explanation."""
    if (request.pp or 1) > 1:  # a fixed pipeline depth: the pipeline search is the exact request
        staged = pipeline(snapshot, framework, state, demand, index, pp_degrees=(request.pp or 1,))
        first = staged if isinstance(staged, Decision) else _refused(request, [staged])
        steps = [s for s in (FALLBACKS if request.fallbacks is None else request.fallbacks) if s == "queue"]
    else:
        first = exact(request)
        steps = list(FALLBACKS if request.fallbacks is None else request.fallbacks)
    if first.placed or first.error_code is not ErrorCode.NO_CAPACITY:
        return first
    if first.rejections and all(r.reason in FIXED_REASONS for r in first.rejections):
        # Every host is refused for what it is (backend, SKU, region, rights, TPU shape), not for what
        # it holds: no fallback changes that, and an empty fleet would refuse it alike.
        line = "fallbacks: none can help, every host is refused for its fixed facts, not for capacity"
        return replace(first, explanation=(*first.explanation, line))
    tried: list[str] = []
    for step in steps:
        if step == "kv_quantize":
            narrower = _quantised(demand.kv_dtype)
            if narrower is None:
                tried.append(f"fallback kv_quantize: KV is {demand.kv_dtype} already, nothing narrower")
                continue
            quantised = replace(request, kv_dtype=narrower, fallbacks=())
            if fits is None or fits(quantised):
                decision = exact(quantised)
                if decision.placed:
                    return _kv_quantised(decision, demand, narrower)
            tried.append(f"fallback kv_quantize: KV in {narrower} fits nowhere either")
        elif step == "pipeline":
            if request.sharing == "shared":
                tried.append("fallback pipeline: not for shared (single-GPU) replicas")
                continue
            staged = pipeline(snapshot, framework, state, demand, index, pp_degrees=PP_DEGREES)
            if isinstance(staged, Decision):
                return staged
            tried.append(f"fallback pipeline: {staged}")
        elif step == "cross_domain":
            if request.sharing == "shared":
                tried.append("fallback cross_domain: not for shared (single-GPU) replicas")
                continue
            spread = cross_domain(snapshot, framework, state, demand, index, config)
            if isinstance(spread, Decision):
                return spread
            tried.append(f"fallback cross_domain: {spread}")
        elif step == "queue":
            # Only what would fit once capacity frees waits: on the same fleet with nothing reserved.
            if on_empty is not None:
                others = tuple(s for s in steps if s != "queue")
                ever = on_empty(replace(request, fallbacks=others, request_id=f"{request.request_id}/empty"))
                if not ever:
                    tried.append("fallback queue: not even an empty fleet holds it, so it would wait in vain")
                    continue
            return replace(
                first,
                queueable=True,
                explanation=(
                    *first.explanation,
                    *tried,
                    "fallback queue: nothing fits now; the request may wait for capacity (it reserves nothing)",
                ),
            )
    return replace(first, explanation=(*first.explanation, *tried)) if tried else first


def _refused(request: PlacementRequest, reasons: Sequence[str]) -> Decision:
    message = f"no placement: {'; '.join(reasons)}"
    return Decision(
        request_id=request.request_id,
        status="rejected",
        error_code=ErrorCode.NO_CAPACITY,
        message=message,
        explanation=(message,),
        sharing=request.sharing,
    )


# -- kv_quantize ---------------------------------------------------------------------------------


def _quantised(kv_dtype: str) -> str | None:
    """The narrower KV dtype to try: fp8 for a wider one (the brief: fp8/int8; one byte either way)."""
    return "fp8" if dtype_bytes(kv_dtype) > 1 else None


def _kv_quantised(decision: Decision, demand: Demand, narrower: str) -> Decision:
    share = decision.share
    assert share is not None and decision.tp is not None
    before = per_accelerator_share(
        demand.model,
        tp=decision.tp,
        dtype=demand.dtype,
        kv_dtype=demand.kv_dtype,
        context_tokens=demand.request.context_tokens,
        concurrency=demand.request.concurrency,
    )
    line = (
        f"fallback kv_quantize: KV cache quantised {demand.kv_dtype} -> {narrower}: fits at TP={decision.tp} "
        f"(KV {before.kv / GB:.1f} -> {share.kv / GB:.1f} GB per GPU; the cost: 8-bit KV, a small accuracy loss)"
    )
    return replace(decision, fallback="kv_quantize", explanation=(line, *decision.explanation))


# -- pipeline -----------------------------------------------------------------------------------


def stage_share(demand: Demand, tp: int, pp: int) -> MemoryShare:
    """What each GPU of a TP=tp x PP=pp replica holds: 1/pp of the layers' weights and KV (rounded up),
    and the activation peak and workspace of a TP=tp group (each stage runs the full batch)."""
    request = demand.request
    return _stage_share(
        demand.model, demand.dtype, demand.kv_dtype, request.context_tokens, request.concurrency, tp, pp
    )


@lru_cache(maxsize=4096)
def _stage_share(
    model: ModelSpec, dtype: str, kv_dtype: str, context_tokens: int, concurrency: int, tp: int, pp: int
) -> MemoryShare:
    # Pure, and a refusal's pipeline step asks a dozen TP x PP combinations of the same shape: memoised.
    # The whole share at the default workspace is the one the prefilter asked for (also memoised).
    whole = gpu_share(model, tp, dtype, kv_dtype, context_tokens, concurrency, DEFAULT_WORKSPACE_BYTES)
    return MemoryShare(
        weights=-(-whole.weights // pp),
        kv=-(-whole.kv // pp),
        activation=whole.activation,
        workspace=whole.workspace,
    )


def _gpu_classes(framework: Framework, state: CycleState, index: SnapshotIndex) -> list[_GpuClass]:
    """The exclusive load classes of GPU hosts that pass every host-scope filter (backend, SKU, region,
    tenant, PCIe generation) and the PCIe budget (``pcie_load``: a fallback is a cold load too), by
    their lowest host id. The hosts of a class are alike to an exclusive group (the same static facts,
    idle GPUs, rack power headroom and PCIe step), so the searches below run once per class, not once
    per host: a refusal on a full fleet costs the classes, not the fleet. Found once per decision (the
    pipeline and cross-domain steps both ask) and kept in the cycle state."""
    known = state.get(_CLASSES)
    if known is not None and known[0] is index:
        return known[1]
    found = _gpu_classes_of(framework, state, index)
    state.write(_CLASSES, (index, found))
    return found


def _gpu_classes_of(framework: Framework, state: CycleState, index: SnapshotIndex) -> list[_GpuClass]:
    pcie = [f for f in framework.placement_filters if f.name == PCIE_LOAD]
    found: list[_GpuClass] = []
    # Host-scope filters read a host's fixed facts: once per static class (and per decision).
    for static, verdict, _ in framework.host_verdicts(state, index):
        if not isinstance(static.rep, GpuHost) or not verdict.ok:
            continue
        for cls in index.exclusive[static.key]:
            host, load = cls.rep, cls.load
            assert isinstance(host, GpuHost) and isinstance(load, GpuLoad)
            if not load.idle_up:
                continue  # nothing idle: no exclusive group, no stage
            candidate = Candidate(host, load, 0, None)
            if all(f.filter(state, candidate).ok for f in pcie):
                found.append(_GpuClass(host, load, cls.hosts))
    return sorted(found, key=lambda c: c.hosts[0])


@dataclass(frozen=True, slots=True)
class _GpuClass:
    """GPU hosts alike to an exclusive group: ``host`` (the lowest id) and its load speak for ``hosts``."""

    host: GpuHost
    load: GpuLoad
    hosts: tuple[str, ...]


_CLASSES: Final[StateKey[tuple[SnapshotIndex, list[_GpuClass]]]] = StateKey(NAME)
"""The ladder's scratch data in the cycle state: ``_gpu_classes`` of the index it was found on."""


def _cliques(host: GpuHost, load: GpuLoad, tp: int, count: int, need: int) -> list[tuple[int, ...]]:
    """Up to ``count`` disjoint NVLink cliques of ``tp`` idle GPUs with ``need`` bytes each (positions)."""
    positions = with_room(load, need, "exclusive")
    groups: list[tuple[int, ...]] = []
    while len(groups) < count and len(positions) >= tp:
        if host.kind is HostKind.FABRIC:
            group = fabric_group(host, positions, tp)
        else:
            assert host.matrix is not None
            by_index = {host.indices[p]: p for p in positions}
            best = best_group(host.matrix, tuple(by_index), tp)
            if best is None:
                break
            group = tuple(by_index[i] for i in best)
        groups.append(group)
        positions = [p for p in positions if p not in group]
    return groups


def _power_ok(snapshot: FleetSnapshot, chosen: Iterable[tuple[GpuHost, int]]) -> bool:
    """Every chosen GPU is idle and turns busy: each rack's power budget must let all of them draw
    their TDP (counted over every host of the placement: stages may share a rack)."""
    per_rack: dict[tuple[str, str, str], float] = {}
    for host, p in chosen:
        rack = host.racks[host.member_rack[p]]
        per_rack[rack] = per_rack.get(rack, 0.0) + host.sku.tdp_w
    for rack, watts in per_rack.items():
        headroom = snapshot.rack_headroom_w(rack)
        if headroom is not None and watts > headroom:
            return False
    return True


def _link_bytes_per_s(host: GpuHost) -> float:
    return host_link_bytes_per_s(host.sku)


def host_link_bytes_per_s(sku: Sku) -> float:
    """Bytes per second of ``sku``'s PCIe host link (gen 4 x16 when the catalog does not say)."""
    gen = sku.pcie_gen or 4
    return GB_PER_S_PER_LANE.get(gen, GB_PER_S_PER_LANE[max(GB_PER_S_PER_LANE)]) * (sku.pcie_lanes or 16) * 1e9


def pipeline(
    snapshot: FleetSnapshot,
    framework: Framework,
    state: CycleState,
    demand: Demand,
    index: SnapshotIndex,
    *,
    pp_degrees: Sequence[int],
) -> Decision | str:
    """The smallest TP x PP (fewest GPUs, then fewest stages) whose stages fit as NVLink cliques of idle
    GPUs on one node, else on nodes of one cluster (fewest nodes, lowest names); why not, in words."""
    request = demand.request
    if "gpu" not in demand.backends:
        return "the request runs on TPU only (pipelines are for GPU hosts)"
    classes = _gpu_classes(framework, state, index)
    if not classes:
        return "no GPU host with an idle GPU passes the host filters"
    tps = (request.tp,) if request.tp is not None else tuple(sorted(demand.gpu_shares)) or (1,)
    combos: list[tuple[int, int]] = []
    for pp in pp_degrees:
        for tp in tps:
            if request.tp is not None and request.pp is None:
                # A pinned TP that fits nowhere keeps its GPU count, split into stages (TP=8 -> 4 x 2).
                if tp % pp == 0 and tp_fits_heads(demand.model, tp // pp) is None:
                    combos.append((tp // pp, pp))
            else:
                combos.append((tp, pp))
    combos = sorted(set(combos), key=lambda c: (c[0] * c[1], c[1]))
    for tp, pp in combos:
        share = stage_share(demand, tp, pp)
        need = share.total
        # A class holds at most (its idle GPUs with room) // tp disjoint cliques: when even that many
        # fall short of the stages, so do the cliques themselves (the check below), unsearched.
        if sum(sum(1 for free in c.load.exclusive_desc if free >= need) // tp * len(c.hosts) for c in classes) < pp:
            continue
        # Each class's disjoint cliques, searched once for all its hosts (alike: the same positions).
        cliques = [(c, _cliques(c.host, c.load, tp, pp, share.total)) for c in classes]
        cliques = [(c, groups) for c, groups in cliques if groups]
        if sum(len(groups) * len(c.hosts) for c, groups in cliques) < pp:
            continue  # not enough cliques in the whole fleet
        # One node (or one fabric domain) holding every stage: the lowest host id of a class that can.
        for c, groups in cliques:
            if len(groups) == pp and _power_ok(snapshot, ((c.host, p) for g in groups for p in g)):
                return _staged(snapshot, demand, tp, pp, share, [(c.host, g) for g in groups])
        # Several nodes of one cluster, fewest first: take each node's cliques in turn (the nodes with
        # the most cliques first). Only hosts with a clique take part.
        by_cluster: dict[str, list[tuple[int, str, list[tuple[int, ...]]]]] = {}
        for c, groups in cliques:
            for host_id in c.hosts:
                cluster = index.hosts[host_id].cluster or ""
                by_cluster.setdefault(cluster, []).append((-len(groups), host_id, groups))
        for _cluster, members in sorted(by_cluster.items()):
            if sum(len(groups) for _, _, groups in members) < pp:
                continue
            stages: list[tuple[GpuHost, tuple[int, ...]]] = []
            for _, host_id, groups in sorted(members):
                host = index.hosts[host_id]
                assert isinstance(host, GpuHost)
                for group in groups[: pp - len(stages)]:
                    taken = [(h, p) for h, g in stages for p in g]
                    if _power_ok(snapshot, [*taken, *((host, p) for p in group)]):
                        stages.append((host, group))
                if len(stages) == pp:
                    return _staged(snapshot, demand, tp, pp, share, stages)
    tried = ", ".join(f"TP={tp}xPP={pp}" for tp, pp in combos) or "none"
    return f"no set of stages fits (tried {tried})"


def _staged(
    snapshot: FleetSnapshot,
    demand: Demand,
    tp: int,
    pp: int,
    share: MemoryShare,
    stages: Sequence[tuple[GpuHost, tuple[int, ...]]],
) -> Decision:
    ids = tuple(tuple(host.members[p] for p in group) for host, group in stages)
    domains = [host.domains[group[0]] for host, group in stages]
    nodes = tuple(dict.fromkeys(host.nodes[p] for host, group in stages for p in group))
    first_host, first_group = stages[0]
    across_nodes = len({host.id for host, _ in stages}) > 1
    link = NIC_BYTES_PER_S if across_nodes else _link_bytes_per_s(first_host)
    batch = demand.request.concurrency
    hop_bytes = batch * demand.model.hidden * ACTIVATION_BYTES
    hop_ms = hop_bytes / link * 1e3 + HOP_OVERHEAD_MS
    perf = perf_of(demand, first_host.sku, tp)
    added = (pp - 1) * hop_ms
    where = ", ".join(dict.fromkeys(domains))
    line = (
        f"fallback pipeline: TP={tp} x PP={pp} across {where}: +{added:.3f} ms per token "
        f"({pp - 1} stage hop{'s' if pp > 2 else ''} of {hop_bytes / 1e6:.2f} MB over "
        f"{'the NIC' if across_nodes else 'PCIe'} at {link / 1e9:.0f} GB/s, plus {HOP_OVERHEAD_MS} ms each)"
    )
    model = f"{demand.model.name} ({demand.dtype} weights, {demand.kv_dtype} KV)"
    headline = f"placed {model} at TP={tp} x PP={pp} on {', '.join(a for stage in ids for a in stage)}"
    share_line = (
        f"per GPU: weights {share.weights / GB:.1f} GB + KV {share.kv / GB:.1f} GB + activation "
        f"{share.activation / GB:.1f} GB + workspace {share.workspace / GB:.1f} GB = {share.total / GB:.1f} GB "
        f"(each stage holds 1/{pp} of the layers)"
    )
    return Decision(
        request_id=demand.request.request_id,
        status="placed",
        message=headline,
        backend="gpu",
        region=first_host.region,
        cluster=first_host.cluster,
        rack=first_host.racks[first_host.member_rack[first_group[0]]][2],
        node=nodes[0],
        nodes=nodes,
        sku=first_host.sku.name,
        tp=tp,
        accelerators=tuple(a for stage in ids for a in stage),
        domain=domains[0],
        share=share,
        explanation=(headline, line, share_line),
        sharing="exclusive",
        pp=pp,
        stages=ids,
        fallback="pipeline",
        estimate=estimate_of(perf, share, first_host, added_ms=added),
    )


def estimate_of(
    perf: Perf, share: MemoryShare, host: GpuHost, *, added_ms: float = 0.0, slow: float = 1.0
) -> dict[str, float]:
    """``Decision.estimate``: the latency model's figures, ``slow`` times slower (a shared GPU) plus
    ``added_ms`` per token (stage hops), and the cold load of the weights."""
    tpot = perf.tpot_ms * slow + added_ms
    return {
        "ttft_ms": perf.ttft_ms * slow + added_ms,
        "tpot_ms": tpot,
        "tokens_per_s": perf.tokens_per_s * perf.tpot_ms / tpot if tpot > 0 else perf.tokens_per_s,
        "load_time_s": load_time_s(share, host),
    }


def load_time_s(share: MemoryShare, host: GpuHost) -> float:
    """Seconds to load one GPU's weights cold: its bytes over min(5 GB/s budget, its PCIe link)."""
    return weight_load_s(share.weights, host.sku)


def weight_load_s(weight_bytes: int, sku: Sku) -> float:
    """Seconds to load ``weight_bytes`` onto one accelerator of ``sku`` cold: over min(5 GB/s, its PCIe link)."""
    return weight_bytes / min(WEIGHT_LOAD_BYTES_PER_S, host_link_bytes_per_s(sku))


# -- cross_domain -------------------------------------------------------------------------------


def cross_fraction(domains: int, per_domain: int) -> float:
    """Share of a TP group's all-reduce bytes that cross NVLink domains, for a hierarchical all-reduce
    over ``domains`` domains of ``per_domain`` GPUs: reduce-scatter and all-gather inside each domain
    move 2(k-1)/k of the data per GPU; the all-reduce between domains moves 2(d-1)/d of a 1/k shard.
    (d-1)/d / ((k-1) + (d-1)/d): TP=8 over 4+4 -> 14%; TP=4 over 2+2 -> 33%."""
    if domains <= 1:
        return 0.0
    between = (domains - 1) / domains
    return between / ((per_domain - 1) + between)


def tp_traffic_bytes_per_s(demand: Demand, host: GpuHost, tp: int) -> float:
    """All-reduce bytes per second of a TP group: two all-reduces of the hidden state per layer and
    token (16-bit), 2(tp-1) times that over all ring links, at the latency model's decode tokens/s."""
    perf = perf_of(demand, host.sku, tp)
    per_token = demand.model.layers * 2 * 2 * (tp - 1) * demand.model.hidden * ACTIVATION_BYTES
    return per_token * perf.tokens_per_s


def slo_weight(request: PlacementRequest, config: LadderConfig) -> float:
    """How much of the cluster's budget this request may fill: tight SLOs first, batch work last."""
    tpot = request.slo.tpot_ms if request.slo is not None else None
    if tpot is not None and tpot <= config.tight_slo_tpot_ms:
        return config.weight_tight
    if request.preemptible or request.slo is None:
        return config.weight_batch
    return config.weight_default


def cross_domain(
    snapshot: FleetSnapshot,
    framework: Framework,
    state: CycleState,
    demand: Demand,
    index: SnapshotIndex,
    config: LadderConfig,
) -> Decision | str:
    """A TP group over the fewest NVLink domains of one node (whole domains, the fullest first) whose
    cross-domain traffic fits the rules; why not, in words."""
    request = demand.request
    if "gpu" not in demand.backends:
        return "the request runs on TPU only (cross-domain groups are for GPU hosts)"
    classes = [c for c in _gpu_classes(framework, state, index) if c.host.kind is HostKind.NODE]
    reasons: list[str] = []
    budget = config.cross_domain_budget_bytes_per_s
    for tp in sorted(t for t in demand.gpu_shares if t > 1):
        share = demand.gpu_shares[tp]
        best: tuple[GpuHost, list[int], list[str], float, float, float] | None = None  # the lowest host id
        for c in classes:  # the group's shape is the class's; the budget is each host's cluster's
            host, load = c.host, c.load
            positions = with_room(load, share.total, "exclusive")
            if len(positions) < tp:
                continue
            by_domain: dict[str, list[int]] = {}
            for p in positions:
                by_domain.setdefault(host.domains[p], []).append(p)
            first = {d: ps[0] for d, ps in by_domain.items()}
            chosen: list[int] = []
            used_domains: list[str] = []
            for domain in sorted(by_domain, key=lambda d: (-len(by_domain[d]), d)):
                take = by_domain[domain][: tp - len(chosen)]
                chosen.extend(take)
                used_domains.append(domain)
                if len(chosen) == tp:
                    break
            if len(used_domains) < 2 or not _power_ok(snapshot, ((host, p) for p in chosen)):
                continue
            per_domain = min(sum(1 for p in chosen if host.domains[p] == d) for d in used_domains)
            fraction = cross_fraction(len(used_domains), per_domain)
            if fraction > config.cross_domain_max_fraction:
                reasons.append(
                    f"TP={tp} over {len(used_domains)} domains of {host.id} would send {fraction:.0%} of its "
                    f"TP traffic across domains (limit {config.cross_domain_max_fraction:.0%})"
                )
                continue
            cross = tp_traffic_bytes_per_s(demand, host, tp) * fraction
            cap = budget * slo_weight(request, config)
            for host_id in c.hosts:  # the class's lowest host id whose cluster's budget has room
                member = index.hosts[host_id]
                assert isinstance(member, GpuHost)
                cluster = cluster_key(member.region, member.cluster)
                used = snapshot.cross_domain_used.get(cluster, 0.0)
                if used + cross > cap:
                    reasons.append(
                        f"cluster {cluster}'s cross-domain budget is spent: {used / 1e9:.1f} GB/s in use + "
                        f"{cross / 1e9:.1f} GB/s > {cap / 1e9:.0f} GB/s ({slo_weight(request, config):.0%} of "
                        f"{budget / 1e9:.0f} GB/s for this SLO class)"
                    )
                    continue
                if best is None or host_id < best[0].id:
                    # The member's own domain names, in the order the representative's were taken.
                    named = [member.domains[first[d]] for d in used_domains]
                    best = (member, chosen, named, fraction, cross, used)
                break
        if best is not None:
            member, chosen, named, fraction, cross, used = best
            return _spread(demand, member, tp, share, chosen, named, fraction, cross, used, config)
    if not reasons:
        return "no node has enough idle GPUs with room across its NVLink domains"
    return "; ".join(dict.fromkeys(reasons))


def _spread(
    demand: Demand,
    host: GpuHost,
    tp: int,
    share: MemoryShare,
    chosen: list[int],
    domains: list[str],
    fraction: float,
    cross: float,
    used: float,
    config: LadderConfig,
) -> Decision:
    accelerators = tuple(host.members[p] for p in sorted(chosen, key=lambda p: (host.domains[p], host.indices[p])))
    budget = config.cross_domain_budget_bytes_per_s
    after = used + cross
    line = (
        f"fallback cross_domain: TP={tp} across {len(domains)} NVLink domains of {host.id} "
        f"({', '.join(domains)}): {cross / 1e9:.2f} GB/s crosses domains ({fraction:.0%} of its TP traffic); "
        f"cluster {cluster_key(host.region, host.cluster)} at {after / 1e9:.1f} of {budget / 1e9:.0f} GB/s"
    )
    lines = [line]
    if after > config.cross_domain_warn * budget:
        lines.append(
            f"warning: cluster {host.cluster} is past {config.cross_domain_warn:.0%} of its cross-domain budget"
        )
    perf = perf_of(demand, host.sku, tp)
    model = f"{demand.model.name} ({demand.dtype} weights, {demand.kv_dtype} KV)"
    headline = f"placed {model} at TP={tp} on {', '.join(accelerators)} ({host.sku.name}, across NVLink domains)"
    return Decision(
        request_id=demand.request.request_id,
        status="placed",
        message=headline,
        backend="gpu",
        region=host.region,
        cluster=host.cluster,
        rack=host.racks[host.member_rack[chosen[0]]][2],
        node=host.nodes[chosen[0]],
        nodes=(host.nodes[chosen[0]],),
        sku=host.sku.name,
        tp=tp,
        accelerators=accelerators,
        domain=domains[0],
        share=share,
        explanation=(headline, *lines),
        sharing="exclusive",
        fallback="cross_domain",
        cross_domain_bytes_per_s=cross,
        estimate=estimate_of(perf, share, host),
    )


__all__ = [
    "LadderConfig",
    "cross_fraction",
    "estimate_of",
    "ladder_config",
    "load_time_s",
    "stage_share",
    "with_fallbacks",
]
