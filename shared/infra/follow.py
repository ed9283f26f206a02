"""The kit's read side: another context's events followed into memory, the way informers feed the
Kubernetes scheduler's cache (list, then watch) and eventsourcing's followers fold what they pull.

A service declares what it follows (``Follow`` in its ``ServiceDefinition``); the kit owns one
``Follower`` per declaration and the service keeps only pure folds and their result:

- the stream is read with an ordered consumer (``bus.follow``): nats-py re-creates it from the next
  sequence after a gap, or when it disappeared (two idle heartbeats missed), under a new name;
- every event passes the one trust check (``trust.EventReader``: envelope, context, publisher,
  contract, node scope); one that fails is dropped with a warning line (a follower folds nothing
  durable, so there is nothing to dead-letter);
- events are applied in stream order, each sequence once (a consumer re-created over what was applied
  changes nothing), through the service's folds: ``on`` maps an event name to a fold ``(payload, meta)``;
- ``Start.FIRST`` folds the stream from its first sequence (a context whose events each carry the whole
  state of what they name, e.g. reservations); ``Start.NEW`` what comes after the follower starts;
- with a ``Seed`` (the owners' snapshots), the feeds start first and buffer; then the seed loads; then it
  is installed and the buffers applied on top, with no await in between, so nothing between the
  snapshot and the stream is lost (a fold counts an event the snapshot already holds once). A seed with
  ``every_s`` loads again that often, on new feeds swapped in the same way;
- health says which follower waits (no stream, no seed yet) or is behind (events pending while the last
  applied is older than ``stale_after_ms``): check ``follows``, and a seed's own check under its name;
- ``caught_up`` is read-your-writes: wait until the fold holds what the stream held when it was asked;
- the service's NATS read permissions are the contexts its ``Follow``s name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

from shared.contracts.subjects import Context
from shared.infra.bus import ORDERED_HEARTBEAT_S, follow
from shared.infra.clock import Clock
from shared.infra.deadletter import UnappliableEvent
from shared.infra.trust import EventReader

RETRY_S = 0.5
RETRY_MAX_S = 5.0  # a context whose owner is not deployed costs few API calls


class Start(StrEnum):
    """Where a follower starts reading its stream."""

    FIRST = "first"  # every event the stream holds: the fold is its own seed
    NEW = "new"  # events after the follower started (with a seed: after the seed, buffered until then)


@dataclass(frozen=True)
class EventMeta:
    """Where an event sits in its stream and when it happened."""

    sequence: int
    occurred_at: datetime
    subject: str


Fold = Callable[[Any, EventMeta], None]
"""Applies one event (its contract payload) to memory: synchronous, no IO."""
Install = Callable[[], None]
"""Makes a loaded seed the one the folds apply to (synchronous: nothing happens between it and the buffers)."""


@dataclass(frozen=True)
class Seed:
    """The snapshot the follows that name it start from: ``load(ctx)()`` fetches it (over RPC) and returns
    what installs it. Its health check is named ``name``; ``every_s(ctx)`` > 0 loads it again that often."""

    name: str
    load: Callable[[Any], Callable[[], Awaitable[Install]]]
    every_s: Callable[[Any], float] = lambda _ctx: 0.0


@dataclass(frozen=True)
class Follow:
    """One context followed into memory: ``on`` maps event names to fold factories (given the service's
    Ctx). ``live`` names events applied as they come even before the seed is in (what does not depend on
    it; such a fold must be idempotent: while a seed loads again, the old feed and the new one both see it)."""

    context: Context
    on: Mapping[str, Callable[[Any], Fold]]
    start: Start = Start.FIRST
    seed: Seed | None = None
    live: Callable[[str, Any], bool] | None = None

    def __post_init__(self) -> None:
        if self.seed is not None and self.start is not Start.NEW:
            raise ValueError(f"{self.context.value}: a seeded follow starts at NEW events (the seed holds the rest)")


@dataclass
class Progress:
    """How far a feed has read its stream: its last sequence, what the server held after it then, and when
    the last event read happened."""

    sequence: int = 0
    pending: int = 0
    occurred_at: datetime | None = None


@dataclass
class _Feed:
    """One ordered consumer's events for a follower: buffered (``buffer`` not None) until attached."""

    buffer: list[tuple[Fold, Any, EventMeta]] | None
    progress: Progress = field(default_factory=Progress)
    subscription: Any = None
    closed: bool = False

    async def close(self, log: logging.Logger) -> None:
        self.closed = True
        if self.subscription is not None:
            try:
                await self.subscription.unsubscribe()
            except Exception:  # the connection may be gone already; the server drops the consumer
                log.debug("could not unsubscribe an ordered consumer", exc_info=True)


