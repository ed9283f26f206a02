"""The order one pass visits placement's queue in (issue 23): round robin by tenant, each tenant's
requests in arrival order, tenants in the order of their oldest request. So a tenant's backlog, however
long, delays another tenant's request by at most one of its own per turn: with room for two, the first
requests of two tenants are placed, not the first two of the busier one."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def round_robin(items: Iterable[T], *, tenant: Callable[[T], str]) -> list[T]:
    """``items`` (in arrival order) interleaved by ``tenant``: the first of each tenant, then the second
    of each, and so on; tenants in the order their first item came."""
    lanes: dict[str, list[T]] = {}
    for item in items:
        lanes.setdefault(tenant(item), []).append(item)
    order: list[T] = []
    active = list(lanes.values())
    turn = 0
    while active:  # O(items): a lane leaves once it is exhausted
        order.extend(lane[turn] for lane in active)
        turn += 1
        active = [lane for lane in active if len(lane) > turn]
    return order
