"""Placement's own view of the fleet: seeded from `fleet.get` and `ledger.snapshot` (paged RPC) and kept
current from the TOPOLOGY and LEDGER streams, with each node's PCIe utilisation from GPU telemetry (the
TELEMETRY stream, ``HETSCHED_PLACEMENT_PCIE_WINDOW_S``: see ``shared.domain.placement.view.PcieWindow``;
a node counts as busy only once placement has watched it for a whole window, from its start or resync
on). No other service's tables are read.

A sync cannot miss an event between the snapshots and the streams: ordered (ephemeral) JetStream
consumers that deliver only new events start first and buffer; then the snapshots are fetched; then
the buffered events are applied on top, and later ones as they come. An event the snapshots already
hold changes nothing (the fold in ``shared.domain.placement.view`` counts each allocation once per
accelerator). An ordered consumer that detects a gap restarts itself from the last sequence it saw.

How stale the view may be is reported in placement's health (check ``view``): ``ok`` while every
event older than ``HETSCHED_PLACEMENT_STALE_AFTER_MS`` is applied; otherwise how many events wait and
how old the newest applied one is. A stale view costs a retry, never an over-commit: the ledger checks
every commit against its own rows. ``HETSCHED_PLACEMENT_REFRESH_MS`` > 0 re-syncs the whole view that
often (off by default: the streams keep it current).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError
from pydantic import BaseModel, ValidationError

from shared.contracts.base import Rejected
from shared.contracts.envelope import EventEnvelope
from shared.contracts.fleet import FleetDescribeReply, FleetDescribeRequest
from shared.contracts.ledger import AllocationEvent, LedgerEvent
from shared.contracts.permissions import EVENT_PUBLISHERS, NODE_SCOPED_EVENTS
from shared.contracts.rebalance import (
    NodeThrottleEvent,
    PlanEvent,
    RebalanceEventName,
    ReplicaDrainingEvent,
)
from shared.contracts.registry import EVENTS
from shared.contracts.reservation import ReservationEvent, reservation_of
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Rpc, Subjects, names_scope
from shared.contracts.topology import EngineStatusEvent, NodeProfilePayload, TelemetryEvent, TopologyEvent
from shared.domain.hardware import Sku
from shared.domain.models import ModelSpec
from shared.domain.placement.types import FleetSnapshot
from shared.domain.placement.view import DEFAULT_PCIE_WINDOW_S, AssumeKey, Crossing, FleetView
from shared.domain.reservations import ReservationBook
from shared.infra.bus import follow
from shared.infra.clock import Clock
from shared.infra.fleet_view import apply_event, view_from
from shared.infra.rpc import RpcClient

STREAMS = (Context.TOPOLOGY, Context.LEDGER, Context.TELEMETRY)
# Events after which capacity may have freed: the queue is retried once the view holds them.
FREEING = frozenset(
    {
        LedgerEvent.ALLOCATION_RELEASED,
        LedgerEvent.ALLOCATION_EXPIRED,
        LedgerEvent.CAPACITY_CHANGED,
        TopologyEvent.NODE_PROFILED,
        TopologyEvent.NODE_CHANGED,
        TopologyEvent.NODE_RECOVERED,
    }
)
RETRY_S = 0.5
FOLLOW_RETRY_MAX_S = 5.0
DESCRIBE_AT_ONCE = 8


class SyncError(Exception):
    """A snapshot the view is seeded from could not be had."""


@dataclass
class Progress:
    """How far one stream has been applied: its last sequence, what the server still holds after it,
    and when the last applied event happened."""

    sequence: int = 0
    pending: int = 0
    occurred_at: datetime | None = None


class _Feed:
    """One stream's new events for one view: buffered until the view is seeded, then applied as they come."""

    def __init__(
        self,
        context: Context,
        *,
        log: logging.Logger,
        on_freed: Callable[[], None] = lambda: None,
        on_engine_status: Callable[[BaseModel], None] = lambda _: None,
        on_hold: Callable[[str, AllocationEvent], None] = lambda _name, _payload: None,
        on_allocation: Callable[[str, AllocationEvent], None] = lambda _name, _payload: None,
    ) -> None:
        self.context = context
        self.log = log
        self.on_freed = on_freed
        self.on_allocation = on_allocation
        self.on_engine_status = on_engine_status
        self.on_hold = on_hold
        self.progress = Progress()
        self.subscription: Subscription | None = None
        self._buffer: list[tuple[str, BaseModel, datetime]] | None = []
        self._publisher = EVENT_PUBLISHERS[context]
        self._scoped = frozenset(NODE_SCOPED_EVENTS.get(context, ()))
        self._view: FleetView | None = None
        self._closed = False

    async def on_message(self, msg: Msg) -> None:
        if self._closed:
            return
        meta = msg.metadata
        self.progress.sequence = meta.sequence.stream
        self.progress.pending = meta.num_pending
        try:
            envelope = EventEnvelope.model_validate_json(msg.data)
        except ValidationError as exc:
            self.log.warning("dropping a message that is not an event envelope", extra={"error": str(exc)[:300]})
            return
        self.progress.occurred_at = envelope.occurred_at
        name = envelope.type.rsplit(".", 1)[-1]
        model = EVENTS.get((self.context, name))
        if model is None:
            return
        try:
            payload = model.model_validate(envelope.payload)
        except ValidationError as exc:
            self.log.warning(
                "dropping an event whose payload does not match its contract",
                extra={"event_id": str(envelope.event_id), "type": envelope.type, "error": str(exc)[:300]},
            )
            return
        if name in self._scoped and not self._trusted(envelope, payload, msg.subject):
            return
        if name == TelemetryEvent.ENGINE_STATUS:  # admission's, not the fleet view's: applied as it comes
            self.on_engine_status(payload)
            return
        if isinstance(payload, AllocationEvent) and payload.kind == "request":
            # A request's KV hold moves no HBM in the view (it lives in its replica's pool): admission's.
            self.on_hold(name, payload)
            return
        if self._view is None:
            assert self._buffer is not None
            self._buffer.append((name, payload, envelope.occurred_at))
        else:
            self._apply(self._view, name, payload, envelope.occurred_at)
            if name in FREEING:
                self.on_freed()

    def _trusted(self, envelope: EventEnvelope, payload: BaseModel, subject: str) -> bool:
        """A node's own report (an agent's telemetry): from its publisher, on the subject of the node it
        names (as the durable consumers check, ``shared.infra.bus.consume``)."""
        node = getattr(payload, "node", None)
        if envelope.source == self._publisher and isinstance(node, str) and names_scope(subject, node):
            return True
        self.log.warning(
            "dropping a node-scoped event from the wrong source or subject",
            extra={"type": envelope.type, "source": envelope.source[:100], "subject": subject[:200]},
        )
        return False

    def _apply(self, view: FleetView, name: str, payload: BaseModel, at: datetime) -> None:
        try:
            apply_event(view, name, payload, at=at)
        except ValueError as exc:  # e.g. a profile whose link matrix does not match its GPUs
            self.log.warning("ignoring an event the view cannot apply", extra={"type": name, "error": str(exc)})
        if isinstance(payload, AllocationEvent):
            self.on_allocation(name, payload)

    def attach(self, view: FleetView) -> None:
        """Apply what was buffered, then every later event, to ``view`` (no await in between)."""
        freed = False
        for name, payload, at in self._buffer or ():
            self._apply(view, name, payload, at)
            freed |= name in FREEING
        self._buffer = None
        self._view = view
        if freed:
            self.on_freed()

    async def close(self) -> None:
        self._closed = True
        if self.subscription is not None:
            try:
                await self.subscription.unsubscribe()
            except Exception:  # the connection may be gone already; the server drops the consumer
                self.log.debug("could not unsubscribe an ordered consumer", exc_info=True)