def _retrieved(lookup: asyncio.Future[int]) -> None:
    """A lookup whose callers all gave up: its error is theirs, not the loop's to log."""
    if not lookup.cancelled():
        lookup.exception()


class StreamTail:
    """A stream's last sequence as of a lookup that started after the caller asked (``after_now``), with
    concurrent callers sharing one lookup: one ``$JS.API.STREAM.INFO`` round trip per batch of callers.
    A lookup already in flight when a caller arrives may predate what that caller must see, so the caller
    waits for it to end and joins the next one."""

    def __init__(self, ask: Callable[[], Awaitable[int]]) -> None:
        self._ask = ask
        self._started = 0  # lookups started so far; each is numbered
        self._number = 0
        self._lookup: asyncio.Future[int] | None = None

    async def after_now(self) -> int:
        arrived = self._started
        while True:
            lookup = self._lookup
            if lookup is not None and self._number > arrived:  # started after this caller came: its answer will do
                return await asyncio.shield(lookup)
            if lookup is not None and not lookup.done():
                await asyncio.wait([lookup])  # an older lookup: wait for it, then join (or start) the next
                continue
            self._started += 1
            self._number = self._started
            self._lookup = asyncio.ensure_future(self._ask())
            self._lookup.add_done_callback(_retrieved)


