"""When a draining replica may be released: its engine's own reports tell what it still has in flight.

A plan tells a replica draining (admission sends it nothing new), then releases it once its requests in
flight are done. The engine reports its queue and KV use (``engine_status``); the rule reads the latest
report of the replica against when its drain started. Pure: ``now`` is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum


@dataclass(frozen=True, slots=True)
class EngineReport:
    """A replica's latest engine report: requests queued, KV in use, when it was made."""

    queue_depth: int
    kv_used_bytes: int
    at: datetime

    @property
    def idle(self) -> bool:
        return self.queue_depth == 0 and self.kv_used_bytes == 0


class Drained(StrEnum):
    """Whether a draining replica may be released now, and why."""

    WAIT = "wait"  # its engine reported work (or has not reported since the drain started)
    UNREPORTED = "unreported"  # no engine report ever seen: nothing is known in flight
    IDLE = "idle"  # a report made after the drain started shows no queue and no KV in use
    TIMED_OUT = "timed_out"  # the drain lasted its timeout: released with work possibly in flight


def drained(report: EngineReport | None, *, started: datetime, now: datetime, timeout_s: float) -> Drained:
    """May the replica drained since ``started`` be released at ``now``? ``report``: its engine's latest."""
    if report is None:
        return Drained.UNREPORTED
    if report.at > started and report.idle:
        return Drained.IDLE
    if (now - started).total_seconds() >= timeout_s:
        return Drained.TIMED_OUT
    return Drained.WAIT
