"""The simulator's reservations: fill rate with and without lending, by hand for a tiny case, owners
reclaiming lent GPUs (soft at once, spot after the notice), and nothing changed without reservations.

The fleet: node ``res`` (4 H100, NVSwitch) that the owner ``acme`` reserves whole, and node ``pool``
(1 H100) that nobody reserves. ``llama3-8b`` is acme's traffic; ``llama3.1-8b`` (the same shape) is the
preemptible tenant's. One replica of either fits one H100 and holds 16 requests (``SimConfig.slots``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.domain.placement import FleetSnapshot
from shared.domain.sim import ReservationSetup, SimConfig, SimReservation, make_policy, simulate
from shared.domain.sim.engine import SimResult
from shared.domain.sim.reservations import ReservationRun
from shared.domain.traces import AssignedRequest
from shared.infra.catalog import load_inventory, load_models, load_skus

OWNER, BORROWER = "llama3-8b", "llama3.1-8b"
FLEET = """
regions:
  - name: r
    clusters:
      - name: c
        racks:
          - name: k
            power_kw: 30
            nodes:
              - name: res
                sku: H100-SXM-80GB
                gpus: 4
                topology: nvswitch-8
              - name: pool
                sku: H100-SXM-80GB
                gpus: 1
                topology: pcie
