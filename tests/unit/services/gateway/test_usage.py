"""The gateway's usage, as written and published (``services.gateway.usage``): per tenant, day, model and key
totals, and one event per tenant with its requests."""

from __future__ import annotations

from datetime import UTC, datetime

from services.gateway.usage import batches, totals
from shared.contracts.gateway import MAX_USAGE_RECORDS, UsageRecord


def record(tenant: str, n: int, *, model: str = "llama3-8b", key: str = "key-1") -> UsageRecord:
    return UsageRecord(
        request_id=f"gw-{tenant}-{n}",
        tenant=tenant,
        key_id=key,
        model=model,
        endpoint="chat.completions",
        stream=True,
        outcome="completed",
        prompt_tokens=10 + n,
        completion_tokens=n,
        e2e_ms=5.0,
        started_at=datetime(2026, 12, 2, 9, 0, tzinfo=UTC),
    )


def test_one_event_per_tenant_with_its_requests_in_order_and_their_sums() -> None:
    records = [record("acme", 1), record("globex", 2), record("acme", 3)]
    events = {e.tenant: e for e in batches(records)}
    assert set(events) == {"acme", "globex"}
    assert [r.request_id for r in events["acme"].requests] == ["gw-acme-1", "gw-acme-3"]
    assert events["acme"].prompt_tokens == 11 + 13 and events["acme"].completion_tokens == 4
    assert all(r.tenant == "globex" for r in events["globex"].requests)


def test_a_busy_tenant_gets_several_events_none_over_the_limit() -> None:
    events = batches([record("acme", n) for n in range(MAX_USAGE_RECORDS * 2 + 1)])
    assert [len(e.requests) for e in events] == [MAX_USAGE_RECORDS, MAX_USAGE_RECORDS, 1]
    assert sum(e.completion_tokens for e in events) == sum(range(MAX_USAGE_RECORDS * 2 + 1))


def test_totals_per_tenant_day_model_and_key() -> None:
    rows = totals([record("acme", 1), record("acme", 2), record("acme", 3, key="key-2"), record("globex", 4)])
    day = datetime(2026, 12, 2).date()
    assert rows[("acme", day, "llama3-8b", "key-1")] == (2, 11 + 12, 3)
    assert rows[("acme", day, "llama3-8b", "key-2")] == (1, 13, 3)
    assert rows[("globex", day, "llama3-8b", "key-1")] == (1, 14, 4)
