"""Per-tenant fairness: start-time fair queueing across tenants, shaped by a token bucket per tenant.

Each tenant's items wait in arrival order. The next item served comes from the tenant whose next item
has the smallest virtual finish tag, ``max(virtual_time, tenant_last_finish) + cost / weight`` (the virtual
time taken when the tenant's backlog began), among tenants whose token bucket covers the item's cost (in
profile); tenants out of profile are served only when no in-profile item can be (work conserving), and
such service spends what is left in their bucket. Serving moves the virtual time to the served item's
start tag (to the largest finish tag when the queue empties), so a tenant that was idle re-enters at the
present and banks no credit, and a tenant that floods only pushes its own tags ahead: with equal
weights two backlogged tenants alternate.

Ties go to the earlier arrival. Every queued item's tag is fixed by its tenant's chain, so the order
successive pops give at a frozen time is a sort by (out of profile, finish tag, arrival): ``position``
counts in that order without simulating it.

Time is ``now_ms`` from the caller; nothing here reads a clock.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

_EPSILON = 1e-9  # refills in float steps (0.1 + 0.2 ...) must still add up to a whole token


@dataclass
class TokenBucket:
    """``burst`` tokens at most, refilled at ``rate_per_s``. A new bucket starts full; ``updated_ms``
    None means it has not seen the clock yet (its first call starts it)."""

    rate_per_s: float
    burst: float
    tokens: float = float("inf")
    updated_ms: float | None = None

    def __post_init__(self) -> None:
        if self.rate_per_s < 0 or self.burst < 0:
            raise ValueError(f"token bucket: rate_per_s and burst must be >= 0, got {self.rate_per_s}, {self.burst}")
        self.tokens = min(self.tokens, self.burst)

    def peek(self, now_ms: float) -> float:
        """The tokens there would be at ``now_ms``, without taking any. A clock going back refills nothing."""
        if self.updated_ms is None or now_ms <= self.updated_ms:
            return self.tokens
        return min(self.burst, self.tokens + (now_ms - self.updated_ms) * self.rate_per_s / 1000)

    def take(self, now_ms: float, n: float = 1.0) -> bool:
        """Take ``n`` tokens if there are that many at ``now_ms``; False (and nothing taken) otherwise."""
        self.tokens = self.peek(now_ms)
        self.updated_ms = now_ms if self.updated_ms is None else max(self.updated_ms, now_ms)
        if self.tokens + _EPSILON < n:
            return False
        self.tokens = max(0.0, self.tokens - n)
        return True


@dataclass(slots=True)
class _Entry(Generic[T]):
    key: str
    item: T
    tenant: str
    offered_ms: float
    cost: float
    seq: int  # arrival order across tenants: ties go to the earlier item


@dataclass
class _Chain:
    """A tenant's queued items in service order: their (finish tag, arrival) and the tokens the first j+1 need."""

    keys: list[str]
    tags: list[tuple[float, int]]
    tokens_needed: list[float]
    index: dict[str, int]


