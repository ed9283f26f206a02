"""Listing placed replicas (shared/domain/placement/listing.py): the state placement tells, which ids a
state filter keeps, the cursor and the page end, and the paging they make together."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.domain.placement.listing import (
    Position,
    ReplicaState,
    StateFilter,
    decode_cursor,
    encode_cursor,
    gpu_indices,
    index_ranges,
    page_end,
    replica_state,
    state_filter,
)


@pytest.mark.parametrize(
    ("draining", "serving", "state"),
    [
        (False, False, ReplicaState.PLACED),  # reserved; its engine not heard from (or not lately)
        (False, True, ReplicaState.READY),
        (True, False, ReplicaState.DRAINING),
        (True, True, ReplicaState.DRAINING),  # its engine still serves the requests in flight: draining wins
    ],
)
def test_the_state_placement_tells(draining: bool, serving: bool, state: ReplicaState) -> None:
    assert replica_state(draining=draining, serving=serving) is state


DRAINING = {"al-d", "al-ds"}  # al-ds: draining, its engine still reporting
SERVING = {"al-s", "al-ds"}


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (None, StateFilter()),
        (ReplicaState.DRAINING, StateFilter(only=frozenset({"al-d", "al-ds"}))),
        (ReplicaState.READY, StateFilter(only=frozenset({"al-s"}))),  # al-ds is draining, not ready
        (ReplicaState.PLACED, StateFilter(excluding=frozenset({"al-d", "al-ds", "al-s"}))),
        (ReplicaState.STARTING, StateFilter(only=frozenset())),  # not told by placement yet: none
        (ReplicaState.FAILED, StateFilter(only=frozenset())),
    ],
)
def test_a_state_filter_keeps_the_ids_in_that_state(state: ReplicaState | None, expected: StateFilter) -> None:
    assert state_filter(state, draining=DRAINING, serving=SERVING) == expected


@given(
    ids=st.sets(st.sampled_from([f"al-{i}" for i in range(12)])),
    draining=st.sets(st.sampled_from([f"al-{i}" for i in range(12)])),
    serving=st.sets(st.sampled_from([f"al-{i}" for i in range(12)])),
)
def test_every_replica_is_kept_by_exactly_the_filter_of_its_state(
    ids: set[str], draining: set[str], serving: set[str]
) -> None:
    for replica in ids:
        state = replica_state(draining=replica in draining, serving=replica in serving)
        for wanted in ReplicaState:
            kept = state_filter(wanted, draining=draining, serving=serving)
            keeps = (kept.only is None or replica in kept.only) and replica not in kept.excluding
            assert keeps == (wanted is state), (replica, wanted, state)


# -- the cursor --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "position",
    [
        Position("acme", "req-1"),
        Position("ünïcødé tenant", 'id with spaces/and "quotes"'),
        Position("a" * 200, "r" * 200),  # the longest names a contract takes
    ],
)
def test_a_cursor_names_the_position_it_was_made_from(position: Position) -> None:
    cursor = encode_cursor(position)
    assert decode_cursor(cursor) == position
    assert all(c.isalnum() or c in "-_" for c in cursor)  # URL-safe, no padding: pasteable into a shell


def _b64(raw: str) -> str:
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    "cursor",
    [
        "not a cursor!",  # not base64
        _b64("{}"),  # JSON, but not ours
        _b64(json.dumps([2, "acme", "req-1"])),  # another cursor version
        _b64(json.dumps([1, "acme"])),  # short
        _b64(json.dumps([1, "acme", 5])),  # a number for an id
        _b64(json.dumps([1, "", "req-1"])),  # an empty tenant
        base64.urlsafe_b64encode(b"\xff\xfe").decode(),  # not UTF-8
    ],
)
def test_a_cursor_this_service_did_not_issue_is_refused(cursor: str) -> None:
    with pytest.raises(ValueError, match="not a cursor"):
        decode_cursor(cursor)


# -- pages ---------------------------------------------------------------------------------------------------


def _pos(row: Position) -> Position:
    return row


@pytest.mark.parametrize(
    ("fetched", "limit", "kept", "more"),
    [
        (0, 3, 0, False),
        (2, 3, 2, False),
        (3, 3, 3, False),  # exactly a page: no next page (the store fetched limit + 1 and got no extra)
        (4, 3, 3, True),  # one left over: a next page, starting after the third
    ],
)
def test_a_page_ends_after_limit_rows_with_a_cursor_when_more_follow(
    fetched: int, limit: int, kept: int, more: bool
) -> None:
    rows = [Position("t", f"r{i}") for i in range(fetched)]
    page, cursor = page_end(rows, limit, _pos)
    assert page == rows[:kept]
    assert (cursor is not None) is more
    if cursor is not None:
        assert decode_cursor(cursor) == rows[kept - 1]


def _fetch(table: Sequence[Position], after: Position | None, limit: int) -> list[Position]:
    """The store's query, in memory: the rows after ``after`` in listing order, at most ``limit``."""
    return [row for row in sorted(table) if after is None or row > after][:limit]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.sets(st.tuples(st.sampled_from(["acme", "globex", "initech", "é"]), st.text(min_size=1, max_size=4))),
    limit=st.integers(min_value=1, max_value=7),
    churn=st.lists(
        st.tuples(st.booleans(), st.tuples(st.sampled_from(["acme", "globex", "zeta"]), st.text(min_size=1))),
        max_size=6,
    ),
)
def test_paging_lists_every_row_that_stays_exactly_once(
    rows: set[tuple[str, str]], limit: int, churn: list[tuple[bool, tuple[str, str]]]
) -> None:
    """Keyset paging, as the store and ``page_end`` do it: following each page's cursor lists every row that
    is there throughout exactly once, in order, while others come and go between pages."""
    table = {Position(t, r) for t, r in rows}
    stayed = set(table)
    seen: list[Position] = []
    after: Position | None = None
    for _ in range(len(rows) + len(churn) + 2):
        page, cursor = page_end(_fetch(sorted(table), after, limit + 1), limit, _pos)
        seen.extend(page)
        if churn:  # between two pages a replica is placed or one ends
            added, (tenant, request_id) = churn.pop(0)
            change = Position(tenant, request_id)
            if added:
                table.add(change)
            else:
                table.discard(change)
                stayed.discard(change)
            stayed &= table
        if cursor is None:
            break
        after = decode_cursor(cursor)
    assert seen == sorted(seen), "in listing order"
    assert len(seen) == len(set(seen)), "none twice"
    assert stayed <= set(seen), "none that stayed is skipped"


# -- GPU indices -------------------------------------------------------------------------------------------


def test_gpu_indices_come_from_accelerator_ids() -> None:
    ids = ["dgx-h100-01/gpu3", "dgx-h100-01/gpu10", "v5e-pod-1/0.1", "odd/gpux"]
    assert gpu_indices(ids) == [3, 10]  # TPU chips and ids that are not GPUs are left out


@pytest.mark.parametrize(
    ("indices", "text"),
    [([], ""), ([5], "5"), ([0, 1, 2, 3], "0-3"), ([3, 0, 1, 6, 7, 9], "0-1,3,6-7,9"), ([2, 2, 3], "2-3")],
)
def test_index_ranges(indices: list[int], text: str) -> None:
    assert index_ranges(indices) == text