class Follower:
    """The kit's side of one ``Follow``: its feeds, the trust check, the order, the buffer, the progress."""

    def __init__(
        self,
        declared: Follow,
        *,
        stream: str,
        subject: str,
        jetstream: Callable[[], JetStreamContext],
        log: logging.Logger,
        idle_heartbeat_s: float = ORDERED_HEARTBEAT_S,
    ) -> None:
        self.declared = declared
        self.context = declared.context
        self.stream = stream
        self.subject = subject
        self._jetstream = jetstream
        self._log = log
        self._heartbeat_s = idle_heartbeat_s
        self._reader = EventReader(declared.context)
        self._folds: dict[str, Fold] = {}
        self._feed: _Feed | None = None  # the attached feed: its events reach the folds as they come
        self._opening: _Feed | None = None
        self._applied = asyncio.Event()
        self._tail = StreamTail(self._last_sequence)
        self.problem = ""  # why it cannot follow (its stream not existing yet is no problem: nothing to miss)
        self.dropped = 0

    def bind(self, ctx: Any) -> None:
        """Build the folds from the service's Ctx (once, after its ``wire``)."""
        self._folds = {name: factory(ctx) for name, factory in self.declared.on.items()}

    @property
    def attached(self) -> bool:
        return self._feed is not None

    @property
    def progress(self) -> Progress:
        return self._feed.progress if self._feed is not None else Progress()

    # -- feeds ------------------------------------------------------------------------------------

    async def open(self) -> _Feed:
        """A new feed from the stream's next events (or its first, ``Start.FIRST``), buffering until
        ``attach``. Raises when the stream cannot be read (it does not exist yet)."""
        feed = _Feed(buffer=[])

        async def on_message(msg: Msg) -> None:
            self._receive(feed, msg)

        feed.subscription = await follow(
            self._jetstream(),
            self.subject,
            stream=self.stream,
            cb=on_message,
            deliver_policy=DeliverPolicy.ALL if self.declared.start is Start.FIRST else DeliverPolicy.NEW,
            log=self._log,
            idle_heartbeat_s=self._heartbeat_s,
        )
        return feed

    def attach(self, feed: _Feed) -> _Feed | None:
        """Apply what ``feed`` buffered, in order, and every later event as it comes; the feed it replaces
        stops applying at once (returned, for the caller to close). No await: nothing comes in between."""
        for fold, payload, meta in feed.buffer or ():
            self._apply(fold, payload, meta)
        feed.buffer = None
        old, self._feed = self._feed, feed
        if old is not None:
            old.closed = True
        self.problem = ""
        self._signal()
        return old

    async def run(self) -> None:
        """An unseeded follower's loop: open a feed (retried, backing off, until the stream exists) and
        attach it; then nothing (nats-py keeps the ordered consumer)."""
        wait_s = RETRY_S
        while self._feed is None:
            try:
                feed = await self.open()
            except NotFoundError:  # its owner has not created the stream: nothing to follow yet, nothing missed
                self.problem = ""
                self._log.debug("no stream to follow yet; retrying", extra={"stream": self.stream})
                await asyncio.sleep(wait_s)
                wait_s = min(RETRY_MAX_S, wait_s * 2)
                continue
            except Exception as exc:  # NATS away or electing a leader
                self.problem = f"waiting for stream {self.stream} ({type(exc).__name__})"
                self._log.debug("no stream to follow yet; retrying", extra={"stream": self.stream})
                await asyncio.sleep(wait_s)
                wait_s = min(RETRY_MAX_S, wait_s * 2)
                continue
            self.attach(feed)

    async def close(self) -> None:
        for feed in (self._feed, self._opening):
            if feed is not None:
                await feed.close(self._log)
        self._feed = self._opening = None

    # -- events -----------------------------------------------------------------------------------

    def _receive(self, feed: _Feed, msg: Msg) -> None:
        if feed.closed:
            return
        meta = msg.metadata
        sequence = meta.sequence.stream
        if sequence <= feed.progress.sequence:  # a re-created consumer delivers again: applied
            return
        feed.progress.sequence = sequence
        feed.progress.pending = meta.num_pending
        try:
            event, name = self._reader.envelope(msg.data)
            feed.progress.occurred_at = event.occurred_at
            fold = self._folds.get(name)
            if fold is None:
                return
            payload = self._reader.payload(event, name, msg.subject)
        except UnappliableEvent as exc:
            self.dropped += 1
            self._log.warning(
                "dropping an event a follower cannot trust",
                extra={"stream": self.stream, "sequence": sequence, "error": str(exc)[:300]},
            )
            return
        finally:
            if feed.buffer is None:
                self._signal()
        where = EventMeta(sequence=sequence, occurred_at=event.occurred_at, subject=msg.subject)
        live = self.declared.live
        if feed.buffer is not None and not (live is not None and live(name, payload)):
            feed.buffer.append((fold, payload, where))
            return
        self._apply(fold, payload, where)

    def _apply(self, fold: Fold, payload: Any, meta: EventMeta) -> None:
        try:
            fold(payload, meta)
        except Exception as exc:  # a fold that cannot take an event must not stop the ones after it
            self._log.warning(
                "a fold could not apply an event; skipped",
                extra={"stream": self.stream, "sequence": meta.sequence, "error": f"{type(exc).__name__}: {exc}"[:300]},
            )

    def _signal(self) -> None:
        """Wake those waiting for the fold to reach a sequence (a dropped event counts as applied)."""
        applied, self._applied = self._applied, asyncio.Event()
        applied.set()

    # -- read-your-writes and health --------------------------------------------------------------

    async def _last_sequence(self) -> int:
        try:
            info = await self._jetstream().stream_info(self.stream)
        except NotFoundError:  # no owner has created it: nothing to wait for
            return 0
        return int(info.state.last_seq)

    async def caught_up(self, *, timeout_s: float) -> str | None:
        """Wait (at most ``timeout_s``) until the folds have applied every event the stream held when this
        was called: None once they have, else why not (the caller refuses, retryable)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        try:
            last = await asyncio.wait_for(self._tail.after_now(), timeout=timeout_s)
        except Exception as exc:  # JetStream's API unreachable
            return f"the {self.stream} stream's end could not be read ({type(exc).__name__})"
        while self.progress.sequence < last:
            left = until - loop.time()
            if left <= 0:
                return f"applied {self.context.name} events up to {self.progress.sequence} of {last}"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._applied.wait(), timeout=left)
        return None

    def behind(self, now: datetime, *, stale_after_ms: float) -> str | None:
        """Why this follower may be older than ``stale_after_ms``, or None."""
        if self._feed is None:
            return f"{self.context.value} {self.problem}" if self.problem else None
        progress = self._feed.progress
        if progress.pending and progress.occurred_at is not None:
            lag_ms = (now - progress.occurred_at).total_seconds() * 1000
            if lag_ms > stale_after_ms:
                return f"{self.context.value} {progress.pending} events pending, last applied {lag_ms:.0f} ms old"
        return None


def behind_check(followers: Iterable[Follower], now: datetime, *, stale_after_ms: float) -> str:
    """``ok``, or which followers wait or are behind."""
    problems = [why for f in followers if (why := f.behind(now, stale_after_ms=stale_after_ms)) is not None]
    return "behind: " + "; ".join(problems) if problems else "ok"


class Seeding:
    """One ``Seed`` and the followers it seeds: feeds first, then the snapshot, then both together."""

    def __init__(
        self, seed: Seed, followers: list[Follower], *, clock: Clock, log: logging.Logger, stale_after_ms: float
    ) -> None:
        self.seed = seed
        self.followers = followers
        self._clock = clock
        self._log = log
        self._stale_after_ms = stale_after_ms
        self._load: Callable[[], Awaitable[Install]] | None = None
        self._every_s = 0.0
        self._lock = asyncio.Lock()
        self.synced_at: datetime | None = None
        self.problem = "not loaded yet"

    def bind(self, ctx: Any) -> None:
        self._load = self.seed.load(ctx)
        self._every_s = self.seed.every_s(ctx)

    async def sync(self) -> None:
        """Open new feeds, load the seed, install it and attach the feeds (their buffers applied on top)."""
        assert self._load is not None, "bind() first"
        async with self._lock:
            opened: list[tuple[Follower, _Feed]] = []
            try:
                for follower in self.followers:
                    opened.append((follower, await follower.open()))
                install = await self._load()
            except BaseException:
                for _, feed in opened:
                    await feed.close(self._log)
                raise
            install()
            replaced = [follower.attach(feed) for follower, feed in opened]
            self.synced_at = self._clock()
            self.problem = ""
            for old in replaced:
                if old is not None:
                    await old.close(self._log)

    async def first(self) -> None:
        """One attempt, so the first requests find a seeded view; ``run`` retries when it failed."""
        try:
            await self.sync()
        except Exception as exc:  # the owners may not be up yet: `run` retries
            self.problem = str(exc) or type(exc).__name__
            self._log.warning(
                "a seed could not be loaded; retrying", extra={"seed": self.seed.name, "error": self.problem}
            )

    async def run(self) -> None:
        """Retry a failed seed; with ``every_s``, load it again that often; otherwise nothing to do."""
        while True:
            if self.synced_at is None:
                await asyncio.sleep(RETRY_S)
            elif self._every_s > 0:
                await asyncio.sleep(self._every_s)
            else:
                return  # the streams keep it current
            try:
                await self.sync()
            except Exception as exc:  # keep the last one and try again
                self.problem = str(exc) or type(exc).__name__
                self._log.warning("a seed could not be loaded", extra={"seed": self.seed.name, "error": self.problem})

    def check(self) -> str:
        if self.synced_at is None:
            return f"starting: {self.problem}"
        return behind_check(self.followers, self._clock(), stale_after_ms=self._stale_after_ms)


@dataclass
class ReadSide:
    """A service's followers and seeds, built from its declarations before its ``wire`` (which may hand a
    follower to what waits on it: ``caught_up``), bound to its Ctx after."""

    followers: dict[Context, Follower]
    seedings: list[Seeding]
    clock: Clock
    stale_after_ms: float

    @classmethod
    def of(
        cls,
        follows: Iterable[Follow],
        *,
        stream_of: Callable[[Context], str],
        subject_of: Callable[[Context], str],
        jetstream: Callable[[], JetStreamContext],
        clock: Clock,
        log: logging.Logger,
        stale_after_ms: float,
        idle_heartbeat_s: float = ORDERED_HEARTBEAT_S,
    ) -> ReadSide:
        followers: dict[Context, Follower] = {}
        seeds: dict[str, tuple[Seed, list[Follower]]] = {}
        for declared in follows:
            if declared.context in followers:
                raise ValueError(f"{declared.context.value} is followed twice; one Follow per context")
            follower = Follower(
                declared,
                stream=stream_of(declared.context),
                subject=subject_of(declared.context),
                jetstream=jetstream,
                log=log,
                idle_heartbeat_s=idle_heartbeat_s,
            )
            followers[declared.context] = follower
            if declared.seed is not None:
                seeds.setdefault(declared.seed.name, (declared.seed, []))[1].append(follower)
        seedings = [
            Seeding(seed, members, clock=clock, log=log, stale_after_ms=stale_after_ms)
            for seed, members in seeds.values()
        ]
        return cls(followers=followers, seedings=seedings, clock=clock, stale_after_ms=stale_after_ms)

    def bind(self, ctx: Any) -> None:
        for follower in self.followers.values():
            follower.bind(ctx)
        for seeding in self.seedings:
            seeding.bind(ctx)

    @property
    def unseeded(self) -> list[Follower]:
        return [f for f in self.followers.values() if f.declared.seed is None]

    def checks(self) -> dict[str, str]:
        """Health: each seed under its name, the other followers under ``follows``."""
        checks = {seeding.seed.name: seeding.check() for seeding in self.seedings}
        if self.unseeded:
            checks["follows"] = behind_check(self.unseeded, self.clock(), stale_after_ms=self.stale_after_ms)
        return checks

    async def close(self) -> None:
        for follower in self.followers.values():
            await follower.close()