def _retrieved(lookup: asyncio.Future[int]) -> None:
    """A lookup whose callers all gave up: its error is theirs, not the loop's to log."""
    if not lookup.cancelled():
        lookup.exception()


class StreamTail:
    """A stream's last sequence as of a lookup that started after the caller asked (``after_now``), with
    concurrent callers sharing one lookup: one ``$JS.API.STREAM.INFO`` round trip per batch of
    placements, not one per placement. A lookup already in flight when a caller arrives may predate what
    that caller must see, so the caller waits for it to end and joins the next one."""

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


class ReadModel:
    """The view decisions read, and the sync that keeps it (see the module docstring)."""

    def __init__(
        self,
        *,
        rpc: RpcClient,
        jetstream: Callable[[], JetStreamContext],
        subjects: Subjects,
        stream_prefix: str,
        skus: Mapping[str, Sku],
        models: Mapping[str, ModelSpec],
        clock: Clock,
        log: logging.Logger,
        stale_after_ms: int,
        resync_ms: int = 0,
        pcie_window_s: float = DEFAULT_PCIE_WINDOW_S,
    ) -> None:
        self._rpc = rpc
        self._jetstream = jetstream
        self._subjects = subjects
        self._stream_prefix = stream_prefix
        self._skus = dict(skus)
        self._models = dict(models)
        self._clock = clock
        self._log = log
        self._stale_after_ms = stale_after_ms
        self._resync_ms = resync_ms
        self._pcie_window_s = pcie_window_s
        self.view = FleetView(skus=self._skus, models=self._models, pcie_window_s=pcie_window_s)
        # Called once the view holds an event that may free capacity (the queue's wake-up).
        self.on_freed: Callable[[], None] = lambda: None
        # Called with each engine's status report (TELEMETRY `engine_status`): admission's rotation.
        self.on_engine_status: Callable[[EngineStatusEvent], None] = lambda _: None
        # Called with each LEDGER event of a `request` allocation (an admission's KV hold committed or ended).
        self.on_hold: Callable[[str, AllocationEvent], None] = lambda _name, _payload: None
        # Called with each other LEDGER allocation event once the view holds it (the quotas' tally).
        self.on_allocation: Callable[[str, AllocationEvent], None] = lambda _name, _payload: None
        self.synced_at: datetime | None = None
        self._feeds: dict[Context, _Feed] = {}
        # Reservations: the RESERVATION stream folded from its first sequence (each event carries its
        # reservation's whole state), independent of the fleet syncs.
        self.book = ReservationBook()
        self.on_reservation: Callable[[], None] = lambda: None
        self._followers: dict[Context, Subscription] = {}
        self._reservations_progress = Progress()
        # Read-your-writes for reservations (docs/RESERVATIONS.md): the RESERVATION stream's end, and a
        # signal each time the fold applies an event.
        self._reservation_tail = StreamTail(self._reservation_last_sequence)
        self._reservation_applied = asyncio.Event()
        # The rebalancer's: nodes whose PCIe it throttles, replicas it is moving (REBALANCE stream).
        self.throttled: set[str] = set()
        self.draining: set[str] = set()
        self._rebalance_progress = Progress()
        self._lock = asyncio.Lock()
        self._problem = "not loaded yet"

    # -- what decisions use ----------------------------------------------------------------------

    @property
    def snapshot(self) -> FleetSnapshot:
        return self.view.snapshot

    def assume(
        self, key: AssumeKey, held: Mapping[str, int], *, shared: bool = False, crossing: Crossing | None = None
    ) -> int:
        return self.view.assume(key, held, shared=shared, crossing=crossing)

    def confirm(self, token: int, allocation_id: str) -> None:
        self.view.confirm(token, allocation_id)

    def forget(self, token: int) -> None:
        self.view.forget(token)

    def holds(self, allocation_id: str) -> bool:
        """The view still counts this allocation's bytes."""
        return self.view.ledger.holds(allocation_id)

    # -- reservations ----------------------------------------------------------------------------

    async def follow_reservations(self) -> None:
        """Fold the RESERVATION and REBALANCE streams from their first sequence, and every event after (an
        ordered consumer restarts itself on a gap). Retried until each stream exists (its owner creates it)."""
        await asyncio.gather(
            self._follow(Context.RESERVATION, self._on_reservation),
            self._follow(Context.REBALANCE, self._on_rebalance),
        )

    async def _follow(self, context: Context, cb: Callable[[Msg], Awaitable[None]]) -> None:
        wait_s = RETRY_S
        while context not in self._followers:
            try:
                self._followers[context] = await follow(
                    self._jetstream(),
                    self._subjects.events_of(context),
                    stream=stream_name(context, stream_prefix=self._stream_prefix),
                    cb=cb,
                    deliver_policy=DeliverPolicy.ALL,
                    log=self._log,
                )
            except Exception as exc:  # its owner has not created it yet (or NATS is electing a leader)
                self._log.debug("no %s stream yet; retrying", context.value, extra={"error": str(exc)[:200]})
                await asyncio.sleep(wait_s)
                wait_s = min(FOLLOW_RETRY_MAX_S, wait_s * 2)  # a service not deployed costs few API calls

    def _envelope(self, msg: Msg, context: Context, progress: Progress) -> EventEnvelope | None:
        meta = msg.metadata
        progress.sequence = meta.sequence.stream
        progress.pending = meta.num_pending
        try:
            envelope = EventEnvelope.model_validate_json(msg.data)
        except ValidationError as exc:
            self._log.warning("dropping a malformed event", extra={"error": str(exc)[:300]})
            return None
        progress.occurred_at = envelope.occurred_at
        if envelope.source != EVENT_PUBLISHERS[context]:
            self._log.warning("dropping a %s event from %s", context.value, envelope.source[:100])
            return None
        return envelope

    async def _on_reservation(self, msg: Msg) -> None:
        try:
            self._fold_reservation(msg)
        finally:
            self._applied_reservation()

    def _fold_reservation(self, msg: Msg) -> None:
        envelope = self._envelope(msg, Context.RESERVATION, self._reservations_progress)
        if envelope is None:
            return
        try:
            payload = ReservationEvent.model_validate(envelope.payload)
        except ValidationError as exc:
            self._log.warning("dropping a malformed reservation event", extra={"error": str(exc)[:300]})
            return
        if self.book.apply(reservation_of(payload.reservation)):
            self.on_reservation()

    def _applied_reservation(self) -> None:
        """Wake those waiting for the fold to reach a sequence (a dropped event counts as applied)."""
        applied, self._reservation_applied = self._reservation_applied, asyncio.Event()
        applied.set()

    async def _reservation_last_sequence(self) -> int:
        try:
            info = await self._jetstream().stream_info(
                stream_name(Context.RESERVATION, stream_prefix=self._stream_prefix)
            )
        except NotFoundError:  # no reservation filler has created it: nothing is reserved
            return 0
        return int(info.state.last_seq)

    async def reservations_current(self, *, timeout_s: float) -> str | None:
        """Read-your-writes: wait (at most ``timeout_s``) until the reservation fold has applied every
        event the RESERVATION stream held when this was called. The filler answers ``created`` only once
        its event is in the stream, so a reservation answered before a placement arrived is in the book
        the placement decides on. None once it is; otherwise why not (the caller refuses, retryable)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        try:
            last = await asyncio.wait_for(self._reservation_tail.after_now(), timeout=timeout_s)
        except Exception as exc:  # JetStream's API unreachable: see docs/RESERVATIONS.md
            return f"the RESERVATION stream's end could not be read ({type(exc).__name__})"
        progress = self._reservations_progress
        while progress.sequence < last:
            left = until - loop.time()
            if left <= 0:
                return f"applied RESERVATION events up to {progress.sequence} of {last}"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reservation_applied.wait(), timeout=left)
        return None

    async def _on_rebalance(self, msg: Msg) -> None:
        """The rebalancer's word to placement: nodes throttled (no new replica: a cold start would load its
        weights over a saturated PCIe link) and replicas draining (admission sends them nothing new)."""
        envelope = self._envelope(msg, Context.REBALANCE, self._rebalance_progress)
        if envelope is None:
            return
        name = envelope.type.rsplit(".", 1)[-1]
        try:
            match name:
                case RebalanceEventName.THROTTLE_STARTED:
                    self.throttled.add(NodeThrottleEvent.model_validate(envelope.payload).node)
                case RebalanceEventName.THROTTLE_ENDED:
                    self.throttled.discard(NodeThrottleEvent.model_validate(envelope.payload).node)
                    self.on_reservation()  # capacity came back: the queue may place now
                case RebalanceEventName.REPLICA_DRAINING:
                    self.draining.add(ReplicaDrainingEvent.model_validate(envelope.payload).allocation_id)
                case RebalanceEventName.PLAN_FINISHED:
                    plan = PlanEvent.model_validate(envelope.payload).plan
                    self.draining.difference_update(step.allocation_id for step in plan.steps)
        except ValidationError as exc:
            self._log.warning("dropping a malformed rebalance event", extra={"error": str(exc)[:300]})

    # -- sync ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """One sync attempt, so the first requests find a view; ``run`` retries when it failed."""
        try:
            await self.sync()
        except Exception as exc:  # the other services may not be up yet: `run` retries
            self._problem = str(exc) or type(exc).__name__
            self._log.warning("placement's first fleet sync failed; retrying", extra={"error": self._problem})

    async def run(self) -> None:
        """Retry a failed sync; with a resync period, re-sync that often; otherwise nothing to do."""
        while True:
            if self.synced_at is None:
                await asyncio.sleep(RETRY_S)
            elif self._resync_ms:
                await asyncio.sleep(self._resync_ms / 1000)
            else:
                return  # the streams keep the view current
            try:
                await self.sync()
            except Exception as exc:  # keep the last view and try again
                self._problem = str(exc) or type(exc).__name__
                self._log.warning("placement could not sync its fleet view", extra={"error": self._problem})

    async def sync(self) -> None:
        """Start new feeds, fetch the snapshots, seed a new view, apply what arrived meanwhile, swap."""
        async with self._lock:
            feeds = {
                context: _Feed(
                    context,
                    log=self._log,
                    on_freed=self._freed,
                    on_engine_status=self._engine_status,
                    on_allocation=self._allocation,
                )
                for context in STREAMS
            }
            try:
                for feed in feeds.values():
                    feed.subscription = await follow(
                        self._jetstream(),
                        self._subjects.events_of(feed.context),
                        stream=stream_name(feed.context, stream_prefix=self._stream_prefix),
                        cb=feed.on_message,
                        deliver_policy=DeliverPolicy.NEW,
                        log=self._log,
                    )
                view = await self._seed()
            except BaseException:
                for feed in feeds.values():
                    await feed.close()
                raise
            view.adopt(self.view)  # decisions whose commits are in flight stay counted
            for feed in feeds.values():
                feed.attach(view)
            old, self._feeds, self.view = self._feeds, feeds, view
            # The view is long-lived and large (a fleet of 1,024 nodes is about a million objects): kept out
            # of the cyclic collector's full passes, each of which would otherwise stall the loop ~100 ms.
            gc.collect()
            gc.freeze()
            self.synced_at = self._clock()
            self._problem = ""
            for feed in old.values():
                await feed.close()
        self._log.info(
            "placement synced its fleet view",
            extra={"nodes": len(view.profiles), "accelerators": len(view.ledger.usable), "pods": len(view.pods)},
        )

    async def _seed(self) -> FleetView:
        fleet = await self._rpc.fleet(profiles=True)
        if isinstance(fleet, Rejected):
            raise SyncError(f"fleet.get refused: {fleet.error.message}")
        ledger = await self._rpc.ledger_snapshot()
        if isinstance(ledger, Rejected):
            raise SyncError(f"ledger.snapshot refused: {ledger.error.message}")
        profiles = {n.name: n.profile for n in fleet.nodes if n.profile is not None}
        profiles.update(await self._describe([n.name for n in fleet.nodes if n.profile is None]))
        return view_from(
            fleet=fleet,
            profiles=profiles,
            ledger=ledger,
            skus=self._skus,
            models=self._models,
            pcie_window_s=self._pcie_window_s,
        )

    def _freed(self) -> None:
        self.on_freed()

    def _hold(self, name: str, payload: AllocationEvent) -> None:
        self.on_hold(name, payload)

    def _allocation(self, name: str, payload: AllocationEvent) -> None:
        self.on_allocation(name, payload)

    def _engine_status(self, payload: BaseModel) -> None:
        if isinstance(payload, EngineStatusEvent):
            self.on_engine_status(payload)

    async def _describe(self, names: list[str]) -> dict[str, NodeProfilePayload]:
        """Profiles ``fleet.get`` did not send (a topology service that ignores ``profiles``), one by one."""
        gate = asyncio.Semaphore(DESCRIBE_AT_ONCE)

        async def one(name: str) -> tuple[str, NodeProfilePayload | None]:
            async with gate:
                reply = await self._rpc.ask(Rpc.FLEET_DESCRIBE, FleetDescribeRequest(node=name), FleetDescribeReply)
            if isinstance(reply, Rejected):
                return name, None  # gone since fleet.get: its events follow
            try:
                return name, NodeProfilePayload.model_validate(reply.profile)
            except ValidationError:
                return name, None

        found = await asyncio.gather(*(one(name) for name in names))
        return {name: profile for name, profile in found if profile is not None}

    async def stop(self) -> None:
        for feed in self._feeds.values():
            await feed.close()
        self._feeds = {}
        for follower in self._followers.values():
            with contextlib.suppress(Exception):  # the connection may be gone already
                await follower.unsubscribe()
        self._followers = {}

    # -- how stale -------------------------------------------------------------------------------

    def health(self) -> dict[str, str]:
        """``view``: ``ok``, or why the view may be older than ``stale_after_ms``."""
        if self.synced_at is None:
            return {"view": f"starting: {self._problem}"}
        now = self._clock()
        behind = []
        for context, feed in self._feeds.items():
            progress = feed.progress
            if progress.pending and progress.occurred_at is not None:
                lag_ms = (now - progress.occurred_at).total_seconds() * 1000
                if lag_ms > self._stale_after_ms:
                    behind.append(
                        f"{context.value} {progress.pending} events pending, last applied {lag_ms:.0f} ms old"
                    )
        for name, progress in (("reservation", self._reservations_progress), ("rebalance", self._rebalance_progress)):
            if progress.pending and progress.occurred_at is not None:
                lag_ms = (now - progress.occurred_at).total_seconds() * 1000
                if lag_ms > self._stale_after_ms:
                    behind.append(f"{name} {progress.pending} events pending, last applied {lag_ms:.0f} ms old")
        return {"view": "behind: " + "; ".join(behind) if behind else "ok"}