"""
RES = tuple(f"res/gpu{i}" for i in range(4))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> FleetSnapshot:
    path = tmp_path_factory.mktemp("fleet") / "fleet.yaml"
    path.write_text(FLEET)
    skus = load_skus()
    inventory, _ = load_inventory(path, skus=skus)
    return FleetSnapshot.from_fleet(inventory, skus=skus, models=load_models())


def request(row: int, at_ms: float, model: str, *, output: int = 20) -> AssignedRequest:
    return AssignedRequest(arrival_ms=at_ms, input_tokens=100, output_tokens=output, row=row, model=model, tenant="t")


def setup(policy: str, *, spot_eviction_s: int = 30) -> ReservationSetup:
    return ReservationSetup(
        reservations=(
            SimReservation(tenant="acme", policy=policy, count=4, sku="H100-SXM-80GB", spot_eviction_s=spot_eviction_s),  # type: ignore[arg-type]
        ),
        owner_models=((OWNER, "acme"),),
    )


def run(fleet: FleetSnapshot, requests: list[AssignedRequest], config: SimConfig) -> SimResult:
    return simulate(fleet, requests, make_policy("hetsched"), config=config)


def borrower_burst(n: int, *, output: int) -> list[AssignedRequest]:
    """``n`` long requests of the preemptible tenant, 1 ms apart from 0."""
    return [request(i + 1, float(i), BORROWER, output=output) for i in range(n)]


def test_reservation_takes_a_whole_node(fleet: FleetSnapshot) -> None:
    book = ReservationRun(setup("soft"), fleet, borrower="sim").book
    (reservation,) = book.active()
    assert reservation.accelerators == RES
    assert reservation.offered == frozenset(RES)  # the owner uses none of it: every GPU is lent


def test_lending_fills_more_than_a_hard_reservation(fleet: FleetSnapshot) -> None:
    # acme: 4 short requests, one replica (1 of its 4 GPUs). The borrower: 48 long requests at once,
    # 3 replicas of 16 slots. Hard: only the pool's GPU is theirs, 1 replica, 32 requests queue and the
    # rest of the reservation idles. Soft: 2 more replicas borrow acme's idle GPUs.
    requests = [*borrower_burst(48, output=400), *(request(100 + i, 10.0 + i, OWNER) for i in range(4))]
    config = SimConfig(queue_timeout_s=5.0, sample_period_ms=1000.0)
    hard = run(fleet, requests, replace(config, reservations=setup("hard")))
    soft = run(fleet, requests, replace(config, reservations=setup("soft")))
    assert hard.kpis.fill_rate is not None and soft.kpis.fill_rate is not None
    assert soft.kpis.fill_rate > hard.kpis.fill_rate
    # Every replica lives to the end of the run, so every sample is the same: hard 1/4 (acme's one GPU),
    # soft (1 acme + 2 lent) / 4.
    assert hard.kpis.fill_rate == pytest.approx(0.25)
    assert soft.kpis.fill_rate == pytest.approx(0.75)
    assert sum(1 for r in hard.replicas if r.model == BORROWER) == 1
    assert sum(1 for r in soft.replicas if r.model == BORROWER) == 3
    assert soft.kpis.placed > hard.kpis.placed
    # Hard: never more than acme's own replica on its 4 GPUs; every sample at most 1/4.
    assert all(s.fill_rate is not None and s.fill_rate <= 0.25 for s in hard.samples)
    assert hard.kpis.preemptions == soft.kpis.preemptions == 0


def test_fill_rate_by_hand(fleet: FleetSnapshot) -> None:
    # Hard reservation of res (4 GPUs). acme's one short request at 0 starts a replica on res/gpu*;
    # it is done within a second and released 1 s later (idle_release_s), so between samples 1 s and
    # 2 s. The borrower's request at 3.5 s runs on the pool. Samples every second: at 1 s the owner holds
    # 1 of 4 GPUs (0.25); at 2 s and 3 s nothing (0); the last at the end of the run (0).
    requests = [request(1, 0.0, OWNER), request(2, 3500.0, BORROWER)]
    config = SimConfig(idle_release_s=1.0, sample_period_ms=1000.0, reservations=setup("hard"))
    result = run(fleet, requests, config)
    owner_done = result.outcomes[0].done_ms
    end_ms = max(o.done_ms or 0.0 for o in result.outcomes)
    assert owner_done is not None and owner_done < 1000.0 and end_ms > 3500.0
    assert [s.fill_rate for s in result.samples] == [0.25, 0.0, 0.0, 0.0]
    # Time-weighted: 0.25 for the first 1000 ms, 0 for the remaining end_ms - 1000 ms.
    assert result.kpis.fill_rate == pytest.approx(0.25 * 1000.0 / end_ms)


def test_soft_owner_reclaims_at_once(fleet: FleetSnapshot) -> None:
    # The borrower fills the pool and all 4 of acme's idle GPUs (80 long requests: 5 replicas). acme's
    # request at 2 s fits nowhere: the last replica lent (LIFO) is evicted at once, its 16 in-flight
    # requests fail, and acme's replica starts there with no wait.
    requests = [*borrower_burst(80, output=4000), request(1000, 2000.0, OWNER)]
    result = run(fleet, requests, SimConfig(reservations=setup("soft")))
    assert result.kpis.preemptions == 1
    assert result.kpis.preempted_requests == 16
    owner = next(o for o in result.outcomes if o.model == OWNER)
    assert owner.admitted and owner.wait_ms == 0.0
    preempted = [o for o in result.outcomes if o.preempted]
    assert len(preempted) == 16 and all(not o.admitted and o.model == BORROWER for o in preempted)
    assert [r for r in result.replicas if r.model == BORROWER and r.end_ms == 2000.0]  # evicted at 2 s
    assert result.kpis.failed == 16


def test_spot_owner_waits_for_the_notice(fleet: FleetSnapshot) -> None:
    # The same with spot and 5 s of notice: acme's request queues until the borrower leaves at 7 s.
    requests = [*borrower_burst(80, output=4000), request(1000, 2000.0, OWNER)]
    config = SimConfig(queue_timeout_s=30.0, reservations=setup("spot", spot_eviction_s=5))
    result = run(fleet, requests, config)
    assert result.kpis.preemptions == 1
    owner = next(o for o in result.outcomes if o.model == OWNER)
    assert owner.admitted and owner.wait_ms == pytest.approx(5000.0)
    assert [r for r in result.replicas if r.model == BORROWER and r.end_ms == pytest.approx(7000.0)]


def test_hard_owner_preempts_nobody(fleet: FleetSnapshot) -> None:
    # Hard lends nothing: the borrower gets the pool only, acme's request finds its GPUs free.
    requests = [*borrower_burst(80, output=4000), request(1000, 2000.0, OWNER)]
    result = run(fleet, requests, SimConfig(queue_timeout_s=5.0, reservations=setup("hard")))
    assert result.kpis.preemptions == 0 and result.kpis.preempted_requests == 0
    owner = next(o for o in result.outcomes if o.model == OWNER)
    assert owner.admitted and owner.wait_ms == 0.0


def test_without_reservations_nothing_is_reported(fleet: FleetSnapshot) -> None:
    requests = [*borrower_burst(40, output=200), request(100, 5.0, OWNER)]
    result = run(fleet, requests, SimConfig(sample_period_ms=1000.0))
    assert result.kpis.fill_rate is None
    assert result.kpis.preemptions == result.kpis.preempted_requests == 0
    assert all(s.fill_rate is None for s in result.samples)
    assert not any(o.preempted for o in result.outcomes)
    # Both models share the fleet freely: the owner's model is not confined to (or kept off) any node.
    assert result.kpis.placed == 41


def test_reservation_validation(fleet: FleetSnapshot) -> None:
    too_many = ReservationSetup(
        reservations=(SimReservation(tenant="acme", policy="soft", count=9, sku="H100-SXM-80GB"),)
    )
    with pytest.raises(ValueError, match="fewer than 9"):
        ReservationRun(too_many, fleet, borrower="sim")
    twice = ReservationSetup(
        reservations=(
            SimReservation(tenant="a", policy="hard", accelerators=("res/gpu0",)),
            SimReservation(tenant="b", policy="hard", accelerators=("res/gpu0",)),
        )
    )
    with pytest.raises(ValueError, match="already reserved"):
        ReservationRun(twice, fleet, borrower="sim")
    with pytest.raises(ValueError, match="preemptible traffic"):
        ReservationRun(setup("soft"), fleet, borrower="acme")
    with pytest.raises(ValueError, match="policy"):
        SimReservation(tenant="acme", policy="lend", count=1, sku="H100-SXM-80GB")  # type: ignore[arg-type]


def test_spot_borrower_drains_during_the_notice(fleet: FleetSnapshot) -> None:
    # The last replica lent (requests 65-80, from 64 ms) is the one reclaimed at 2 s. Its request 80 is
    # short, so it has a free slot when the borrower's request 2000 arrives at 3 s, inside the notice.
    # A replica told to leave takes no new request: request 2000 (long) is not routed there, else it
    # would still run at 7 s and fail with the replica.
    burst = borrower_burst(80, output=4000)
    burst[-1] = request(80, 79.0, BORROWER, output=20)
    requests = [*burst, request(1000, 2000.0, OWNER), request(2000, 3000.0, BORROWER, output=4000)]
    config = SimConfig(queue_timeout_s=30.0, reservations=setup("spot", spot_eviction_s=5))
    result = run(fleet, requests, config)
    assert result.kpis.preemptions == 1
    late = next(o for o in result.outcomes if o.row == 2000)
    assert not late.preempted
    assert result.kpis.preempted_requests == 15  # requests 65-79 still in flight at 7 s
