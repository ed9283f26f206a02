"""Replay 20,000 requests with the `hetsched` policy on the demo fleet and print the wall time.

`python -m tests.bench.sim_replay`. Uses the Azure conversation trace (../shared/data, Patel et al.,
"Splitwise", ISCA 2024, CC-BY 4.0) when present, topped up to 20,000 rows by repeating it shifted in
time, else a synthetic trace generated here. Goal: under 60 s. Prints; never asserts time.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from hetsched.cli.sim.run import DEFAULT_MODEL_MIX, DEFAULT_TENANTS
from shared.domain.placement import FleetSnapshot
from shared.domain.sim import make_policy, simulate
from shared.domain.traces import TraceRequest, assign_workload, detect_format, read_trace, seeded_uniform
from shared.infra.catalog import demo_fleet_path, load_inventory, load_models, load_skus

N = 20_000
AZURE = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces" / "AzureLLMInferenceTrace_conv_2023.csv"


def synthetic(n: int, seed: int = 0) -> list[TraceRequest]:
    """Poisson-ish arrivals at 5.5 req/s with Azure-like token counts."""
    out, at = [], 0.0
    for i in range(n):
        at += -1000.0 / 5.5 * math.log(1.0 - seeded_uniform(seed, i, 0))
        prompt = 50 + int(2300 * seeded_uniform(seed, i, 1) ** 2)
        output = 1 + int(420 * seeded_uniform(seed, i, 2))
        out.append(TraceRequest(arrival_ms=at, input_tokens=prompt, output_tokens=output, row=i + 1))
    return out


def requests() -> tuple[list[TraceRequest], str]:
    if not AZURE.exists():
        return synthetic(N), "synthetic"
    text = AZURE.read_text()
    base = list(read_trace(text, detect_format(text, AZURE.name), on_error="skip").requests)
    span = base[-1].arrival_ms + 1.0
    out = list(base)
    while len(out) < N:
        r = base[len(out) % len(base)]
        out.append(TraceRequest(r.arrival_ms + span, r.input_tokens, r.output_tokens, len(out) + 1))
    return out[:N], f"Azure conv 2023 ({len(base)} rows, topped up)"


def main() -> None:
    skus, models = load_skus(), load_models()
    fleet, _ = load_inventory(demo_fleet_path(), skus=skus)
    snapshot = FleetSnapshot.from_fleet(fleet, skus=skus, models=models)
    trace, source = requests()
    assigned = assign_workload(trace, models=DEFAULT_MODEL_MIX, tenants=DEFAULT_TENANTS, seed=0)
    start = time.perf_counter()
    result = simulate(snapshot, assigned, make_policy("hetsched"), timer=time.perf_counter)
    wall = time.perf_counter() - start
    k = result.kpis
    print(f"trace: {source}; requests: {k.requests}; placed: {k.placed}; SLO attainment: {k.slo_attainment:.3f}")
    print(
        f"replicas: {k.replicas}; decisions: {k.decisions} "
        f"(p50 {k.decision_p50_ms:.2f} ms, p99 {k.decision_p99_ms:.2f} ms)"
    )
    print(f"wall time: {wall:.2f} s (goal < 60 s)")


if __name__ == "__main__":
    main()
