"""Cross-domain traffic per cluster folded from LEDGER allocation events (on the contract models): a
commit adds its replica's bytes/s to its cluster, its release or expiry takes them back, each
allocation counted once however often its events arrive."""

from __future__ import annotations

from shared.contracts.ledger import AllocationEvent, ShareOut
from shared.domain.ledger import cross_domain_delta, replay_cross_domain, replay_reserved

GB = 10**9


def event(
    allocation_id: str, cluster: str | None, bytes_per_s: int, *, kind: str = "replica", sharing: str = "exclusive"
) -> AllocationEvent:
    share = ShareOut.model_validate(
        {
            "accelerator_id": f"{allocation_id}/gpu0",
            "weights_bytes": GB,
            "kv_bytes": 0,
            "activation_bytes": 0,
            "workspace_bytes": 0,
            "total_bytes": GB,
        }
    )
    return AllocationEvent(
        allocation_id=allocation_id,
        request_id=f"r-{allocation_id}",
        tenant="acme",
        kind=kind,
        counts_against_hbm=kind == "replica",
        shares=[share],
        sharing=sharing,
        cross_domain_bytes_per_s=bytes_per_s,
        cluster=cluster,
    )


A = event("a", "c1", 40 * GB)
B = event("b", "c1", 10 * GB)
C = event("c", "c2", 5 * GB)


def test_a_commit_adds_to_its_cluster_and_an_end_takes_it_back() -> None:
    assert cross_domain_delta("allocation_committed", A) == {"c1": 40 * GB}
    assert cross_domain_delta("allocation_released", A) == {"c1": -40 * GB}
    assert cross_domain_delta("allocation_expired", A) == {"c1": -40 * GB}
    assert cross_domain_delta("allocations_flagged", A) == {}


def test_what_carries_no_cross_domain_traffic_moves_nothing() -> None:
    assert cross_domain_delta("allocation_committed", event("x", "c1", 0)) == {}
    assert cross_domain_delta("allocation_committed", event("y", None, 5 * GB)) == {}  # cluster unknown
    # A request inside a replica is not a replica: its replica carries the traffic (the contract
    # refuses a request commit that says otherwise; a payload that does is still not counted).
    assert cross_domain_delta("allocation_committed", event("q", "c1", 5 * GB, kind="request")) == {}


def test_replay_counts_each_allocation_once_and_drops_clusters_back_at_zero() -> None:
    events = [
        ("allocation_committed", A),
        ("allocation_committed", B),
        ("allocation_committed", A),  # redelivered
        ("allocation_committed", C),
        ("allocation_released", B),
        ("allocation_released", B),  # redelivered
        ("allocation_expired", C),
        ("allocation_committed", C),  # a commit after its end: an old redelivery, not a new allocation
    ]
    assert replay_cross_domain(events) == {"c1": 40 * GB}
    assert replay_cross_domain([*events, ("allocation_released", A)]) == {}
    # The bytes fold is unchanged by the new fields.
    assert replay_reserved(events) == {"a/gpu0": GB}


def test_old_payloads_without_the_fields_read_as_exclusive_without_traffic() -> None:
    old = AllocationEvent.model_validate(
        {"allocation_id": "o", "request_id": "r-o", "tenant": "acme", "kind": "replica", "shares": []}
    )
    assert (old.sharing, old.cross_domain_bytes_per_s, old.cluster) == ("exclusive", 0, None)
    assert cross_domain_delta("allocation_committed", old) == {}
