"""Placement benchmark: pure decision latency on synthetic fleets, and the greedy's optimality gap.

    python -m tests.bench.placement_decision             # 256 and 8,192 GPUs, 60 MILP instances
    python -m tests.bench.placement_decision --quick     # fewer requests and instances
    python -m tests.bench.placement_decision --gap-only  # part 2 only (--seed N for other instances)

1. Decision latency. A synthetic fleet (``shared.domain.synthetic``, SKUs from shared/catalog) of
   about 256 and about 8,192 GPUs is filled with a realistic request mix (chat-sized 8B replicas,
   70B in fp8 and bf16, MoE, long-context 70B, a pinned TP=8 405B, some with a region, an SKU
   allow-list or an SLO) to 0%, ~30% and ~60% of its HBM; at each level ``decide`` runs on a fresh
   sample of the mix without applying it, and p50 / p99 are printed in milliseconds (the snapshot's
   index is built before timing: a service keeps it across decisions; its build and the ``apply`` +
   index update per decision are printed separately). Wall-clock and this thread's CPU time are
   both shown: on a shared VM the wall-clock tail includes time the hypervisor gave to others.
2. Greedy vs MILP. Random small instances (1-3 nodes of mixed layouts, 3-8 exact-or-nothing
   requests) placed three ways, each scored with ``tests.reference.milp.objective`` against the exact
   MILP: the gap (optimal - placement) / optimal as mean and max over the instances, the instances
   below the optimum and the requests placed. The three rows: *online*, the service's placement
   (``decide`` + ``apply``, one request at a time in arrival order, without seeing later ones);
   *online bound* (``milp.online_bound``), the best any online placement can do, one that never
   refuses a request that still fits and takes the fewest accelerators (its gap to the MILP is the
   price of deciding online, not of the scores); *batch*, ``decide_batch`` with the requests of an
   instance decided together.

It measures and prints; it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
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
from tests.reference.milp import (
    BatchResult,
    candidate_options,
    greedy_batch,
    online_bound,
    optimal_batch,
    planned_batch,
)

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
    # The fleet is long-lived: kept out of the cyclic collector's full passes, as the placement service
    # does once its view is loaded (ReadModel.sync); otherwise a full pass over it lands in some decision.
    gc.collect()
    gc.freeze()
    gpu_count, nodes = len(snapshot.capacity), len(snapshot.nodes)
    print(
        f"\n== {gpu_count} GPUs on {nodes} nodes, {len(snapshot.tpu_pods)} TPU pods (index built in {built_ms:.0f} ms)"
    )
    print("  HBM used  classes  placed | decide wall p50    p99   mean | CPU p50    p99 | decide+apply+index p50   p99")
    rng = random.Random(seed)
    for target in (0.0, 0.3, 0.6):
        snapshot, fill_times = fill(snapshot, target, rng)
        index = index_of(snapshot)
        classes = sum(len(c) for c in index.exclusive.values())  # as exclusive requests see them
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
    # Exact-or-nothing (the MILP does not model the fallback ladder), no region or SKU pins, no TP=8 pin.
    requests = [
        dataclasses.replace(r, region=None, skus=None, tp=r.tp if r.tp != 8 else None, fallbacks=()) for r in requests
    ]
    return snapshot, requests


@dataclass
class _Gaps:
    """One placement's figures against the MILP over the instances."""

    gaps: list[float]
    placed: int = 0
    seconds: float = 0.0
    not_proven: int = 0

    def add(self, result: BatchResult, best: BatchResult, seconds: float) -> None:
        self.gaps.append((best.objective - result.objective) / best.objective if best.objective > 0 else 0.0)
        self.placed += result.placed
        self.seconds += seconds

    def row(self, label: str) -> str:
        n = len(self.gaps)
        below = sum(1 for g in self.gaps if g > 1e-9)
        return (
            f"  {label:<56} {statistics.fmean(self.gaps):6.2%} {max(self.gaps):7.2%} {f'{below}/{n}':>7}"
            f" {self.placed:6d} {self.seconds / n * 1e3:11.0f}"
        )


@contextlib.contextmanager
def _c_stdout_silenced() -> Iterator[None]:
    """HiGHS prints solver chatter straight to file descriptor 1 (not ``sys.stdout``): drop it."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def bench_gap(instances: int, seed: int) -> None:
    skus, models = catalogs()
    rng = random.Random(seed)
    online, bound, batch, exact = _Gaps([]), _Gaps([]), _Gaps([]), _Gaps([])
    requests_total = 0
    with _c_stdout_silenced():
        for _ in range(instances):
            snapshot, requests = small_instance(rng, skus, models)
            options = candidate_options(snapshot, requests)
            start = time.perf_counter()
            best = optimal_batch(snapshot, requests, options=options)
            exact.add(best, best, time.perf_counter() - start)
            exact.not_proven += not best.optimal
            start = time.perf_counter()
            greedy, _ = greedy_batch(snapshot, requests, options=options)
            online.add(greedy, best, time.perf_counter() - start)
            start = time.perf_counter()
            limit = online_bound(snapshot, requests, options=options)
            bound.add(limit, best, time.perf_counter() - start)
            bound.not_proven += not limit.optimal
            start = time.perf_counter()
            planned, _ = planned_batch(snapshot, requests, options=options)
            batch.add(planned, best, time.perf_counter() - start)
            requests_total += len(requests)
    print(f"\n== greedy vs MILP (HiGHS): {instances} random small instances (seed {seed}), {requests_total} requests")
    head = "gap = (MILP objective - objective) / MILP objective"
    print(f"  {head:<56} {'mean':>6} {'max':>7} {'below':>7} {'placed':>6} {'ms/instance':>11}")
    print(online.row("online: decide + apply, one request at a time, in order"))
    print(bound.row("online bound: the best any online placement can do"))
    print(batch.row("batch: decide_batch, the requests decided together"))
    print(exact.row("MILP (HiGHS), exact"))
    unproven = [f"{g.not_proven} {name}" for g, name in ((exact, "MILP"), (bound, "online bound")) if g.not_proven]
    print(f"  not proven optimal within the time limit: {', '.join(unproven)}" if unproven else "  all proven optimal")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer samples and instances")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--samples", type=int, default=None, help="decisions timed per fill level")
    parser.add_argument("--instances", type=int, default=None, help="MILP instances (at least 50 for the figure)")
    parser.add_argument("--gap-only", action="store_true", help="only part 2, greedy vs MILP")
    args = parser.parse_args()
    samples = args.samples or (100 if args.quick else 1000)
    instances = args.instances or (10 if args.quick else 60)
    if not args.gap_only:
        for gpus in (256, 8192):
            bench_decisions(gpus, samples, args.seed)
    bench_gap(instances, args.seed)


if __name__ == "__main__":
    main()
