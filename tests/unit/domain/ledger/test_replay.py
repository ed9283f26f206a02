"""The fold of LEDGER allocation events into reserved bytes per accelerator, on the contract models."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.contracts.ledger import AllocationEvent, ShareOut
from shared.domain.ledger import allocation_delta, apply_allocation_event, replay_reserved

GB = 10**9


def event(allocation_id: str, *shares: tuple[str, int], kind: str = "replica") -> AllocationEvent:
    return AllocationEvent(
        allocation_id=allocation_id,
        request_id=f"r-{allocation_id}",
        tenant="acme",
        kind=kind,
        counts_against_hbm=kind == "replica",
        shares=[
            ShareOut.model_validate(
                {
                    "accelerator_id": a,
                    "weights_bytes": b,
                    "kv_bytes": 0,
                    "activation_bytes": 0,
                    "workspace_bytes": 0,
                    "total_bytes": b,
                }
            )
            for a, b in shares
        ],
    )


A = event("a", ("n/gpu0", 10 * GB), ("n/gpu1", 10 * GB))
B = event("b", ("n/gpu1", 5 * GB))
Q = event("q", ("n/gpu0", 1 * GB), kind="request")


def test_commits_add_and_ends_give_back() -> None:
    events = [("allocation_committed", A), ("allocation_committed", B), ("allocation_released", A)]
    assert replay_reserved(events) == {"n/gpu1": 5 * GB}
    assert replay_reserved([*events, ("allocation_expired", B)]) == {}


def test_requests_count_nothing_of_their_own() -> None:
    assert replay_reserved([("allocation_committed", A), ("allocation_committed", Q)]) == {
        "n/gpu0": 10 * GB,
        "n/gpu1": 10 * GB,
    }
    assert allocation_delta("allocation_released", Q) == {}


def test_redeliveries_count_once() -> None:
    events = [
        ("allocation_committed", A),
        ("allocation_committed", A),
        ("allocation_released", A),
        ("allocation_released", A),
        ("allocation_expired", A),
        ("allocation_committed", A),  # a late copy of the commit after its end
        ("allocation_released", B),  # the end of an allocation never seen committed
    ]
    assert replay_reserved(events) == {}


def test_other_events_are_ignored() -> None:
    assert replay_reserved([("allocation_committed", A), ("capacity_changed", A)]) == {
        "n/gpu0": 10 * GB,
        "n/gpu1": 10 * GB,
    }


def test_apply_allocation_event_folds_in_place_and_drops_zeros() -> None:
    reserved = {"n/gpu1": 5 * GB, "other": 7}
    apply_allocation_event(reserved, "allocation_committed", A)
    assert reserved == {"n/gpu0": 10 * GB, "n/gpu1": 15 * GB, "other": 7}
    apply_allocation_event(reserved, "allocation_released", A)
    apply_allocation_event(reserved, "allocation_released", event("b2", ("n/gpu1", 5 * GB)))
    assert reserved == {"other": 7}


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=2**32), st.integers(min_value=1, max_value=60))
def test_replay_equals_the_live_allocations_after_any_history(seed: int, steps: int) -> None:
    rng = random.Random(seed)
    live: dict[str, AllocationEvent] = {}
    stream: list[tuple[str, AllocationEvent]] = []
    for i in range(steps):
        if live and rng.random() < 0.4:
            gone = live.pop(rng.choice(sorted(live)))
            stream.append((rng.choice(["allocation_released", "allocation_expired"]), gone))
        else:
            accs = rng.sample([f"n/gpu{g}" for g in range(4)], rng.randint(1, 3))
            new = event(f"al-{i}", *((a, rng.randint(1, 9) * GB) for a in accs))
            live[new.allocation_id] = new
            stream.append(("allocation_committed", new))
        if stream and rng.random() < 0.2:
            stream.append(stream[rng.randrange(len(stream))])  # a redelivery of an earlier event
    expected: dict[str, int] = {}
    for allocation in live.values():
        for share in allocation.shares:
            expected[share.accelerator_id] = expected.get(share.accelerator_id, 0) + share.total_bytes
    assert replay_reserved(stream) == expected
