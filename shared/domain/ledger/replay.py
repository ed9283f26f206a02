"""Per-accelerator reserved bytes folded from the LEDGER stream's allocation events.

The one fold of ledger events: the ledger's replay check uses ``replay_reserved``; a read model that
starts from ``ledger.snapshot`` and follows the stream applies ``apply_allocation_event`` per event.
Payloads are the ``AllocationEvent`` contract (anything with its fields, see ``AllocationPayload``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final, Protocol

COMMITTED: Final = "allocation_committed"
RELEASED: Final = "allocation_released"
EXPIRED: Final = "allocation_expired"
ALLOCATION_EVENTS: Final = frozenset({COMMITTED, RELEASED, EXPIRED})


class SharePayload(Protocol):
    @property
    def accelerator_id(self) -> str: ...
    @property
    def total(self) -> int: ...


class AllocationPayload(Protocol):
    """What the fold reads of an allocation event (``shared.contracts.ledger.AllocationEvent``)."""

    @property
    def allocation_id(self) -> str: ...
    @property
    def counts_against_hbm(self) -> bool: ...
    @property
    def shares(self) -> Sequence[SharePayload]: ...


def allocation_delta(name: str, payload: AllocationPayload) -> dict[str, int]:
    """Signed bytes per accelerator an allocation event moves: ``allocation_committed`` adds its
    shares, ``allocation_released`` / ``allocation_expired`` give them back; a request allocation
    (inside its replica's KV pool) and any other event move nothing."""
    if name not in ALLOCATION_EVENTS or not payload.counts_against_hbm:
        return {}
    sign = 1 if name == COMMITTED else -1
    delta: dict[str, int] = {}
    for share in payload.shares:
        delta[share.accelerator_id] = delta.get(share.accelerator_id, 0) + sign * share.total
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


def replay_reserved(events: Iterable[tuple[str, AllocationPayload]]) -> dict[str, int]:
    """Per-accelerator reserved bytes rebuilt from (event name, payload) pairs in stream order.

    Each allocation counts once, however often its events are redelivered: a commit seen again, or
    an end of an allocation that is not live, changes nothing."""
    live: set[str] = set()
    ended: set[str] = set()
    reserved: dict[str, int] = {}
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
        apply_allocation_event(reserved, name, payload)
    return reserved
