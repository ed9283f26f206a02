"""The kit's read side without servers (``shared.infra.follow``): a follower applies each trusted event once,
in stream order, through its folds; buffers until attached (a seed's feeds) while ``live`` events pass; drops
what it cannot trust and goes on; a replaced feed stops applying at once; ``caught_up`` is read-your-writes
(one stream-end lookup per batch of callers: ``StreamTail``). The same follower against a real NATS, with
its consumer deleted under it: ``tests/integration/test_read_side.py``."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
from nats.js.errors import NotFoundError

from shared.contracts.envelope import new_event
from shared.contracts.reservation import ReservationEvent
from shared.contracts.subjects import Context
from shared.domain.reservations import Reservation
from shared.infra.follow import EventMeta, Follow, Follower, Seed, Start, StreamTail, _Feed
from shared.infra.reservations import state_of

pytestmark = pytest.mark.asyncio

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
log = logging.getLogger("test.follow")


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


# -- fakes: what nats-py hands a subscription's callback, and the stream's end ---------------------------


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
    subject: str = "t.events.reservation.created"


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


def reserved(rid: str) -> Reservation:
    return Reservation(id=rid, tenant="initech", policy="hard", accelerators=("n1/gpu0",), created_at=NOW)


def msg(
    sequence: int, rid: str = "res-1", *, pending: int = 0, source: str = "reservation-filler", **extra: Any
) -> Any:
    payload = ReservationEvent(reservation=state_of(reserved(rid)), reservation_id=rid)
    envelope = new_event(
        type="reservation.created", source=source, payload=payload.model_dump(mode="json"), occurred_at=NOW
    )
    return FakeMsg(envelope.model_dump_json().encode(), _Meta(_Sequence(sequence), pending), **extra)


class Folded:
    """A fold that records what it applied (reservation ids, with their sequences)."""

    def __init__(self) -> None:
        self.applied: list[tuple[str, int]] = []
        self.fail_on: set[str] = set()

    def __call__(self, payload: ReservationEvent, meta: EventMeta) -> None:
        if payload.reservation_id in self.fail_on:
            raise ValueError("cannot take it")
        self.applied.append((payload.reservation_id, meta.sequence))


def follower(
    js: FakeJetStream | None = None, *, live: Any = None, seed: Seed | None = None
) -> tuple[Follower, Folded, _Feed]:
    folded = Folded()
    declared = Follow(
        Context.RESERVATION,
        on={"created": lambda _ctx: folded},
        start=Start.NEW if seed is not None else Start.FIRST,
        seed=seed,
        live=live,
    )
    kit = Follower(
        declared,
        stream="T_RESERVATION",
        subject="t.events.reservation.>",
        jetstream=lambda: js,  # type: ignore[arg-type, return-value]
        log=log,
    )
    kit.bind(None)
    return kit, folded, _Feed(buffer=[])


# -- order, once, trust --------------------------------------------------------------------------------


async def test_each_event_is_applied_once_in_stream_order_even_when_delivered_again() -> None:
    kit, folded, feed = follower()
    kit.attach(feed)
    for sequence, rid in ((1, "a"), (2, "b"), (2, "b"), (1, "a"), (3, "c")):  # a re-created consumer repeats 1-2
        kit._receive(feed, msg(sequence, rid))
    assert folded.applied == [("a", 1), ("b", 2), ("c", 3)]
    assert kit.progress.sequence == 3


async def test_an_event_it_cannot_trust_is_dropped_and_those_after_it_still_apply() -> None:
    kit, folded, feed = follower()
    kit.attach(feed)
    kit._receive(feed, FakeMsg(b"not json", _Meta(_Sequence(1), 0)))
    kit._receive(feed, msg(2, "forged", source="placement"))  # only the reservation filler publishes these
    kit._receive(feed, FakeMsg(b'{"event_id": 1}', _Meta(_Sequence(3), 0)))
    kit._receive(feed, msg(4, "ok"))
    assert folded.applied == [("ok", 4)]
    assert kit.dropped == 3
    assert kit.progress.sequence == 4  # dropped events count as read: nobody waits for them


async def test_a_fold_that_raises_skips_its_event_and_the_next_ones_apply() -> None:
    kit, folded, feed = follower()
    folded.fail_on = {"bad"}
    kit.attach(feed)
    kit._receive(feed, msg(1, "bad"))
    kit._receive(feed, msg(2, "good"))
    assert folded.applied == [("good", 2)]


# -- buffering until a seed is in, live events, replaced feeds --------------------------------------------


async def test_a_feed_buffers_until_attached_then_applies_its_buffer_in_order_and_the_rest_as_it_comes() -> None:
    seed = Seed("view", load=lambda _ctx: None)  # type: ignore[arg-type, return-value]
    kit, folded, feed = follower(seed=seed)
    kit._receive(feed, msg(5, "a"))
    kit._receive(feed, msg(6, "b"))
    assert folded.applied == []  # the seed is not in yet
    assert not kit.attached and kit.progress.sequence == 0
    kit.attach(feed)
    assert folded.applied == [("a", 5), ("b", 6)]
    kit._receive(feed, msg(7, "c"))
    assert folded.applied[-1] == ("c", 7)


async def test_live_events_pass_the_buffer() -> None:
    seed = Seed("view", load=lambda _ctx: None)  # type: ignore[arg-type, return-value]
    kit, folded, feed = follower(seed=seed, live=lambda _name, payload: payload.reservation_id == "now")
    kit._receive(feed, msg(1, "later"))
    kit._receive(feed, msg(2, "now"))
    assert folded.applied == [("now", 2)]
    kit.attach(feed)
    assert folded.applied == [("now", 2), ("later", 1)]


async def test_a_replaced_feed_stops_applying_at_once() -> None:
    kit, folded, old = follower()
    kit.attach(old)
    new = _Feed(buffer=[])
    kit._receive(new, msg(9, "new"))
    replaced = kit.attach(new)
    assert replaced is old and old.closed
    kit._receive(old, msg(10, "stale"))  # the old consumer still delivers until it is closed
    assert folded.applied == [("new", 9)]


async def test_a_seeded_follow_must_start_at_new_events() -> None:
    seed = Seed("view", load=lambda _ctx: None)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="NEW"):
        Follow(Context.LEDGER, on={}, start=Start.FIRST, seed=seed)


# -- health ---------------------------------------------------------------------------------------------------


async def test_health_says_which_follower_waits_and_which_is_behind() -> None:
    kit, _folded, feed = follower()
    kit.problem = "waiting for stream T_RESERVATION (NotFoundError)"
    assert kit.behind(NOW, stale_after_ms=1000) == "reservation waiting for stream T_RESERVATION (NotFoundError)"
    kit.attach(feed)
    kit._receive(feed, msg(1, "a", pending=40))  # 40 more wait, and the last applied is 3 s old
    later = NOW.replace(second=3)
    assert kit.behind(later, stale_after_ms=1000) == "reservation 40 events pending, last applied 3000 ms old"
    assert kit.behind(later, stale_after_ms=5000) is None
    kit._receive(feed, msg(2, "b", pending=0))
    assert kit.behind(later, stale_after_ms=1000) is None


# -- caught_up: read-your-writes ----------------------------------------------------------------------------


async def test_caught_up_waits_until_the_fold_has_applied_the_stream_up_to_its_end() -> None:
    js = FakeJetStream(last=2)
    kit, folded, feed = follower(js)
    kit.attach(feed)
    waiting = asyncio.ensure_future(kit.caught_up(timeout_s=5))
    await settle()
    assert js.asked == ["T_RESERVATION"]
    assert not waiting.done()
    kit._receive(feed, msg(1, "res-1", pending=1))
    await settle()
    assert not waiting.done()  # one event of two
    kit._receive(feed, msg(2, "res-2"))
    assert await waiting is None
    assert folded.applied == [("res-1", 1), ("res-2", 2)]
    assert await kit.caught_up(timeout_s=5) is None  # nothing newer: at once


async def test_not_reaching_the_end_in_time_says_so_and_a_missing_stream_means_nothing_to_wait_for() -> None:
    js = FakeJetStream(last=3)
    kit, _folded, feed = follower(js)
    kit.attach(feed)
    kit._receive(feed, msg(1))
    assert await kit.caught_up(timeout_s=0.05) == "applied RESERVATION events up to 1 of 3"
    js.missing = True  # no reservation filler ever created the stream: nothing is reserved
    assert await kit.caught_up(timeout_s=0.05) is None


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
