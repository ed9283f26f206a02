"""Drift: observed HBM use (telemetry) against the bytes the ledger reserved."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime


@dataclass(frozen=True, slots=True)
class Drift:
    accelerator_id: str
    observed_bytes: int
    reserved_bytes: int
    usable_bytes: int

    @property
    def difference(self) -> int:
        return self.observed_bytes - self.reserved_bytes


@dataclass
class DriftDetector:
    """A difference over ``threshold`` x usable HBM in ``consecutive`` samples in a row is drift.

    Reported once per episode (the sample that completes the streak); a sample back inside the band
    ends the episode, so the next streak is reported again.

    An accelerator holding a replica committed less than ``grace_s`` ago is ``settling``: the ledger reserves
    before the engine starts, and an engine still loading its weights holds far less than its reservation,
    so such a sample says nothing (its caller skips it, and its streak ends)."""

    threshold: float = 0.10
    consecutive: int = 2
    grace_s: float = 0.0
    _streak: dict[str, int] = field(default_factory=dict)

    def settling(self, newest_commit: datetime | None, now: datetime) -> bool:
        """Whether an accelerator whose newest replica was committed at ``newest_commit`` (None: it holds
        none) is within the grace after that commit at ``now``."""
        return newest_commit is not None and (now - newest_commit).total_seconds() < self.grace_s

    def observe(
        self, *, accelerator_id: str, observed_bytes: int, reserved_bytes: int, usable_bytes: int
    ) -> Drift | None:
        """``judge`` the sample, then ``record`` it."""
        drift, streak = self.judge(
            accelerator_id=accelerator_id,
            observed_bytes=observed_bytes,
            reserved_bytes=reserved_bytes,
            usable_bytes=usable_bytes,
        )
        self.record(accelerator_id, streak)
        return drift

    def judge(
        self, *, accelerator_id: str, observed_bytes: int, reserved_bytes: int, usable_bytes: int
    ) -> tuple[Drift | None, int]:
        """What one sample means, changing nothing: the drift it reports (or None) and the streak it makes
        (0: back inside the band). A caller whose report may roll back records the streak once it holds."""
        if abs(observed_bytes - reserved_bytes) > self.threshold * usable_bytes:
            streak = self._streak.get(accelerator_id, 0) + 1
            drift = Drift(accelerator_id, observed_bytes, reserved_bytes, usable_bytes)
            return (drift if streak == self.consecutive else None), streak
        return None, 0

    def record(self, accelerator_id: str, streak: int) -> None:
        if streak:
            self._streak[accelerator_id] = streak
        else:
            self._streak.pop(accelerator_id, None)
