"""When a draining replica may be released: from its engine's latest report, the drain's start, a timeout."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from shared.domain.rebalance.drain import Drained, EngineReport, drained

STARTED = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
TIMEOUT_S = 600.0


def at(seconds: float) -> datetime:
    return STARTED + timedelta(seconds=seconds)


def verdict(report: EngineReport | None, now_s: float = 5.0) -> Drained:
    return drained(report, started=STARTED, now=at(now_s), timeout_s=TIMEOUT_S)


def test_a_replica_never_reported_is_released_nothing_known_in_flight() -> None:
    assert verdict(None) is Drained.UNREPORTED


def test_a_replica_reported_busy_after_the_drain_waits() -> None:
    assert verdict(EngineReport(queue_depth=2, kv_used_bytes=0, at=at(3))) is Drained.WAIT
    assert verdict(EngineReport(queue_depth=0, kv_used_bytes=1, at=at(3))) is Drained.WAIT


def test_an_idle_report_from_before_the_drain_started_waits() -> None:
    assert verdict(EngineReport(queue_depth=0, kv_used_bytes=0, at=at(-1))) is Drained.WAIT
    assert verdict(EngineReport(queue_depth=0, kv_used_bytes=0, at=STARTED)) is Drained.WAIT  # not after it


def test_an_idle_report_after_the_drain_started_releases() -> None:
    assert verdict(EngineReport(queue_depth=0, kv_used_bytes=0, at=at(1))) is Drained.IDLE


def test_the_timeout_releases_a_replica_still_busy_or_silent() -> None:
    busy = EngineReport(queue_depth=4, kv_used_bytes=10, at=at(590))
    assert verdict(busy, now_s=TIMEOUT_S - 1) is Drained.WAIT
    assert verdict(busy, now_s=TIMEOUT_S) is Drained.TIMED_OUT
    stale_idle = EngineReport(queue_depth=0, kv_used_bytes=0, at=at(-30))
    assert verdict(stale_idle, now_s=TIMEOUT_S + 1) is Drained.TIMED_OUT
