"""Clocks handed to services (STYLE §1: time is a parameter). Tests pass their own."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

Clock = Callable[[], datetime]
"""Wall-clock time, timezone-aware UTC: when a state change happened, when a lease ends."""

MonotonicMs = Callable[[], float]
"""A monotonic clock in milliseconds: how long something has been silent or sustained."""


def system_clock() -> datetime:
    return datetime.now(UTC)


def monotonic_ms() -> float:
    return time.monotonic() * 1000
