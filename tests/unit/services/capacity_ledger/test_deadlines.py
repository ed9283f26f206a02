"""The ledger reserves nothing for a caller who gave up (its deadline passed before the commit, or
while the commit waited for its locks), and no lease is longer than 30 days (issue 10, rows 7-9, 13)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from services.capacity_ledger.batcher import CommitBatcher
from shared.contracts.base import Rejected
from shared.contracts.ledger import CommitBatchRequest, CommitReply, LedgerRenewRequest
from shared.domain.capacity import AcceleratorCapacity
from shared.infra import deadline
from tests.unit.services.capacity_ledger.test_handlers import GB, NOW, FakeStore, commit_request, gpu, make

FAR = datetime(9999, 12, 31, tzinfo=UTC)


class Clock:
    """Wall-clock milliseconds as ``shared.infra.deadline`` reads them, moved by the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ms = 1_000_000.0
        monkeypatch.setattr(deadline, "now_ms", lambda: self.ms)


def codes(replies: Iterable[CommitReply | Rejected]) -> list[str | None]:
    return [r.error.code if r.error else r.status for r in replies]


async def in_request(until_ms: float | None, work: Any) -> Any:
    """Run ``work()`` as the request server would: in a task whose deadline is ``until_ms``."""

    async def task() -> Any:
        deadline.set_deadline(until_ms)
        return await work()

    return await asyncio.create_task(task())


async def test_a_commit_whose_deadline_passed_reserves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock(monkeypatch)
    handlers, store, units = make(gpu("n/gpu0"))
    reply = await in_request(clock.ms - 1, lambda: handlers.commit(commit_request("a", ("n/gpu0", 10))))
    assert isinstance(reply, Rejected) and codes([reply]) == ["deadline_exceeded"] and reply.request_id == "a"
    assert store.accelerators["n/gpu0"].reserved == 0 and units.runs == 0


async def test_a_commit_whose_deadline_passes_while_it_waits_for_its_locks_is_not_applied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Postgres stalls (a row lock held elsewhere): once the locks are ours the caller has gone."""
    clock = Clock(monkeypatch)

    class StalledStore(FakeStore):
        async def lock_accelerators(self, *, session: Any, ids: Iterable[str]) -> dict[str, AcceleratorCapacity]:
            clock.ms += 12_000  # the lock was held for 12 s
            return await super().lock_accelerators(session=session, ids=ids)

    store = StalledStore(accelerators={"n/gpu0": gpu("n/gpu0")})
    handlers, _store, units = make(store=store)
    replies = await handlers.apply_commits(
        [commit_request("gone", ("n/gpu0", 10)), commit_request("patient", ("n/gpu0", 20))],
        deadlines=[clock.ms + 10_000, clock.ms + 60_000],
    )
    assert codes(replies) == ["deadline_exceeded", "committed"]
    assert store.accelerators["n/gpu0"].reserved == 20 * GB  # only the caller still waiting got its bytes
    assert [e["request_id"] for e in units.named("allocation_committed")] == ["patient"]


async def test_the_batcher_carries_each_commits_deadline_to_the_transaction(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock(monkeypatch)
    batcher = CommitBatcher(max_batch=8)

    class Stalled(FakeStore):
        async def lock_accelerators(self, *, session: Any, ids: Iterable[str]) -> dict[str, AcceleratorCapacity]:
            clock.ms += 5_000
            return await super().lock_accelerators(session=session, ids=ids)

    stalled = Stalled(accelerators={"n/gpu0": gpu("n/gpu0")})
    handlers, _store, _units = make(batcher=batcher, store=stalled)
    batcher.start(handlers.apply_commits)
    try:
        short, long = await asyncio.gather(
            in_request(clock.ms + 1_000, lambda: handlers.commit(commit_request("short", ("n/gpu0", 1)))),
            in_request(clock.ms + 60_000, lambda: handlers.commit(commit_request("long", ("n/gpu0", 2)))),
        )
    finally:
        await batcher.stop()
    assert codes([short, long]) == ["deadline_exceeded", "committed"]
    assert stalled.accelerators["n/gpu0"].reserved == 2 * GB


async def test_commit_batch_uses_the_requests_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock(monkeypatch)
    handlers, store, units = make(gpu("n/gpu0"))
    request = CommitBatchRequest(commits=[commit_request("a", ("n/gpu0", 1)), commit_request("b", ("n/gpu0", 1))])
    reply = await in_request(clock.ms - 1, lambda: handlers.commit_batch(request))
    assert codes(reply.results) == ["deadline_exceeded", "deadline_exceeded"]
    assert units.runs == 0 and store.accelerators["n/gpu0"].reserved == 0


async def test_commits_without_a_deadline_are_applied() -> None:
    handlers, _store, _units = make(gpu("n/gpu0"))
    (reply,) = await handlers.apply_commits([commit_request("a", ("n/gpu0", 1))])
    assert reply.status == "committed"


# -- row 13: no lease beyond 30 days ------------------------------------------------------------------


async def test_a_commit_with_a_lease_ending_in_year_9999_is_refused() -> None:
    handlers, store, units = make(gpu("n/gpu0"))
    (reply,) = await handlers.apply_commits([commit_request("a", ("n/gpu0", 1), lease_expires_at=FAR)])
    assert codes([reply]) == ["invalid_request"] and "30 days" in (reply.error.message if reply.error else "")
    (ok,) = await handlers.apply_commits(
        [commit_request("b", ("n/gpu0", 1), lease_expires_at=NOW + timedelta(days=29))]
    )
    assert ok.status == "committed"
    assert store.accelerators["n/gpu0"].reserved == 1 * GB and len(units.named("allocation_committed")) == 1


async def test_a_renewal_to_year_9999_is_refused() -> None:
    handlers, store, _units = make(gpu("n/gpu0"))
    (committed,) = await handlers.apply_commits([commit_request("a", ("n/gpu0", 1))])
    assert committed.allocation_id is not None
    before = store.allocations[committed.allocation_id].lease_expires_at
    reply = await handlers.renew(
        LedgerRenewRequest(allocation_id=committed.allocation_id, tenant="acme", lease_expires_at=FAR)
    )
    dumped = reply.model_dump()
    assert dumped["status"] == "rejected" and dumped["error"]["code"] == "invalid_request"
    assert store.allocations[committed.allocation_id].lease_expires_at == before
