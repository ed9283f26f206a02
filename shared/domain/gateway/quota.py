"""Per-key quotas: requests and tokens per minute, as token buckets. Pure: the caller passes the time.

A bucket holds at most one minute's allowance and refills continuously; a request takes one request and
its estimated tokens (input + the output it may produce) from the key's two buckets, or neither, and is
told how long to wait (``Retry-After``) until both would have enough.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class Bucket:
    per_minute: float
    level: float = field(init=False)
    at_s: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.level = self.per_minute

    def _refill(self, now_s: float) -> None:
        if now_s > self.at_s:
            self.level = min(self.per_minute, self.level + (now_s - self.at_s) * self.per_minute / 60.0)
        self.at_s = max(self.at_s, now_s)

    def wait_s(self, amount: float, now_s: float) -> float:
        """Seconds until ``amount`` is available (0: now); infinite when it exceeds the bucket itself."""
        self._refill(now_s)
        if amount <= self.level:
            return 0.0
        if amount > self.per_minute:
            return math.inf
        return (amount - self.level) * 60.0 / self.per_minute

    def take(self, amount: float) -> None:
        self.level -= amount


@dataclass(slots=True)
class Quota:
    """One key's buckets; ``None`` limits are unlimited."""

    rpm: int | None
    tpm: int | None
    _requests: Bucket | None = field(init=False)
    _tokens: Bucket | None = field(init=False)

    def __post_init__(self) -> None:
        self._requests = Bucket(self.rpm) if self.rpm else None
        self._tokens = Bucket(self.tpm) if self.tpm else None

    def admit(self, tokens: int, now_s: float) -> float | None:
        """Take one request and ``tokens``; None when taken, else the seconds to wait (``inf``: never, the
        request alone exceeds the per-minute limit)."""
        wait = 0.0
        if self._requests is not None:
            wait = max(wait, self._requests.wait_s(1, now_s))
        if self._tokens is not None:
            wait = max(wait, self._tokens.wait_s(tokens, now_s))
        if wait > 0:
            return wait
        if self._requests is not None:
            self._requests.take(1)
        if self._tokens is not None:
            self._tokens.take(tokens)
        return None


def retry_after(wait_s: float) -> int:
    """The ``Retry-After`` header's whole seconds (at least 1)."""
    return max(1, math.ceil(wait_s))
