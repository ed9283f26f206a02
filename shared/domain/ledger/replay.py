"""Per-accelerator reserved bytes, and per-cluster cross-domain traffic, folded from the LEDGER stream's
allocation events.

The one fold of ledger events: the ledger's replay check uses ``replay_reserved`` (and
``replay_cross_domain``); a read model that starts from ``ledger.snapshot`` and follows the stream
applies ``apply_allocation_event`` (and ``cross_domain_delta``) per event. Payloads are the
``AllocationEvent`` contract (anything with its fields, see ``AllocationPayload`` and
``CrossDomainPayload``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Final, Protocol, TypeVar

COMMITTED: Final = "allocation_committed"
RELEASED: Final = "allocation_released"
EXPIRED: Final = "allocation_expired"
ALLOCATION_EVENTS: Final = frozenset({COMMITTED, RELEASED, EXPIRED})


class SharePayload(Protocol):
    @property
    def accelerator_id(self) -> str: ...
    @property
    def total_bytes(self) -> int: ...


class AllocationPayload(Protocol):
    """What the fold reads of an allocation event (``shared.contracts.ledger.AllocationEvent``)."""

    @property
    def allocation_id(self) -> str: ...
    @property
    def counts_against_hbm(self) -> bool: ...
    @property
    def shares(self) -> Sequence[SharePayload]: ...


class CrossDomainPayload(Protocol):
    """What the cross-domain fold reads of an allocation event."""

    @property
    def allocation_id(self) -> str: ...
    @property
    def counts_against_hbm(self) -> bool: ...
    @property
    def cluster(self) -> str | None: ...
    @property
    def cross_domain_bytes_per_s(self) -> int: ...


class _Identified(Protocol):
    @property
    def allocation_id(self) -> str: ...


P = TypeVar("P", bound=_Identified)


def allocation_delta(name: str, payload: AllocationPayload) -> dict[str, int]:
    """Signed bytes per accelerator an allocation event moves: ``allocation_committed`` adds its
    shares, ``allocation_released`` / ``allocation_expired`` give them back; a request allocation
    (inside its replica's KV pool) and any other event move nothing."""
    if name not in ALLOCATION_EVENTS or not payload.counts_against_hbm:
        return {}
    sign = 1 if name == COMMITTED else -1
    delta: dict[str, int] = {}
    for share in payload.shares:
        delta[share.accelerator_id] = delta.get(share.accelerator_id, 0) + sign * share.total_bytes
    return delta


def apply_allocation_event(reserved: dict[str, int], name: str, payload: AllocationPayload) -> None:
    """Fold one event into ``reserved`` (accelerator id -> bytes) in place; zero totals are dropped.

    The caller applies each event once (an inbox, or ``replay_reserved``'s bookkeeping)."""
    for accelerator_id, bytes_ in allocation_delta(name, payload).items():
        total = reserved.get(accelerator_id, 0) + bytes_
        if total:
            reserved[accelerator_id] = total
        else:
            reserved.pop(accelerator_id, None)


def cross_domain_delta(name: str, payload: CrossDomainPayload) -> dict[str, int]:
    """Signed bytes/s of TP traffic across NVLink domains an allocation event moves, per cluster:
    ``allocation_committed`` adds the replica's, ``allocation_released`` / ``allocation_expired`` take
    it back; nothing for a request allocation, a replica without such traffic or an unknown cluster."""
    if (
        name not in ALLOCATION_EVENTS
        or not payload.counts_against_hbm
        or payload.cluster is None
        or payload.cross_domain_bytes_per_s <= 0
    ):
        return {}
    sign = 1 if name == COMMITTED else -1
    return {payload.cluster: sign * payload.cross_domain_bytes_per_s}


def _each_once(events: Iterable[tuple[str, P]]) -> Iterator[tuple[str, P]]:
    """The allocation events that change something, each allocation counted once however often its
    events are redelivered: a commit seen again, or an end of an allocation that is not live, is skipped."""
    live: set[str] = set()
    ended: set[str] = set()
    for name, payload in events:
        allocation = payload.allocation_id
        if name == COMMITTED:
            if allocation in live or allocation in ended:
                continue
            live.add(allocation)
        elif name in (RELEASED, EXPIRED):
            if allocation not in live:
                continue
            live.discard(allocation)
            ended.add(allocation)
        else:
            continue
        yield name, payload


def replay_reserved(events: Iterable[tuple[str, AllocationPayload]]) -> dict[str, int]:
    """Per-accelerator reserved bytes rebuilt from (event name, payload) pairs in stream order.

    Each allocation counts once, however often its events are redelivered: a commit seen again, or
    an end of an allocation that is not live, changes nothing."""
    reserved: dict[str, int] = {}
    for name, payload in _each_once(events):
        apply_allocation_event(reserved, name, payload)
    return reserved


def replay_cross_domain(events: Iterable[tuple[str, CrossDomainPayload]]) -> dict[str, int]:
    """Per-cluster cross-domain bytes/s of the live allocations, rebuilt from (event name, payload) pairs
    in stream order, each allocation once (as ``replay_reserved``); clusters at 0 are dropped."""
    used: dict[str, int] = {}
    for name, payload in _each_once(events):
        for cluster, delta in cross_domain_delta(name, payload).items():
            total = used.get(cluster, 0) + delta
            if total:
                used[cluster] = total
            else:
                used.pop(cluster, None)
    return used
