"""The rebalancer's detectors: a threshold over telemetry that must hold for a sustained window.

One ``SustainedDetector`` per ``Rule`` tracks many targets (a GPU, a node, a TPU pod, an allocation),
each keyed by a string. A target moves ok -> pending -> firing and back:

- ok + condition -> pending (``since`` = the sample's time); a rule with ``window_s == 0`` fires at once.
- pending: the condition holds on every sample for ``window_s`` -> firing; one sample without it -> ok,
  so a spike shorter than the window never fires.
- firing: clears only once the value is past the clear level (the threshold minus the hysteresis for an
  above-rule, plus it for a below-rule) on every sample for ``clear_window_s``; a value between the
  threshold and the clear level keeps it firing and restarts the clear timer, so a value oscillating
  around the threshold neither clears nor fires again.

Pure: no IO and no clock; every call that needs the time takes ``now`` (an aware datetime) from the
caller, so every rule is tested with a fake clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

Phase = Literal["ok", "pending", "firing"]


@dataclass(frozen=True, slots=True)
class Rule:
    """A sustained-threshold rule: ``value > threshold`` (or ``<`` when ``above`` is False) on every
    sample for ``window_s`` seconds fires it; the value past ``threshold -/+ hysteresis`` on every
    sample for ``clear_window_s`` (None: ``window_s``) clears it. A target with no sample for
    ``stale_s`` (None: 3 x max(window_s, 10)) is forgotten by ``SustainedDetector.sweep``."""

    name: str
    threshold: float
    window_s: float
    above: bool = True
    hysteresis: float = 0.05
    clear_window_s: float | None = None
    stale_s: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a rule needs a name")
        if not math.isfinite(self.threshold):
            raise ValueError(f"rule {self.name}: threshold must be finite, got {self.threshold}")
        if not (math.isfinite(self.window_s) and self.window_s >= 0):
            raise ValueError(f"rule {self.name}: window_s must be >= 0, got {self.window_s}")
        if not (math.isfinite(self.hysteresis) and self.hysteresis >= 0):
            raise ValueError(f"rule {self.name}: hysteresis must be >= 0, got {self.hysteresis}")
        if self.clear_window_s is not None and not (math.isfinite(self.clear_window_s) and self.clear_window_s >= 0):
            raise ValueError(f"rule {self.name}: clear_window_s must be >= 0, got {self.clear_window_s}")
        if self.stale_s is not None and not (math.isfinite(self.stale_s) and self.stale_s > 0):
            raise ValueError(f"rule {self.name}: stale_s must be > 0, got {self.stale_s}")


HOT = Rule("hbm_hot", 0.85, 60)
"""The brief (S1 §6.3): HBM use above 0.85 for 1 minute triggers replicating onto an idle GPU."""

COLD = Rule("hbm_cold", 0.30, 300, above=False)
"""The brief (S1 §6.3): HBM use below 0.30 for 5 minutes (a typical quiet period) triggers consolidating
onto fewer GPUs, so that freed nodes can sleep."""

FRAGMENTATION = Rule("tpu_fragmentation", 0.3, 60)
"""The brief (S1 §10): TPU slice fragmentation above 0.3 warns that the pod needs re-sharding (ideal:
below 0.1). The brief names no duration; 60 s keeps one allocation's churn from starting a
defragmentation."""

PCIE = Rule("pcie_hot", 0.7, 60)
"""The brief (S1 §5.1, §10): PCIe bandwidth use above 0.7 for over 1 minute: the scheduler holds back
cold-start work (model loads, batch switches) on that node."""

DRIFT = Rule("hbm_drift", 0.10, 60, hysteresis=0.02)
"""The brief (S2 §7, the sidecar check): an allocation's HBM drift, |observed - reserved| / reserved,
above 10%, checked every 10 s. The brief alerts on one check; 60 s (six checks) keeps a transient
peak (a load, a burst of KV) from flagging the allocation, and the 2-point hysteresis suits a
threshold this small."""


@dataclass(frozen=True, slots=True)
class Transition:
    """A target became firing (``fired``) or cleared back to ok, at ``at``, on a sample of ``value``."""

    rule: str
    key: str
    fired: bool
    at: datetime
    value: float


@dataclass(frozen=True, slots=True)
class TargetState:
    """A pending or firing target. ``since``: pending: when the condition started; firing: when it
    fired. ``value`` and ``seen_at``: the last sample."""

    key: str
    phase: Phase
    since: datetime
    value: float
    seen_at: datetime


@dataclass(slots=True)
class _Track:
    phase: Phase
    since: datetime
    value: float
    seen_at: datetime
    clear_since: datetime | None = None  # firing: when the current run of clear samples started


class SustainedDetector:
    """Applies one ``Rule`` to the samples of many targets (see the module docstring for the states)."""

    def __init__(self, rule: Rule) -> None:
        self._rule = rule
        self._clear_window_s = rule.window_s if rule.clear_window_s is None else rule.clear_window_s
        self._stale_s = 3 * max(rule.window_s, 10.0) if rule.stale_s is None else rule.stale_s
        # Rounded so that 0.85 - 0.05 is 0.80 as the operator wrote it, not 0.7999999999999999.
        offset = -rule.hysteresis if rule.above else rule.hysteresis
        self._clear_level = round(rule.threshold + offset, 9)
        self._tracks: dict[str, _Track] = {}

    @property
    def rule(self) -> Rule:
        return self._rule

    def _holds(self, value: float) -> bool:
        rule = self._rule
        return value > rule.threshold if rule.above else value < rule.threshold

    def _clears(self, value: float) -> bool:
        return value <= self._clear_level if self._rule.above else value >= self._clear_level

    def _transition(self, key: str, *, fired: bool, at: datetime, value: float) -> Transition:
        return Transition(rule=self._rule.name, key=key, fired=fired, at=at, value=value)

    def observe(self, key: str, value: float, now: datetime) -> Transition | None:
        """Take one sample of ``key``; the transition it causes, if any. A NaN value, or a sample older
        than the target's last one, is ignored (None). A gap of ``stale_s`` or more since the last
        sample restarts a pending or clear timer: a condition is sustained only over samples seen."""
        _aware(now)
        if math.isnan(value):
            return None
        track = self._tracks.get(key)
        if track is None:
            track = self._tracks[key] = _Track(phase="ok", since=now, value=value, seen_at=now)
        elif now < track.seen_at:
            return None
        gap_s = (now - track.seen_at).total_seconds()
        track.value, track.seen_at = value, now
        stale = gap_s >= self._stale_s
        if track.phase == "ok":
            if not self._holds(value):
                return None
            track.phase, track.since = "pending", now
        elif track.phase == "pending":
            if not self._holds(value):
                track.phase = "ok"
                return None
            if stale:
                track.since = now
        if track.phase == "pending":
            if (now - track.since).total_seconds() >= self._rule.window_s:
                track.phase, track.since, track.clear_since = "firing", now, None
                return self._transition(key, fired=True, at=now, value=value)
            return None
        # firing
        if not self._clears(value):
            track.clear_since = None
            return None
        if track.clear_since is None or stale:
            track.clear_since = now
        if (now - track.clear_since).total_seconds() >= self._clear_window_s:
            track.phase, track.since, track.clear_since = "ok", now, None
            return self._transition(key, fired=False, at=now, value=value)
        return None

    def sweep(self, now: datetime) -> list[Transition]:
        """Forget every target with no sample for ``stale_s`` (its source went silent); a firing one
        yields a cleared transition at ``now`` with its last value. Sorted by key."""
        _aware(now)
        out: list[Transition] = []
        for key in sorted(self._tracks):
            track = self._tracks[key]
            if (now - track.seen_at).total_seconds() >= self._stale_s:
                del self._tracks[key]
                if track.phase == "firing":
                    out.append(self._transition(key, fired=False, at=now, value=track.value))
        return out

    def forget(self, key: str) -> Transition | None:
        """The target is gone (a replica released, a node removed): drop it. A firing one yields a
        cleared transition dated at its last sample, the last time anything was known of it."""
        track = self._tracks.pop(key, None)
        if track is None or track.phase != "firing":
            return None
        return self._transition(key, fired=False, at=track.seen_at, value=track.value)

    def targets(self) -> list[TargetState]:
        """The pending and firing targets, sorted by key."""
        return [
            TargetState(key=key, phase=t.phase, since=t.since, value=t.value, seen_at=t.seen_at)
            for key, t in sorted(self._tracks.items())
            if t.phase != "ok"
        ]

    def firing(self) -> list[str]:
        """The keys of the firing targets, sorted."""
        return sorted(key for key, t in self._tracks.items() if t.phase == "firing")

    @property
    def state(self) -> Phase:
        """firing if any target fires, else pending if any is pending, else ok."""
        phases = {t.phase for t in self._tracks.values()}
        if "firing" in phases:
            return "firing"
        return "pending" if "pending" in phases else "ok"


def _aware(now: datetime) -> None:
    # A naive datetime would compare wrongly with (or raise against) the aware ones already stored.
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError(f"now must be an aware datetime, got {now!r}")