class FairQueue(Generic[T]):
    """Weighted fair queue of keyed items across tenants, each tenant shaped by its own token bucket.

    ``rate_per_s`` and ``burst`` size every tenant's bucket, in units of item cost; ``ttl_ms`` is how long
    an item may wait before ``expire`` drops it. Weights default to 1.0.
    """

    def __init__(
        self, *, rate_per_s: float, burst: float, ttl_ms: float, weights: Mapping[str, float] | None = None
    ) -> None:
        TokenBucket(rate_per_s, burst)  # validates
        if ttl_ms <= 0:
            raise ValueError(f"ttl_ms: expected > 0, got {ttl_ms}")
        self._rate_per_s = rate_per_s
        self._burst = burst
        self._ttl_ms = ttl_ms
        self._weights: dict[str, float] = {}
        self._entries: dict[str, _Entry[T]] = {}
        self._queues: dict[str, dict[str, None]] = {}  # tenant -> its keys in arrival order
        self._buckets: dict[str, TokenBucket] = {}
        self._floor: dict[str, float] = {}  # virtual time when the tenant's backlog began
        self._last_finish: dict[str, float] = {}
        self._chains: dict[str, _Chain] = {}  # cache, rebuilt per tenant after a change
        self._virtual_time = 0.0
        self._seq = 0
        self._now_ms = 0.0
        for tenant, weight in (weights or {}).items():
            self.set_weight(tenant, weight)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[str]:
        """Keys in arrival order."""
        return iter(list(self._entries))

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def set_weight(self, tenant: str, weight: float) -> None:
        """A tenant's share relative to others (default 1.0); its queued items' tags follow it."""
        if not weight > 0:
            raise ValueError(f"weight of {tenant}: expected > 0, got {weight}")
        self._weights[tenant] = weight
        self._chains.pop(tenant, None)

    def offer(self, key: str, item: T, *, tenant: str, now_ms: float, cost: float = 1.0) -> int:
        """Queue ``item`` under ``key`` for ``tenant``; returns its 1-based position in service order.

        Offering a key already queued changes nothing and returns its position (a redelivered request).
        """
        if not cost > 0:
            raise ValueError(f"cost: expected > 0, got {cost}")
        self._tick(now_ms)
        if key not in self._entries:
            entry = _Entry(key, item, tenant, now_ms, cost, self._seq)
            self._seq += 1
            self._entries[key] = entry
            if tenant not in self._queues:
                self._queues[tenant] = {}
                self._floor[tenant] = self._virtual_time
            self._queues[tenant][key] = None
            chain = self._chains.get(tenant)
            if chain is not None:
                self._extend(chain, entry)
        position = self.position(key)
        assert position is not None
        return position

    def serve_now(self, tenant: str, now_ms: float, cost: float = 1.0) -> bool:
        """Serve an item of ``tenant`` on arrival, while nothing is queued: charged exactly as ``offer``
        then ``pop`` would charge it (its tenant's bucket and finish tag, the virtual time), without
        queueing it. False, with nothing charged, when items are queued: it must take its turn (``offer``)."""
        if self._entries:
            return False
        if not cost > 0:
            raise ValueError(f"cost: expected > 0, got {cost}")
        self._tick(now_ms)
        self._seq += 1  # as offer's entry would have taken
        start = max(self._virtual_time, self._last_finish.get(tenant, 0.0))  # the floor offer sets is the vt
        finish = start + cost / self.weight(tenant)
        bucket = self._bucket(tenant)
        tokens = self._tokens_for(cost)
        available = bucket.peek(now_ms)
        bucket.take(now_ms, available if available + _EPSILON < tokens else tokens)
        self._virtual_time = max(self._virtual_time, start)
        self._last_finish[tenant] = finish
        self._virtual_time = max(self._virtual_time, *self._last_finish.values())  # the queue is empty again
        self._forget_idle(now_ms)
        return True

    def position(self, key: str) -> int | None:
        """1-based position of ``key`` in the order successive pops would serve the queue at the last
        time seen, if every item could be served (an estimate: arrivals, refills and ``can_serve`` change it)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        own = self._chain(entry.tenant)
        i = own.index[key]
        late = i >= self._in_profile(entry.tenant, own)
        ahead = 0
        for tenant in self._queues:
            chain = self._chain(tenant)
            split = self._in_profile(tenant, chain)
            if late:  # all of their in-profile items, then their late ones with a smaller tag
                ahead += bisect_left(chain.tags, own.tags[i], lo=split)
            else:
                ahead += bisect_left(chain.tags, own.tags[i], hi=split)
        return ahead + 1

    def pop(self, now_ms: float, can_serve: Callable[[T], bool] = lambda _: True) -> tuple[str, T] | None:
        """Remove and return the next item to serve at ``now_ms``, or None when no queued item can be served.

        Items ``can_serve`` rejects stay queued and block nobody: the tenant's next item or another
        tenant's may go instead.
        """
        self._tick(now_ms)
        best: tuple[tuple[bool, float, int], _Entry[T], float] | None = None
        for tenant, keys in self._queues.items():
            entry = next((self._entries[k] for k in keys if can_serve(self._entries[k].item)), None)
            if entry is None:
                continue
            start = self._start(tenant)
            finish = start + entry.cost / self.weight(tenant)
            late = self._bucket(tenant).peek(now_ms) + _EPSILON < self._tokens_for(entry.cost)
            rank = (late, finish, entry.seq)
            if best is None or rank < best[0]:
                best = (rank, entry, start)
        if best is None:
            return None
        (late, finish, _), entry, start = best
        bucket = self._bucket(entry.tenant)
        # Out-of-profile service spends whatever is left, so a tenant's in-profile items stay a prefix.
        bucket.take(now_ms, bucket.peek(now_ms) if late else self._tokens_for(entry.cost))
        self._virtual_time = max(self._virtual_time, start)
        self._last_finish[entry.tenant] = finish
        self._drop(entry.key)
        if not self._entries:  # the end of a busy period: nothing queued is owed anything
            self._virtual_time = max(self._virtual_time, *self._last_finish.values())
        self._forget_idle(now_ms)
        return entry.key, entry.item

    def remove(self, key: str) -> T | None:
        """Take ``key`` out of the queue (cancelled); its item, or None when it was not queued."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._drop(key)
        return entry.item

    def expire(self, now_ms: float) -> list[tuple[str, T]]:
        """Drop and return, in arrival order, the items that have waited longer than ``ttl_ms``."""
        self._tick(now_ms)
        old = [e for e in self._entries.values() if now_ms - e.offered_ms > self._ttl_ms]
        for entry in old:
            self._drop(entry.key)
        return [(e.key, e.item) for e in old]

    # -- internals

    def _tick(self, now_ms: float) -> None:
        self._now_ms = max(self._now_ms, now_ms)

    def _bucket(self, tenant: str) -> TokenBucket:
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = TokenBucket(self._rate_per_s, self._burst)
        return bucket

    def _tokens_for(self, cost: float) -> float:
        # An item costlier than the burst still goes in profile from a full bucket.
        return min(cost, self._burst) if self._burst > 0 else float("inf")

    def _start(self, tenant: str) -> float:
        return max(self._floor[tenant], self._last_finish.get(tenant, 0.0))

    def _extend(self, chain: _Chain, entry: _Entry[T]) -> None:
        finish = chain.tags[-1][0] if chain.tags else self._start(entry.tenant)
        needed = chain.tokens_needed[-1] if chain.tokens_needed else 0.0
        chain.index[entry.key] = len(chain.keys)
        chain.keys.append(entry.key)
        chain.tags.append((finish + entry.cost / self.weight(entry.tenant), entry.seq))
        chain.tokens_needed.append(needed + self._tokens_for(entry.cost))

    def _chain(self, tenant: str) -> _Chain:
        chain = self._chains.get(tenant)
        if chain is None:
            chain = self._chains[tenant] = _Chain([], [], [], {})
            for key in self._queues[tenant]:
                self._extend(chain, self._entries[key])
        return chain

    def _in_profile(self, tenant: str, chain: _Chain) -> int:
        """How many of the tenant's first items its bucket covers at the last time seen."""
        return bisect_right(chain.tokens_needed, self._bucket(tenant).peek(self._now_ms) + _EPSILON)

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key)
        queue = self._queues[entry.tenant]
        del queue[key]
        if not queue:
            del self._queues[entry.tenant]
            del self._floor[entry.tenant]
        self._chains.pop(entry.tenant, None)

    def _forget_idle(self, now_ms: float) -> None:
        """Drop the state of tenants with nothing queued that it no longer affects, so it stays bounded."""
        for tenant in [t for t in self._last_finish if t not in self._queues]:
            if self._last_finish[tenant] <= self._virtual_time:
                del self._last_finish[tenant]
        for tenant in [t for t in self._buckets if t not in self._queues]:
            if self._buckets[tenant].peek(now_ms) >= self._burst:
                del self._buckets[tenant]
