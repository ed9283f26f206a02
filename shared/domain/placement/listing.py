"""Listing placed replicas (``placement.replicas``): the lifecycle state placement can tell for a replica,
which replicas a state filter keeps, where a page ends (the cursor), and a replica's GPU indices.

The list comes from placement's own decisions (a replica is known by the allocation id ``placement.place``
returned for it), in a fixed order, (tenant, request id), so a page resumes exactly after the last row of the
previous one however replicas come and go meanwhile (keyset paging: nothing is skipped or listed twice among
the replicas that stay)."""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

T = TypeVar("T")


class ReplicaState(StrEnum):
    """A replica's lifecycle (API.md "Replica lifecycle"): ``placed -> starting -> loading -> ready ->
    draining -> stopped | failed``."""

    PLACED = "placed"
    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


def replica_state(*, draining: bool, serving: bool, reported: ReplicaState | None = None) -> ReplicaState:
    """What placement can tell of a live replica: ``reported``, the state its agents' fresh reports fold
    into (``lifecycle.fold``), when there is one; otherwise ``draining`` while the rebalancer moves it off
    (its requests in flight finish, no new one comes), ``ready`` while its engine reports healthy and fresh,
    else ``placed`` (reserved, its engine not heard from, or not lately)."""
    if reported is not None:
        return reported
    if draining:
        return ReplicaState.DRAINING
    if serving:
        return ReplicaState.READY
    return ReplicaState.PLACED


@dataclass(frozen=True, slots=True)
class StateFilter:
    """Which replica ids a state filter keeps, as placement's store can apply it: ``only`` (the ids
    kept; None: no such limit) and ``excluding`` (ids dropped)."""

    only: frozenset[str] | None = None
    excluding: frozenset[str] = frozenset()


def state_filter(
    state: ReplicaState | None,
    *,
    draining: Set[str],
    serving: Set[str],
    reported: Mapping[str, ReplicaState] | None = None,
) -> StateFilter:
    """The ids a listing for ``state`` keeps, given the replicas draining, those whose engines serve, and
    the states the agents' fresh reports fold into (``replica_state``'s precedence: reported first, then
    draining). A replica none of these name is ``placed``."""
    if state is None:
        return StateFilter()
    reported = reported or {}
    states = {
        replica: replica_state(draining=replica in draining, serving=replica in serving, reported=reported.get(replica))
        for replica in {*draining, *serving, *reported}
    }
    if state is ReplicaState.PLACED:
        return StateFilter(excluding=frozenset(r for r, s in states.items() if s is not ReplicaState.PLACED))
    return StateFilter(only=frozenset(r for r, s in states.items() if s is state))


# -- the cursor: where the next page starts ---------------------------------------------------------------

CURSOR_VERSION = 1


@dataclass(frozen=True, slots=True, order=True)
class Position:
    """A replica's place in the listing order: its tenant, then its placement request id."""

    tenant: str
    request_id: str


def encode_cursor(position: Position) -> str:
    """An opaque cursor for the page after ``position`` (URL-safe base64 of a small JSON array)."""
    raw = json.dumps([CURSOR_VERSION, position.tenant, position.request_id], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> Position:
    """The position a cursor from ``encode_cursor`` names; ``ValueError`` for anything else."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        data = json.loads(raw)
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise ValueError("not a cursor this service issued (pass `next_cursor` as it came)") from None
    if (
        not isinstance(data, list)
        or len(data) != 3
        or data[0] != CURSOR_VERSION
        or not all(isinstance(part, str) and part for part in data[1:])
    ):
        raise ValueError("not a cursor this service issued (pass `next_cursor` as it came)")
    return Position(tenant=data[1], request_id=data[2])


def page_end(rows: Sequence[T], limit: int, position: Callable[[T], Position]) -> tuple[list[T], str | None]:
    """One page from ``rows`` fetched as ``limit + 1`` in listing order: the first ``limit`` of them, and
    the cursor of the next page (after the last row kept) when a row was left over; None when none was."""
    if len(rows) <= limit:
        return list(rows), None
    kept = list(rows[:limit])
    return kept, encode_cursor(position(kept[-1]))


# -- GPU indices -------------------------------------------------------------------------------------------

_GPU = re.compile(r"/gpu(\d+)$")


def gpu_indices(accelerators: Iterable[str]) -> list[int]:
    """The GPU indices (CUDA ordinals on the node) of accelerator ids ``<node>/gpu<i>``, in the order given;
    ids that are not GPUs (TPU chips) are left out."""
    out: list[int] = []
    for accelerator in accelerators:
        found = _GPU.search(accelerator)
        if found is not None:
            out.append(int(found.group(1)))
    return out


def index_ranges(indices: Iterable[int]) -> str:
    """Indices as compact ranges, sorted: ``[0, 1, 2, 3, 6]`` -> ``"0-3,6"``; ``""`` for none."""
    ordered = sorted(set(indices))
    parts: list[str] = []
    start = prev = None
    for i in ordered:
        if start is None:
            start = prev = i
        elif prev is not None and i == prev + 1:
            prev = i
        else:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = prev = i
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)
