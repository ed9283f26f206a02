"""Read-your-writes for reservations (issue 23 row 11), without servers: ``place`` decides only once the
reservation fold has applied the RESERVATION stream up to its end (the kit's ``Follower.caught_up``,
tested in ``tests/unit/test_follow.py``): a reservation answered ``created`` before the request arrived is
in force for it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.placement.attempts import Ownership
from services.placement.handlers import PlacementHandlers
from services.placement.place import Placing
from services.placement.reclaim import RESERVATION_SYNC_S
from shared.contracts.base import Rejected
from shared.contracts.placement import PlaceReply
from shared.contracts.subjects import Rpc
from shared.domain.reservations import Reservation, ReservationBook
from shared.infra import deadline
from tests.fakes import NOW, FakeRpc, FakeUnitOfWork
from tests.unit.services.placement.test_handlers import FakeStore, FakeTimer, committed, fleet_view, place

pytestmark = pytest.mark.asyncio

RESERVED = tuple(f"n1/gpu{i}" for i in range(8))  # every GPU of the one node
HARD = Reservation(id="res-1", tenant="initech", policy="hard", accelerators=RESERVED, created_at=NOW)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


# -- place: decided only once the view is current ---------------------------------------------------


def placing(rpc: FakeRpc, book: ReservationBook, current: Any) -> Placing:
    return PlacementHandlers.build(
        view=fleet_view(),  # one node, n1, 8 GPUs
        store=FakeStore(),
        uow=FakeUnitOfWork(),  # type: ignore[arg-type]
        rpc=rpc,
        timer=FakeTimer(),
        default_lease_s=3600,
        ownership=Ownership(claim_s=5, grace_s=60),
        clock=lambda: NOW,
        reservations=book,
        reservations_current=current,
    ).placing


async def test_a_placement_is_decided_after_the_reservations_answered_before_it_are_in_the_book() -> None:
    book = ReservationBook()
    waits: list[float] = []

    async def current(timeout_s: float) -> str | None:
        waits.append(timeout_s)
        book.apply(HARD)  # the fold applies initech's reservation while the placement waits for it
        return None

    rpc = FakeRpc(ledger_commit=[committed()])
    reply = await placing(rpc, book, current).place(place("r-1", tenant="globex", preemptible=True))
    # Every GPU is initech's (hard): nothing for globex, and nothing was sent to the ledger.
    assert isinstance(reply, PlaceReply) and reply.status == "rejected", reply
    assert rpc.requests(Rpc.LEDGER_COMMIT) == []
    assert waits == [RESERVATION_SYNC_S]


async def test_a_view_not_known_to_be_current_refuses_retryable_and_decides_nothing() -> None:
    waits: list[float] = []

    async def behind(timeout_s: float) -> str | None:
        waits.append(timeout_s)
        return "applied RESERVATION events up to 3 of 5"

    rpc = FakeRpc(ledger_commit=[committed()])
    token = deadline._deadline_ms.set(deadline.now_ms() + 1000)
    try:
        reply = await placing(rpc, ReservationBook(), behind).place(place("r-1", tenant="globex"))
    finally:
        deadline._deadline_ms.reset(token)
    assert isinstance(reply, Rejected) and reply.error.code == "no_capacity", reply
    assert reply.error.details == {"retry_after_s": RESERVATION_SYNC_S}
    assert "3 of 5" in reply.error.message
    assert rpc.sent == []
    assert 0 < waits[0] <= 0.5  # half of what the caller's deadline (1 s) left, at most
