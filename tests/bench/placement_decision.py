"""Placement benchmark: pure decision latency on synthetic fleets, and the greedy's optimality gap.

    python -m tests.bench.placement_decision             # 256 and 8,192 GPUs, 60 MILP instances
    python -m tests.bench.placement_decision --quick     # fewer requests and instances

1. Decision latency. A synthetic fleet (``shared.domain.synthetic``, SKUs from shared/catalog) of
   about 256 and about 8,192 GPUs is filled with a realistic request mix (chat-sized 8B replicas,
   70B in fp8 and bf16, MoE, long-context 70B, a pinned TP=8 405B, some with a region, an SKU
   allow-list or an SLO) to 0%, ~30% and ~60% of its HBM; at each level ``decide`` runs on a fresh
   sample of the mix without applying it, and p50 / p99 are printed in milliseconds (the snapshot's
   index is built before timing: a service keeps it across decisions; its build and the ``apply`` +
   index update per decision are printed separately). Wall-clock and this thread's CPU time are
   both shown: on a shared VM the wall-clock tail includes time the hypervisor gave to others.
2. Greedy vs MILP. Random small instances (1-3 nodes of mixed layouts, 3-8 requests): the greedy
   ``decide`` + ``apply`` loop and the exact MILP are scored with ``tests.reference.milp.objective``; the gap
   (optimal - greedy) / optimal is printed as mean and max over the instances.

It measures and prints; it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from shared.domain.hardware import Sku, parse_sku_catalog
from shared.domain.inventory import parse_inventory
from shared.domain.models import ModelSpec, parse_model_catalog
from shared.domain.placement import FleetSnapshot, PlacementRequest, Slo, apply, decide
from shared.domain.placement.hosts import index_of
from shared.domain.synthetic import synthetic_inventory
from tests.reference.milp import candidate_options, greedy_batch, optimal_batch

CATALOG = Path(__file__).resolve().parents[2] / "shared" / "catalog"
REGIONS = ("us-west-1", "us-east-1", "eu-west-1")


@dataclass(frozen=True)
class Shape:
    """One kind of request in the mix, with its share."""

    share: float
    model: str
    context_tokens: int
    concurrency: int
    input_tokens: int
    output_tokens: int
    dtype: str | None = None
    tp: int | None = None
    backend: str = "any"


MIX = (
    Shape(0.30, "llama3-8b", 8192, 32, 1024, 256),
    Shape(0.15, "llama3-70b", 8192, 16, 2048, 512, dtype="fp8"),
    Shape(0.10, "llama3-70b", 8192, 32, 2048, 512),
    Shape(0.10, "mixtral-8x7b", 16384, 16, 4096, 512),
    Shape(0.05, "llama3.1-70b", 65536, 4, 32768, 1024, dtype="fp8"),
    Shape(0.10, "gemma2-9b", 8192, 16, 1024, 1024),
    Shape(0.10, "mistral-7b-v0.1", 8192, 16, 512, 2048, backend="gpu"),
    Shape(0.05, "llama3-405b", 8192, 8, 2048, 512, dtype="fp8", tp=8),
    Shape(0.05, "llama3-8b", 4096, 8, 512, 512, backend="tpu"),
)


def catalogs() -> tuple[dict[str, Sku], dict[str, ModelSpec]]:
    skus = parse_sku_catalog(yaml.safe_load((CATALOG / "skus.yaml").read_text()))
    models = parse_model_catalog(yaml.safe_load((CATALOG / "models.yaml").read_text()))
    return skus, models


def _gpus(doc: dict[str, Any]) -> int:
    return sum(
        node["gpus"]
        for region in doc["regions"]
        for cluster in region["clusters"]
        for rack in cluster["racks"]
        for node in rack["nodes"]
    )


def fleet_of(gpus: int, seed: int, skus: dict[str, Sku], models: dict[str, ModelSpec]) -> FleetSnapshot:
    """The smallest synthetic fleet (seeded) with at least ``gpus`` GPUs."""
    nodes = max(1, gpus // 8)
    while True:
        doc = synthetic_inventory(nodes=nodes, rng=random.Random(seed), tpu_pods=2)
        if _gpus(doc) >= gpus:
            return FleetSnapshot.from_fleet(parse_inventory(doc, skus=skus), skus=skus, models=models)
        nodes += max(1, (gpus - _gpus(doc)) // 8)


def sample_request(rng: random.Random, i: int) -> PlacementRequest:
    shape = rng.choices(MIX, weights=[s.share for s in MIX])[0]
    roll = rng.random()
    return PlacementRequest(
        request_id=f"bench-{i}",
        tenant=rng.choice(("acme", "globex", "initech")),
        model=shape.model,
        dtype=shape.dtype,
        context_tokens=shape.context_tokens,
        concurrency=shape.concurrency,
        input_tokens=shape.input_tokens,
        output_tokens=shape.output_tokens,
        tp=shape.tp,
        backend=shape.backend,
        region=rng.choice(REGIONS) if roll < 0.2 else None,
        skus=("H100-SXM-80GB", "H200-SXM-141GB") if 0.2 <= roll < 0.3 else None,
        slo=Slo(tpot_ms=60.0) if 0.3 <= roll < 0.4 else None,
    )


def hbm_used(snapshot: FleetSnapshot) -> float:
    usable = sum(c.usable for c in snapshot.capacity.values())
    return sum(c.reserved for c in snapshot.capacity.values()) / usable


def fill(snapshot: FleetSnapshot, target: float, rng: random.Random) -> tuple[FleetSnapshot, list[float]]:
    """Apply decisions from the mix until ``target`` of the HBM is reserved (or 200 refusals in a
    row); returns the snapshot and the seconds each decide + apply + index update took."""
    timings: list[float] = []
    refused = 0
    i = 0
    while hbm_used(snapshot) < target and refused < 200:
        i += 1
        request = sample_request(rng, i)
        start = time.perf_counter()
        decision = decide(snapshot, request)
        snapshot = apply(snapshot, decision)
        index_of(snapshot)
        timings.append(time.perf_counter() - start)
        refused = 0 if decision.placed else refused + 1
    return snapshot, timings


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_decisions(gpus: int, samples: int, seed: int) -> None:
    skus, models = catalogs()
    snapshot = fleet_of(gpus, seed, skus, models)
    start = time.perf_counter()
    index = index_of(snapshot)
    built_ms = (time.perf_counter() - start) * 1e3
    gpu_count, nodes = len(snapshot.capacity), len(snapshot.nodes)
    print(
        f"\n== {gpu_count} GPUs on {nodes} nodes, {len(snapshot.tpu_pods)} TPU pods (index built in {built_ms:.0f} ms)"
    )
    print("  HBM used  classes  placed | decide wall p50    p99   mean | CPU p50    p99 | decide+apply+index p50   p99")
    rng = random.Random(seed)
    for target in (0.0, 0.3, 0.6):
        snapshot, fill_times = fill(snapshot, target, rng)
        index = index_of(snapshot)
        classes = sum(len(c) for c in index.classes.values())
        requests = [sample_request(rng, 10**6 + k) for k in range(samples)]
        times: list[float] = []
        cpu: list[float] = []
        placed = 0
        for request in requests:
            start, start_cpu = time.perf_counter(), time.thread_time()
            decision = decide(snapshot, request)
            times.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
            placed += decision.placed
        loop = (
            f"{percentile(fill_times, 0.5) * 1e3:8.3f} {percentile(fill_times, 0.99) * 1e3:7.3f} ms"
            if fill_times
            else "       (none)"
        )
        print(
            f"  {hbm_used(snapshot):7.1%}  {classes:7d}  {placed / samples:6.1%} | "
            f"{percentile(times, 0.5) * 1e3:12.3f} {percentile(times, 0.99) * 1e3:6.3f} "
            f"{statistics.fmean(times) * 1e3:6.3f} | {percentile(cpu, 0.5) * 1e3:7.3f} "
            f"{percentile(cpu, 0.99) * 1e3:6.3f} | {loop}"
        )


def small_instance(rng: random.Random, skus: dict[str, Sku], models: dict[str, ModelSpec]) -> tuple[Any, Any]:
    layouts = [
        ("H100-SXM-80GB", 8, "nvswitch-8"),
        ("H100-SXM-80GB", 8, "4+4"),
        ("H200-SXM-141GB", 4, "nvswitch-8"),
        ("A100-PCIE-80GB", 4, "pairs"),
        ("L40S-48GB", 4, "pcie"),
    ]
    nodes = []
    for n in range(rng.randint(1, 3)):
        sku, gpus, topology = rng.choice(layouts)
        nodes.append({"name": f"n{n}", "sku": sku, "gpus": gpus, "topology": topology})
    power = rng.choice([None, 4.0, 8.0, 20.0])
    doc = {
        "regions": [
            {"name": "r", "clusters": [{"name": "c", "racks": [{"name": "k", "power_kw": power, "nodes": nodes}]}]}
        ],
        "tpu_pods": [{"name": "pod", "region": "r", "type": "v5e", "shape": [4, 4]}] if rng.random() < 0.3 else [],
    }
    snapshot = FleetSnapshot.from_fleet(parse_inventory(doc, skus=skus), skus=skus, models=models)
    requests = [sample_request(rng, k) for k in range(rng.randint(3, 8))]
    requests = [dataclasses.replace(r, region=None, skus=None, tp=r.tp if r.tp != 8 else None) for r in requests]
    return snapshot, requests


def bench_gap(instances: int, seed: int) -> None:
    skus, models = catalogs()
    rng = random.Random(seed)
    gaps: list[float] = []
    greedy_placed = optimal_placed = requests_total = 0
    solve_s: list[float] = []
    not_proven = 0
    for _ in range(instances):
        snapshot, requests = small_instance(rng, skus, models)
        options = candidate_options(snapshot, requests)
        greedy, _ = greedy_batch(snapshot, requests, options=options)
        start = time.perf_counter()
        best = optimal_batch(snapshot, requests, options=options)
        solve_s.append(time.perf_counter() - start)
        not_proven += not best.optimal
        gaps.append((best.objective - greedy.objective) / best.objective if best.objective > 0 else 0.0)
        greedy_placed += greedy.placed
        optimal_placed += best.placed
        requests_total += len(requests)
    worse = sum(1 for g in gaps if g > 1e-9)
    print(f"\n== greedy vs MILP (HiGHS) on {instances} random small instances, {requests_total} requests")
    print(f"  objective gap (optimal - greedy) / optimal: mean {statistics.fmean(gaps):.2%}, max {max(gaps):.2%}")
    print(f"  instances where the greedy is below the optimum: {worse} of {instances}")
    print(f"  requests placed: greedy {greedy_placed}, MILP {optimal_placed} of {requests_total}")
    print(f"  MILP solve: mean {statistics.fmean(solve_s) * 1e3:.0f} ms, max {max(solve_s) * 1e3:.0f} ms", end="")
    print(f"; {not_proven} not proven optimal" if not_proven else "; all proven optimal")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer samples and instances")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--samples", type=int, default=None, help="decisions timed per fill level")
    parser.add_argument("--instances", type=int, default=None, help="MILP instances (at least 50 for the figure)")
    args = parser.parse_args()
    samples = args.samples or (100 if args.quick else 1000)
    instances = args.instances or (10 if args.quick else 60)
    for gpus in (256, 8192):
        bench_decisions(gpus, samples, args.seed)
    bench_gap(instances, args.seed)


if __name__ == "__main__":
    main()
