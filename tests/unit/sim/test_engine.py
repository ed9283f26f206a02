"""The simulator core: determinism, NVLink accounting of a baseline, queueing and timeouts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from shared.domain.placement import FleetSnapshot
from shared.domain.placement.perf import model_shape
from shared.domain.sim import SimConfig, make_policy, simulate
from shared.domain.sim.engine import fitted_shape, replica_request, request_latency
from shared.domain.sim.policies import POLICIES
from shared.domain.traces import AssignedRequest, TraceRequest, assign_workload
from shared.infra.catalog import demo_fleet_path, load_inventory, load_models, load_skus
from tests.unit.sim.fleets import one_node_fleet

MIX = {"llama3-8b": 0.5, "llama3-70b": 0.3, "mixtral-8x7b": 0.2}

FLEET_4P4 = one_node_fleet("n1", gpus=8, topology="4+4")

FLEET_ONE_GPU = one_node_fleet("solo", gpus=1, topology="pcie")


def _snapshot(path: Path, reserved: dict[str, int] | None = None) -> FleetSnapshot:
    skus = load_skus()
    fleet, _ = load_inventory(path, skus=skus)
    return FleetSnapshot.from_fleet(fleet, skus=skus, models=load_models(), reserved=reserved)


def _fleet(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    return path


def _synthetic(n: int) -> list[TraceRequest]:
    return [
        TraceRequest(arrival_ms=i * 150.0, input_tokens=200 + (i * 37) % 1500, output_tokens=20 + i % 180, row=i + 1)
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def demo() -> FleetSnapshot:
    return _snapshot(demo_fleet_path())


def _kpis_without_timing(result: object) -> dict[str, object]:
    kpis = result.kpis.to_dict()  # type: ignore[attr-defined]
    return {k: v for k, v in kpis.items() if not k.startswith("decision_p")}


def _counter_timer() -> object:
    ticks = iter(range(10**9))
    return lambda: float(next(ticks))


@pytest.mark.parametrize("policy", POLICIES)
def test_same_seed_same_kpis(demo: FleetSnapshot, policy: str) -> None:
    requests = assign_workload(_synthetic(400), models=MIX, tenants={"t": 1.0}, seed=7)
    first = simulate(demo, requests, make_policy(policy, seed=7), timer=_counter_timer())  # type: ignore[arg-type]
    second = simulate(demo, requests, make_policy(policy, seed=7))
    assert _kpis_without_timing(first) == _kpis_without_timing(second)
    assert first.outcomes == second.outcomes
    assert first.kpis.requests == 400


def test_different_seeds_may_differ(demo: FleetSnapshot) -> None:
    results = set()
    for seed in (1, 2, 3):
        requests = assign_workload(_synthetic(400), models=MIX, tenants={"t": 1.0}, seed=seed)
        results.add(
            tuple(sorted(_kpis_without_timing(simulate(demo, requests, make_policy("random", seed=seed))).items()))
        )
    assert len(results) > 1


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_keeps_tp_groups_inside_an_nvlink_clique(tmp_path: Path, policy: str) -> None:
    # GPU 0 of a 4+4 node is full: the lowest window of four indices (1-4) crosses the two NVLink
    # groups. Every policy runs the same filters, so a TP=4 group lands on 4-7 for all of them.
    path = _fleet(tmp_path, FLEET_4P4)
    usable = _snapshot(path).capacity["n1/gpu0"].usable
    snapshot = _snapshot(path, reserved={"n1/gpu0": usable})
    requests = [
        AssignedRequest(arrival_ms=0.0, input_tokens=500, output_tokens=50, row=1, model="llama3-70b", tenant="t")
    ]
    result = simulate(snapshot, requests, make_policy(policy))
    assert result.kpis.placed == 1
    assert result.kpis.tp_groups == 1
    assert result.kpis.tp_groups_not_nvlinked == 0
    assert result.kpis.nvlink_affinity == 1.0


def test_queueing_and_timeouts_are_counted(tmp_path: Path) -> None:
    snapshot = _snapshot(_fleet(tmp_path, FLEET_ONE_GPU))
    # 40 KV slots of 8192 tokens: one llama3-8b replica fills the single GPU, a second does not fit.
    config = SimConfig(slots=40, queue_timeout_s=5.0, idle_release_s=1.0)

    def request(row: int, at: float, output: int) -> AssignedRequest:
        return AssignedRequest(
            arrival_ms=at, input_tokens=100, output_tokens=output, row=row, model="llama3-8b", tenant="t"
        )

    long = [request(i + 1, float(i), 4000) for i in range(40)]
    waiting = [request(41 + i, 100.0 + i, 5) for i in range(5)]
    late = [request(100, 600_000.0, 5)]
    result = simulate(snapshot, [*long, *waiting, *late], make_policy("hetsched"), config=config)
    kpis = result.kpis
    assert kpis.requests == 46
    assert kpis.queued == 5
    first_done = min(o.done_ms for o in result.outcomes[:40] if o.done_ms is not None)
    expected_failed = 5 if first_done > 100.0 + 5_000.0 else 0
    assert kpis.failed == expected_failed
    assert kpis.placed == 46 - expected_failed
    assert kpis.mean_queue_wait_ms > 0
    assert kpis.success_rate == kpis.placed / 46
    assert kpis.replicas == 2  # released after 1 s idle, placed again for the late request


def _request(row: int, at: float, prompt: int = 2000, output: int = 100) -> AssignedRequest:
    return AssignedRequest(
        arrival_ms=at, input_tokens=prompt, output_tokens=output, row=row, model="llama3-8b", tenant="t"
    )


def test_a_replica_prefills_one_prompt_at_a_time(tmp_path: Path) -> None:
    snapshot = _snapshot(_fleet(tmp_path, FLEET_ONE_GPU))
    config = SimConfig(scale_backlog_ms=math.inf)  # one replica takes both
    result = simulate(snapshot, [_request(1, 0.0), _request(2, 0.0)], make_policy("hetsched"), config=config)
    first, second = result.outcomes
    spec = snapshot.models["llama3-8b"]
    shape = model_shape(spec, spec.dtype, spec.kv_dtype)
    sku = snapshot.skus["H100-SXM-80GB"]
    own = request_latency(shape, sku, 1, _request(2, 0.0), 2).ttft_ms  # its own prompt, not the batch's
    assert first.wait_ms == second.wait_ms == 0.0
    assert first.ttft_ms is not None and second.ttft_ms is not None
    assert first.ttft_ms == pytest.approx(request_latency(shape, sku, 1, _request(1, 0.0), 1).ttft_ms)
    assert second.ttft_ms == pytest.approx(first.ttft_ms + own)  # waited for the first prompt's prefill
    assert result.kpis.replicas == 1


def test_a_prefill_backlog_asks_for_another_replica(tmp_path: Path) -> None:
    snapshot = _snapshot(_fleet(tmp_path, FLEET_4P4))
    requests = [_request(i + 1, float(i), prompt=6000) for i in range(6)]
    patient = simulate(snapshot, requests, make_policy("hetsched"), config=SimConfig(scale_backlog_ms=math.inf))
    eager = simulate(snapshot, requests, make_policy("hetsched"), config=SimConfig(scale_backlog_ms=100.0))
    assert patient.kpis.replicas == 1  # slots were free all along
    assert eager.kpis.replicas > 1
    assert max(o.ttft_ms or 0.0 for o in eager.outcomes) < max(o.ttft_ms or 0.0 for o in patient.outcomes)


def test_the_run_ends_with_the_last_request(tmp_path: Path) -> None:
    snapshot = _snapshot(_fleet(tmp_path, FLEET_ONE_GPU))
    result = simulate(snapshot, [_request(1, 0.0)], make_policy("hetsched"), config=SimConfig(idle_release_s=600.0))
    (life,) = result.replicas
    (outcome,) = result.outcomes
    assert life.end_ms == outcome.done_ms  # not 600 s of idling after the workload


def test_the_replica_request_states_the_typical_shape_and_the_slo() -> None:
    config = SimConfig()
    request = replica_request("llama3-8b", 3, config, shared=False, shape=(1200.4, 210.0))
    assert (request.request_id, request.input_tokens, request.output_tokens) == ("llama3-8b-replica-3", 1200, 210)
    assert request.slo is not None and (request.slo.ttft_ms, request.slo.tpot_ms) == (2000.0, 100.0)
    assert request.concurrency == config.slots and request.sharing == "exclusive"
    quiet = replica_request("llama3-8b", 1, SimConfig(tell_shape=False, tell_slo=False), shared=True, shape=(5, 5))
    assert quiet.input_tokens is None and quiet.slo is None and quiet.sharing == "shared"


def test_a_typical_shape_longer_than_the_context_is_scaled_into_it() -> None:
    assert fitted_shape((100.0, 50.0), 8192) == (100, 50)
    prompt, output = fitted_shape((15_000.0, 150.0), 8192)
    assert prompt + output <= 8192 and prompt / output == pytest.approx(100.0, rel=0.02)
    assert fitted_shape((0.2, 0.0), 8192) == (1, 1)
