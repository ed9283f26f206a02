"""Drift: observed HBM use (telemetry) against the bytes the ledger reserved."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    ends the episode, so the next streak is reported again."""

    threshold: float = 0.10
    consecutive: int = 2
    _streak: dict[str, int] = field(default_factory=dict)

    def observe(
        self, *, accelerator_id: str, observed_bytes: int, reserved_bytes: int, usable_bytes: int
    ) -> Drift | None:
        if abs(observed_bytes - reserved_bytes) > self.threshold * usable_bytes:
            streak = self._streak.get(accelerator_id, 0) + 1
            self._streak[accelerator_id] = streak
            if streak == self.consecutive:
                return Drift(accelerator_id, observed_bytes, reserved_bytes, usable_bytes)
            return None
        self._streak.pop(accelerator_id, None)
        return None
