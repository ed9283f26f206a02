"""Request deadlines (API.md "Deadlines"): a caller says until when its answer is worth anything.

``RpcClient`` sends the deadline as the ``Hetsched-Deadline`` header (milliseconds since the epoch,
UTC); the request server sets it for the handler's task, where ``deadline.expired()`` and
``deadline.remaining_s()`` tell whether the caller is still there. Work whose caller has gone is
dropped before deciding or committing, and calls made on its behalf inherit what is left of it.
"""

from __future__ import annotations

import time
from contextvars import ContextVar

HEADER = "Hetsched-Deadline"

_deadline_ms: ContextVar[float | None] = ContextVar("hetsched_deadline_ms", default=None)


def now_ms() -> float:
    return time.time() * 1000


def set_deadline(deadline_ms: float | None) -> None:
    """Set the current task's deadline (the request server does this per request)."""
    _deadline_ms.set(deadline_ms)


def current() -> float | None:
    """The current request's deadline in epoch milliseconds, or None when the caller set none."""
    return _deadline_ms.get()


def remaining_s(*, default_s: float | None = None) -> float | None:
    """Seconds left before the current deadline (never below 0), else ``default_s``."""
    deadline = _deadline_ms.get()
    if deadline is None:
        return default_s
    return max(0.0, (deadline - now_ms()) / 1000)


def expired() -> bool:
    """True when the current request's caller has already given up."""
    deadline = _deadline_ms.get()
    return deadline is not None and now_ms() >= deadline


def parse_header(value: str | None) -> float | None:
    """A header value as epoch milliseconds; None when absent or unreadable (then no deadline)."""
    if not value or len(value) > 20:
        return None
    try:
        parsed = float(value)
    except ValueError:
        return None
    return parsed if parsed > 0 else None
