"""DriftDetector: `consecutive` samples over the band is drift, reported once per episode; a sample
back inside the band ends the episode."""

from __future__ import annotations

from shared.domain.ledger import Drift, DriftDetector

GB = 10**9
USABLE = 100 * GB  # 10% band = 10 GB


def observe(detector: DriftDetector, used_gb: float, *, acc: str = "n/gpu0", reserved_gb: float = 0) -> Drift | None:
    return detector.observe(
        accelerator_id=acc, observed_bytes=int(used_gb * GB), reserved_bytes=int(reserved_gb * GB), usable_bytes=USABLE
    )


def test_two_samples_over_is_drift_once_per_episode() -> None:
    detector = DriftDetector(threshold=0.10, consecutive=2)
    reports = [observe(detector, used) for used in (30, 30, 30, 31, 40)]
    assert [r is not None for r in reports] == [False, True, False, False, False]
    assert reports[1] == Drift("n/gpu0", 30 * GB, 0, USABLE)
    assert reports[1].difference == 30 * GB


def test_an_episode_ends_back_inside_the_band_and_the_next_is_reported_again() -> None:
    detector = DriftDetector(threshold=0.10, consecutive=2)
    reports = [observe(detector, used) for used in (30, 30, 5, 30, 30, 30)]
    assert [r is not None for r in reports] == [False, True, False, False, True, False]


def test_one_sample_back_in_the_band_breaks_a_streak() -> None:
    detector = DriftDetector(threshold=0.10, consecutive=2)
    assert [observe(detector, used) for used in (30, 5, 30)] == [None, None, None]


def test_the_band_is_measured_against_the_reserved_bytes_and_is_strict() -> None:
    detector = DriftDetector(threshold=0.10, consecutive=1)
    assert observe(detector, 60, reserved_gb=50) is None  # exactly 10%: inside the band
    assert observe(detector, 40, reserved_gb=50.1) is not None  # under by 10.1 GB: drift both ways
    assert observe(detector, 40, reserved_gb=50.1) is None  # same episode


def test_accelerators_have_their_own_streaks() -> None:
    detector = DriftDetector(threshold=0.10, consecutive=2)
    assert observe(detector, 30, acc="n/gpu0") is None
    assert observe(detector, 30, acc="n/gpu1") is None
    assert observe(detector, 30, acc="n/gpu0") is not None
    assert observe(detector, 5, acc="n/gpu1") is None


def test_an_accelerator_is_settling_only_within_the_grace_after_its_newest_replica() -> None:
    from datetime import UTC, datetime, timedelta

    now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    detector = DriftDetector(grace_s=600)
    assert detector.settling(now - timedelta(seconds=599), now)
    assert not detector.settling(now - timedelta(seconds=600), now)
    assert not detector.settling(None, now)  # holds no replica: checked as ever
    assert not DriftDetector().settling(now, now)  # no grace: checked at once
