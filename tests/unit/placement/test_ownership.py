"""The pure rules of ``shared.domain.placement.ownership``: what a request id does, given its intent;
which allocations a decision owns; when an intent is abandoned."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from shared.domain.errors import ErrorCode
from shared.domain.placement.ownership import (
    Answer,
    Fresh,
    Intent,
    IntentState,
    Refuse,
    Resume,
    Wait,
    is_stale,
    owns,
    rule,
)

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def intent(status: IntentState, **extra: object) -> Intent:
    fields: dict[str, object] = {
        "tenant": "acme",
        "request_id": "r-1",
        "body_hash": "h",
        "status": status,
        "attempt": 1,
        "claimed_until": None,
        "updated_at": NOW,
        "allocation_id": "al-1",
    }
    fields.update(extra)
    return Intent(**fields)  # type: ignore[arg-type]


def test_rule_per_status() -> None:
    assert rule(None, body_hash="h", now=NOW) == Fresh()
    assert rule(intent(IntentState.PLACED), body_hash="h", now=NOW) == Answer()
    assert rule(intent(IntentState.REJECTED), body_hash="h", now=NOW) == Resume(recover=False)
    held = intent(IntentState.COMMITTING, claimed_until=NOW + timedelta(seconds=1))
    assert rule(held, body_hash="h", now=NOW) == Wait(NOW + timedelta(seconds=1))
    assert rule(intent(IntentState.COMMITTING), body_hash="h", now=NOW) == Resume(recover=True)
    for ended in (IntentState.EXPIRED, IntentState.RELEASED, IntentState.ABANDONED):
        ruling = rule(intent(ended), body_hash="h", now=NOW)
        assert isinstance(ruling, Refuse) and ruling.code is ErrorCode.CONFLICT
    other = rule(intent(IntentState.PLACED), body_hash="other", now=NOW)
    assert isinstance(other, Refuse) and other.code is ErrorCode.CONFLICT


def test_ownership_and_staleness() -> None:
    later = NOW + timedelta(seconds=100)
    assert owns(intent(IntentState.PLACED), allocation_id="al-1", seen_at=NOW, now=later, grace_s=10)
    assert not owns(intent(IntentState.PLACED), allocation_id="al-2", seen_at=NOW, now=later, grace_s=10)
    assert owns(
        intent(IntentState.COMMITTING, updated_at=later), allocation_id="al-1", seen_at=NOW, now=later, grace_s=10
    )
    assert not owns(intent(IntentState.COMMITTING), allocation_id="al-1", seen_at=NOW, now=later, grace_s=10)
    assert not owns(None, allocation_id="al-1", seen_at=NOW, now=later, grace_s=10)
    assert owns(None, allocation_id="al-1", seen_at=later, now=later, grace_s=10)
    assert is_stale(intent(IntentState.COMMITTING), now=later, grace_s=10)
    assert not is_stale(intent(IntentState.COMMITTING, claimed_until=later + timedelta(1)), now=later, grace_s=10)
    assert not is_stale(intent(IntentState.PLACED), now=later, grace_s=10)


def test_a_committing_intent_whose_claim_is_still_held_owns_its_allocation_past_the_grace() -> None:
    old = NOW - timedelta(seconds=10)
    held = intent(IntentState.COMMITTING, updated_at=old, claimed_until=NOW + timedelta(seconds=5))
    dropped = intent(IntentState.COMMITTING, updated_at=old, claimed_until=old)
    # grace 3 s: both were last touched 10 s ago; only the one whose claim runs on still owns it
    assert owns(held, allocation_id="al-1", seen_at=old, now=NOW, grace_s=3)
    assert not owns(dropped, allocation_id="al-1", seen_at=old, now=NOW, grace_s=3)
