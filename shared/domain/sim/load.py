"""How loaded a workload keeps a fleet, and the arrivals scaled to a target load.

**Load** is the share of the fleet's serving capacity that the workload's arrivals ask for:
``load = sum over models of (the model's arrival rate / the rate the fleet completes its requests)``,
where, for each model on its own:

* the arrival rate is its requests in the trace over the trace's span (first to last arrival);
* the capacity is the rate at which the fleet serves that model when it holds nothing else and
  every replica is full: the sum over its replicas of ``replica_rate`` (``slots`` over the mean
  end-to-end time, or one over the mean prefill where prompts are so long that prefilling them one
  at a time binds first). The replicas are those ``placement.decide`` (the default profile, asked as
  the simulator asks: ``slots`` KV slots of ``context_tokens``, the model's mean request shape, the
  SLO) places on the empty fleet one after another until it refuses; the times are the simulator's
  own estimates (``engine.request_latency``) of the model's requests at a batch of ``slots``.

Summing the per-model shares splits the fleet between the models in proportion to what each needs:
at load 1 the fleet, every replica full, just keeps up on average, and bursts above it queue. A model
that runs on part of the fleet only (one without a TPU artifact) has its capacity counted on that
part: whether the models then crowd each other out depends on where the policy puts them, which is
what the policies are compared on. ``scale_arrivals`` divides the gaps between arrivals by
``factor = target / load`` (the trace's order, prompts and outputs kept), so the scaled trace runs
at the target load. All of it comes from the trace and the fleet: nothing is set per trace.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from shared.domain.hardware import Sku
from shared.domain.latency import ModelShape
from shared.domain.placement import FleetSnapshot, PlacementRequest, apply, decide
from shared.domain.placement.perf import model_shape
from shared.domain.sim.engine import SimConfig, replica_request, request_latency
from shared.domain.sim.sharing import small_models
from shared.domain.traces import AssignedRequest


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """One model's arrivals and what the whole fleet could serve of it."""

    model: str
    requests: int
    arrivals_per_s: float
    replicas: int  # of this model alone on the empty fleet, placed until refused
    capacity_per_s: float  # requests per second those replicas complete, every one full

    @property
    def utilisation(self) -> float:
        return self.arrivals_per_s / self.capacity_per_s if self.capacity_per_s > 0 else math.inf


@dataclass(frozen=True, slots=True)
class FleetLoad:
    """The load a workload puts on a fleet (module docstring): the sum of the models' utilisations."""

    span_s: float
    models: tuple[ModelLoad, ...]

    @property
    def load(self) -> float:
        return sum(m.utilisation for m in self.models)

    def factor(self, target: float) -> float:
        """How much faster the arrivals must come for the workload to run at ``target`` load."""
        if not target > 0 or not math.isfinite(target):
            raise ValueError(f"a target load must be a positive number, got {target}")
        if not math.isfinite(self.load) or self.load <= 0:
            unserved = ", ".join(m.model for m in self.models if m.capacity_per_s <= 0) or "none"
            raise ValueError(f"the fleet cannot serve the workload at any rate (models it cannot hold: {unserved})")
        return target / self.load


def fleet_load(snapshot: FleetSnapshot, requests: Sequence[AssignedRequest], config: SimConfig) -> FleetLoad:
    """The load ``requests`` put on the empty fleet ``snapshot`` with replicas sized by ``config``."""
    if not requests:
        raise ValueError("no requests: a load needs arrivals")
    arrivals = [r.arrival_ms for r in requests]
    span_s = (max(arrivals) - min(arrivals)) / 1000.0
    if span_s <= 0:
        raise ValueError("every request arrives at the same instant: the trace has no arrival rate")
    by_model: dict[str, list[AssignedRequest]] = {}
    for r in requests:
        by_model.setdefault(r.model, []).append(r)
    small = small_models(snapshot, config.small_fraction) if config.share_small else frozenset()
    models = tuple(
        _model_load(snapshot, model, by_model[model], span_s, config, shared=model in small)
        for model in sorted(by_model)
    )
    return FleetLoad(span_s=span_s, models=models)


def _model_load(
    snapshot: FleetSnapshot,
    model: str,
    requests: Sequence[AssignedRequest],
    span_s: float,
    config: SimConfig,
    *,
    shared: bool,
) -> ModelLoad:
    spec = snapshot.models.get(model)
    if spec is None:
        raise ValueError(f"unknown model {model!r}")
    shape = model_shape(spec, spec.dtype, spec.kv_dtype)
    per_replica: dict[tuple[str, int], float] = {}  # requests/s of one full replica
    capacity = 0.0
    replicas = 0
    typical = (
        sum(r.input_tokens for r in requests) / len(requests),
        sum(r.output_tokens for r in requests) / len(requests),
    )
    for sku_name, tp in _fill(snapshot, model, config, shared=shared, shape=typical):
        replicas += 1
        key = (sku_name, tp)
        if key not in per_replica:
            per_replica[key] = replica_rate(shape, snapshot.skus[sku_name], tp, requests, config.slots)
        capacity += per_replica[key]
    return ModelLoad(
        model=model,
        requests=len(requests),
        arrivals_per_s=len(requests) / span_s,
        replicas=replicas,
        capacity_per_s=capacity,
    )


def replica_rate(shape: ModelShape, sku: Sku, tp: int, requests: Sequence[AssignedRequest], slots: int) -> float:
    """Requests per second one replica completes with every slot taken: ``slots`` over the mean
    end-to-end time at a batch of ``slots``, or, when prompts are long, one over the mean prefill (a
    replica prefills one prompt at a time), whichever is less."""
    latencies = [request_latency(shape, sku, tp, r, slots) for r in requests]
    mean_e2e_s = sum(e.e2e_ms for e in latencies) / len(latencies) / 1000.0
    mean_prefill_s = sum(e.ttft_ms for e in latencies) / len(latencies) / 1000.0
    return min(slots / mean_e2e_s, 1.0 / mean_prefill_s)


def _fill(
    snapshot: FleetSnapshot, model: str, config: SimConfig, *, shared: bool, shape: tuple[float, float]
) -> Iterable[tuple[str, int]]:
    """(SKU, accelerators) of each replica of ``model`` that ``decide`` places on the empty fleet, one
    after another, until it refuses (asked as the simulator asks, the typical request ``shape``)."""
    n = 0
    while True:
        n += 1
        request: PlacementRequest = replica_request(model, n, config, shared=shared, shape=shape)
        decision = decide(snapshot, replace(request, request_id=f"{model}-fill-{n}"))
        if not decision.placed or decision.sku is None or decision.tp is None:
            return
        snapshot = apply(snapshot, decision)
        yield decision.sku, decision.tp


def scale_arrivals(requests: Sequence[AssignedRequest], factor: float) -> list[AssignedRequest]:
    """``requests`` with the gaps between arrivals divided by ``factor`` (> 1: faster), the first
    arrival kept; prompts, outputs, models and rows unchanged."""
    if not factor > 0 or not math.isfinite(factor):
        raise ValueError(f"a scale factor must be a positive number, got {factor}")
    if not requests:
        return []
    start = min(r.arrival_ms for r in requests)
    return [replace(r, arrival_ms=start + (r.arrival_ms - start) / factor) for r in requests]
