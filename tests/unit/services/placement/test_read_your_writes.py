"""Read-your-writes for reservations (issue 23 row 11), without servers: placement asks the RESERVATION
stream's end once per batch of placements (``StreamTail``), its view waits until its fold has applied
the stream up to there (``ReadModel.reservations_current``), and ``place`` decides only after that: a
reservation answered ``created`` before the request arrived is in force for it."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import pytest
from nats.js.errors import NotFoundError

from services.placement.attempts import Ownership
from services.placement.handlers import PlacementHandlers
from services.placement.place import Placing
from services.placement.readmodel import ReadModel, StreamTail
from services.placement.reclaim import RESERVATION_SYNC_S
from shared.contracts.base import Rejected
from shared.contracts.envelope import new_event
from shared.contracts.placement import PlaceReply
from shared.contracts.reservation import ReservationEvent, state_of
from shared.contracts.subjects import Rpc, Subjects
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


# -- StreamTail: one lookup per batch, never one that started before the caller came ----------------


class Stream:
    """The stream's last sequence; each lookup waits until the test lets it answer."""

    def __init__(self) -> None:
        self.last = 10
        self.lookups = 0
        self.gates: list[asyncio.Event] = []

    async def ask(self) -> int:
        self.lookups += 1
        gate = asyncio.Event()
        self.gates.append(gate)
        seen = self.last  # what the server holds when the lookup reaches it
        await gate.wait()
        return seen


async def test_callers_that_arrive_during_a_lookup_wait_for_it_then_share_the_next_one() -> None:
    stream = Stream()
    tail = StreamTail(stream.ask)
    first = asyncio.ensure_future(tail.after_now())
    await settle()
    assert stream.lookups == 1
    stream.last = 11  # a reservation answered `created` after the first lookup read the stream
    late = [asyncio.ensure_future(tail.after_now()) for _ in range(20)]
    await settle()
    assert stream.lookups == 1  # the late ones wait for it to end: its answer may predate them
    stream.gates[0].set()
    assert await first == 10
    await settle()
    assert stream.lookups == 2  # then the twenty share one more
    stream.gates[1].set()
    assert await asyncio.gather(*late) == [11] * 20
    assert stream.lookups == 2


async def test_a_caller_after_a_finished_lookup_asks_again_and_a_failed_lookup_is_its_callers_error() -> None:
    stream = Stream()
    tail = StreamTail(stream.ask)
    first = asyncio.ensure_future(tail.after_now())
    await settle()
    stream.gates[0].set()
    assert await first == 10
    stream.last = 12
    second = asyncio.ensure_future(tail.after_now())
    await settle()
    assert stream.lookups == 2
    stream.gates[1].set()
    assert await second == 12

    async def broken() -> int:
        raise TimeoutError("no answer from $JS.API.STREAM.INFO")

    with pytest.raises(TimeoutError):
        await StreamTail(broken).after_now()


# -- ReadModel: waits for its fold to reach the stream's end ----------------------------------------


@dataclass
class _State:
    last_seq: int


@dataclass
class _Info:
    state: _State


class FakeJetStream:
    def __init__(self, last: int) -> None:
        self.last = last
        self.missing = False
        self.asked: list[str] = []

    async def stream_info(self, name: str) -> _Info:
        self.asked.append(name)
        if self.missing:
            raise NotFoundError()
        return _Info(_State(self.last))


@dataclass
class _Sequence:
    stream: int


@dataclass
class _Meta:
    sequence: _Sequence
    num_pending: int


@dataclass
class FakeMsg:
    data: bytes
    metadata: _Meta


def reservation_msg(sequence: int, reservation: Reservation, *, pending: int = 0) -> Any:
    payload = ReservationEvent(reservation=state_of(reservation), reservation_id=reservation.id)
    envelope = new_event(
        type="reservation.created",
        source="reservation-filler",
        payload=payload.model_dump(mode="json"),
        occurred_at=NOW,
    )
    return FakeMsg(envelope.model_dump_json().encode(), _Meta(_Sequence(sequence), pending))


def read_model(js: FakeJetStream) -> ReadModel:
    return ReadModel(
        rpc=None,  # type: ignore[arg-type]  # no sync here: only the reservation fold
        jetstream=lambda: js,  # type: ignore[arg-type, return-value]
        subjects=Subjects("t"),
        stream_prefix="T_",
        skus={},
        models={},
        clock=lambda: NOW,
        log=logging.getLogger("test.placement"),
        stale_after_ms=1000,
    )


async def test_the_view_is_current_once_its_fold_has_applied_the_stream_up_to_its_end() -> None:
    js = FakeJetStream(last=2)
    model = read_model(js)
    waiting = asyncio.ensure_future(model.reservations_current(timeout_s=5))
    await settle()
    assert js.asked == ["T_RESERVATION"]
    assert not waiting.done()
    await model._on_reservation(reservation_msg(1, HARD, pending=1))
    await settle()
    assert not waiting.done()  # one event of two
    second = Reservation(id="res-2", tenant="hooli", policy="soft", accelerators=("n2/gpu0",), created_at=NOW)
    await model._on_reservation(reservation_msg(2, second))
    assert await waiting is None
    assert model.book.get("res-1") is not None and model.book.get("res-2") is not None
    assert await model.reservations_current(timeout_s=5) is None  # nothing newer: at once


async def test_a_view_that_does_not_reach_the_end_in_time_says_so_and_a_missing_stream_means_none() -> None:
    js = FakeJetStream(last=3)
    model = read_model(js)
    await model._on_reservation(reservation_msg(1, HARD))
    behind = await model.reservations_current(timeout_s=0.05)
    assert behind == "applied RESERVATION events up to 1 of 3"
    js.missing = True  # no reservation filler ever created the stream: nothing is reserved
    assert await model.reservations_current(timeout_s=0.05) is None


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
