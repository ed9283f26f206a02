"""The durable side of following another context: one JetStream pull consumer per ``Consumer``, driven by our
own loop (``EventLoop``), each event applied once (inbox) in its transaction, redelivered with backoff, then
dead-lettered; a durable deleted under it is re-created. The in-memory side is ``shared.infra.follow``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError
from sqlalchemy.ext.asyncio import AsyncSession

from shared.contracts.permissions import NODE_SCOPED_EVENTS
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Subjects
from shared.infra.bus import BatchFailed, consume
from shared.infra.deadletter import UnappliableEvent, dead_letter, redelivery_delay_s
from shared.infra.definition import Consumer, durable_name
from shared.infra.runtime import Runtime
from shared.infra.uow import committed_on

# Event consumers are durable JetStream pull consumers driven by our own loop: a fetched batch is
# applied one event after the other, in stream order, each acked after its transaction committed; the
# event whose handler raised is nak'ed with the rest of its batch (redelivered in order). FastStream's
# pull subscriber would handle a batch concurrently (out of order), or, in batch mode, wait up to its
# timeout to fill the batch; its default ack policy for NATS drops a message whose handler raised.
EVENT_BATCH = 64
EVENT_FETCH_TIMEOUT_S = 1.0
DEAD_LETTERED_MESSAGE = "event dead-lettered: the consumer gave up on it"
# How often an idle consumer asks the server whether its durable still exists: a fetch on a deleted consumer
# only times out, as an idle one does.
CONSUMER_CHECK_S = 5.0
CONSUMER_GONE_MESSAGE = "event consumer disappeared; re-creating it to replay its stream from the first sequence"
CONSUMER_CAUGHT_UP_MESSAGE = "re-created event consumer caught up"
# Server-side deliveries, as a multiple of the limit, after which a failing event is dead-lettered even
# if this process saw fewer failures (it restarted, or the event was nak'ed behind others).
RESTART_SLACK = 4


def _stop_if_cancelled() -> None:
    """Re-raise a cancellation a library swallowed (its task is being cancelled: a stopping service), so a
    loop that retries on timeouts does not keep the process alive after shutdown."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


@dataclass
class EventLoop:
    """One durable consumer: what it reads, how each event is applied, and when it gives up on one.

    An event whose handler raises is nak'ed with the rest of its batch after a delay that doubles
    with each failure (``HETSCHED_EVENT_REDELIVERY_BACKOFF_MS``, capped), and the loop waits out that
    delay before fetching again so the redelivery comes before newer events. After
    ``max_deliveries`` failures, or at once for a message ``consume`` calls unappliable, the event is
    dead-lettered (``DEADLETTER`` stream) and acknowledged: the consumer moves on. Logs: the first
    failure with its stack, each later one on one line, the dead letter on one ERROR line.

    A durable deleted under it (by whoever holds the operator's key, or lost with a server's storage) is
    re-created with its own config, so from the stream's first sequence: its ack floor went with it, and
    events it had applied are skipped by the inbox, so nothing is lost even when several processes share
    the durable. Until it has caught up again (nothing pending), and for ``CONSUMER_CHECK_S`` at least,
    health check ``consumers`` says so.
    """

    subject: str  # the filter subject: the one event name it handles, or every event of its context
    stream: str
    durable: str
    apply: Callable[..., Awaitable[None]]  # (data, subject, session=None): ``bus.consume``'s handler
    together: bool = False  # ``Consumer.together``
    # One filter subject per event name it handles, used instead of ``subject`` where the server takes several
    # (NATS >= 2.10): the server then delivers none of the context's other events.
    filters: tuple[str, ...] = ()
    # ``EventApplier.batch``: a fetched batch in one open transaction, its events claimed in one statement;
    # without it a batch applied together calls ``apply`` once per event.
    apply_batch: Callable[[Sequence[tuple[bytes, str | None]], AsyncSession], Awaitable[bool]] | None = None
    deadletter_subject: str = ""
    max_deliveries: int = 5
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0
    # Failures per stream sequence (this process): a batch's later events are nak'ed behind a failing
    # one, which raises their server-side delivery count without them having failed.
    failures: dict[int, int] = field(default_factory=dict)
    # Counters the metrics endpoint exports.
    redelivered: int = 0
    dead_lettered: int = 0
    # A re-created durable replaying its stream: how many events it had pending last (None: not known yet).
    recovering: bool = False
    pending: int | None = None
    recreated: int = 0
    recreated_at: float = 0.0
    checked_at: float = 0.0

    async def run(self, runtime: Runtime) -> None:
        subscription = await self._subscribe(runtime)
        self.checked_at = time.monotonic()
        try:
            while True:
                try:
                    messages = await subscription.fetch(batch=EVENT_BATCH, timeout=EVENT_FETCH_TIMEOUT_S)
                except TimeoutError:
                    _stop_if_cancelled()  # nats-py may turn a cancellation inside fetch into a timeout
                    subscription = await self._check(runtime, subscription)  # nothing new, or no consumer
                    continue
                except (ConnectionClosedError, ServiceUnavailableError, NoRespondersError):
                    _stop_if_cancelled()
                    await asyncio.sleep(EVENT_FETCH_TIMEOUT_S)  # NATS is restarting: unacked events come again
                    # ... or the consumer is gone: a pull on a deleted one is answered 503 (no responders)
                    subscription = await self._check(runtime, subscription)
                    continue
                await self.apply_in_order(runtime, messages)
                if self.recovering and messages:
                    self.pending = messages[-1].metadata.num_pending
        finally:
            # The durable consumer stays on the server; only this process's interest ends (so a drain
            # at shutdown does not wait for a pull request that will never be answered).
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()

    async def _check(self, runtime: Runtime, subscription: Any) -> Any:
        """After a fetch that timed out or found no responder: is the durable still there (asked every
        ``CONSUMER_CHECK_S``, and each time while recovering)? A missing one is re-created (logged once,
        naming the consumer and its stream); a re-created one with nothing pending has caught up. Returns
        the subscription to fetch from next."""
        now = time.monotonic()
        if not self.recovering and now - self.checked_at < CONSUMER_CHECK_S:
            return subscription
        self.checked_at = now
        try:
            info = await runtime.jetstream.consumer_info(self.stream, self.durable)
        except NotFoundError:
            self.recovering, self.pending, self.recreated = True, None, self.recreated + 1
            self.recreated_at = now
            runtime.log.warning(CONSUMER_GONE_MESSAGE, extra={"durable": self.durable, "stream": self.stream})
            with contextlib.suppress(Exception):  # its server-side consumer is gone already
                await subscription.unsubscribe()
            return await self._subscribe(runtime)
        except Exception:  # NATS away or electing a leader: ask again at the next check
            _stop_if_cancelled()
            return subscription
        if self.recovering:
            self.pending = info.num_pending
            # caught up, and degraded for one check interval at least, so a health poller sees it happened
            if info.num_pending == 0 and info.num_ack_pending == 0 and now - self.recreated_at >= CONSUMER_CHECK_S:
                self.recovering = False
                runtime.log.info(
                    CONSUMER_CAUGHT_UP_MESSAGE,
                    extra={"durable": self.durable, "stream": self.stream, "sequence": info.delivered.stream_seq},
                )
        return subscription

    async def _subscribe(self, runtime: Runtime) -> Any:
        """The durable pull subscription, once its stream exists (its owner or the operator creates it:
        a service started before them waits, saying so once). The durable is created with its filter, or,
        made before with another filter (a release that filtered less), updated to it in place: it goes on
        from its own ack floor, so no event is lost or applied again."""
        said = False
        while True:
            try:
                await self._ensure(runtime)
                return await runtime.jetstream.pull_subscribe_bind(durable=self.durable, stream=self.stream)
            except (NotFoundError, NatsTimeoutError, ServiceUnavailableError, NoRespondersError) as exc:
                _stop_if_cancelled()
                if not said:
                    runtime.log.warning(
                        "waiting for a stream to consume",
                        extra={"stream": self.stream, "durable": self.durable, "error": type(exc).__name__},
                    )
                    said = True
                await asyncio.sleep(EVENT_FETCH_TIMEOUT_S)

    def config(self, nats: NatsClient) -> ConsumerConfig:
        """The durable's configuration: every event name it handles as a filter subject of its own where the
        server takes several (NATS >= 2.10), else ``subject``."""
        several = list(self.filters) if len(self.filters) > 1 and multi_filter(nats) else None
        return ConsumerConfig(
            name=self.durable,
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            filter_subject=None if several else self.subject,
            filter_subjects=several,
        )

    async def _ensure(self, runtime: Runtime) -> None:
        """Create the durable, or update the filter of one that has another (several processes may do either
        at once: the server answers the same config with the consumer as it is)."""
        js = runtime.jetstream
        wanted = self.config(runtime.nats)
        try:
            info = await js.consumer_info(self.stream, self.durable)
        except NotFoundError:  # no such consumer (or no stream yet: creating it says so)
            await js.add_consumer(self.stream, wanted)
            return
        has = filters_of(info.config)
        if has == filters_of(wanted):
            return
        extra = {"durable": self.durable, "stream": self.stream, "from": list(has), "to": list(filters_of(wanted))}
        try:
            await js.add_consumer(
                self.stream,
                dataclasses.replace(
                    info.config, filter_subject=wanted.filter_subject, filter_subjects=wanted.filter_subjects
                ),
            )
        except APIError as exc:  # a server that cannot: the durable keeps its filter (unhandled names are skipped)
            runtime.log.warning(
                "could not update an event consumer's filter; it keeps its own", extra=extra | {"error": str(exc)[:300]}
            )
            return
        runtime.log.info("event consumer's filter updated", extra=extra)

    async def apply_in_order(self, runtime: Runtime, messages: list[Msg]) -> None:
        """Apply a fetched batch in order: together in one transaction while that works, else one by one."""
        position = 0
        while position < len(messages):
            if self.together and len(messages) - position > 1:
                applied, failure = await self._apply_together(runtime, messages[position:])
                position += applied
                if failure is not None:  # messages[position] failed, its handler having run once
                    if not await self._failed(runtime, messages, position, failure):
                        return
                    position += 1
                    continue
                if applied:
                    continue
                # the transaction itself failed: this event goes alone
            message = messages[position]
            try:
                await self.apply(message.data, message.subject)
            except Exception as exc:
                if not await self._failed(runtime, messages, position, exc):
                    return
            else:
                self.failures.pop(message.metadata.sequence.stream, None)
                with contextlib.suppress(Exception):  # NATS away: redelivered after the ack wait, the inbox skips it
                    await message.ack()
            position += 1

    async def _failed(self, runtime: Runtime, messages: list[Msg], position: int, exc: Exception) -> bool:
        """``messages[position]`` raised ``exc`` (its handler ran once): dead-letter it (True: go on with the
        next) or nak it with the rest of the batch and wait the backoff out (False: stop this batch)."""
        message = messages[position]
        sequence = message.metadata.sequence.stream
        if isinstance(exc, UnappliableEvent):
            if not await self._dead_letter(runtime, message, str(exc)):
                await self._retry_later(messages[position:], failures=self.failures.get(sequence, 1))
                return False
            return True
        failures = self.failures.get(sequence, 0) + 1
        self.failures[sequence] = failures
        error = f"{type(exc).__name__}: {exc}"
        # The server's count bounds it across restarts (this process's count starts again at 0).
        server_deliveries = message.metadata.num_delivered or 0
        if failures >= self.max_deliveries or server_deliveries >= self.max_deliveries * RESTART_SLACK:
            if await self._dead_letter(runtime, message, error):
                return True
            await self._retry_later(messages[position:], failures=failures)
            return False
        delay = redelivery_delay_s(failures, base_s=self.backoff_s, max_s=self.backoff_max_s)
        extra = {"durable": self.durable, "sequence": sequence, "failures": failures, "retry_in_s": delay}
        if failures == 1:
            runtime.log.error("event handler failed; the event is redelivered", exc_info=exc, extra=extra)
        else:
            runtime.log.warning(
                "event handler failed again; the event is redelivered", extra=extra | {"error": error[:300]}
            )
        self.redelivered += 1
        await self._retry_later(messages[position:], failures=failures)
        return False

    async def _apply_together(self, runtime: Runtime, messages: list[Msg]) -> tuple[int, Exception | None]:
        """Apply ``messages`` in one transaction (each event still once, through the inbox), then ack them:
        one commit for the batch instead of one per event. Returns how many were applied and acked, and
        the exception of the event that failed after them (its handler ran once, as one by one), or None
        with 0 applied when the transaction failed otherwise (the caller then applies one by one)."""
        uow = runtime.uow
        try:
            async with uow.sessions() as session, session.begin():
                emitted = await self._batch(messages, session)
        except BatchFailed as failed:
            if failed.position == 0:
                return 0, failed.error
            # The events before the failing one were fine: apply them together again, then report it.
            applied, again = await self._apply_together(runtime, messages[: failed.position])
            return (applied, failed.error) if again is None and applied == failed.position else (0, None)
        except Exception:
            return 0, None
        if emitted:
            uow.wake()
        committed_on(session)  # memory follows only what committed (a rolled-back batch changed none)
        for message in messages:
            self.failures.pop(message.metadata.sequence.stream, None)
            with contextlib.suppress(Exception):  # NATS away: redelivered after the ack wait, the inbox skips it
                await message.ack()
        return len(messages), None

    async def _batch(self, messages: list[Msg], session: AsyncSession) -> bool:
        """``messages`` in ``session``'s transaction; whether they emitted events (True when not known).
        Raises ``BatchFailed`` naming the first that failed."""
        if self.apply_batch is not None:
            return await self.apply_batch([(message.data, message.subject) for message in messages], session)
        for position, message in enumerate(messages):
            try:
                await self.apply(message.data, message.subject, session=session)
            except Exception as exc:
                raise BatchFailed(position, exc) from exc
        return True

    async def _retry_later(self, messages: list[Msg], *, failures: int) -> None:
        """Nak ``messages`` (the failing one first, the rest of its batch in order) and wait the delay out."""
        delay = redelivery_delay_s(failures, base_s=self.backoff_s, max_s=self.backoff_max_s)
        for message in messages:
            with contextlib.suppress(Exception):  # NATS away: the ack wait redelivers them anyway
                await message.nak(delay=delay)
        await asyncio.sleep(delay)

    async def _dead_letter(self, runtime: Runtime, message: Msg, error: str) -> bool:
        """Park ``message`` in DEADLETTER and ack it; False (nothing acked) when it could not be published."""
        sequence = message.metadata.sequence.stream
        deliveries = message.metadata.num_delivered or 1
        try:
            await dead_letter(
                runtime.jetstream,
                subject=self.deadletter_subject,
                message=message,
                consumer=self.durable,
                error=error,
                deliveries=deliveries,
            )
            await message.ack()
        except Exception as exc:
            runtime.log.warning(
                "could not dead-letter an event; it is redelivered",
                extra={"durable": self.durable, "sequence": sequence, "error": f"{type(exc).__name__}: {exc}"[:300]},
            )
            return False
        self.failures.pop(sequence, None)
        self.dead_lettered += 1
        runtime.log.error(
            DEAD_LETTERED_MESSAGE,
            extra={
                "durable": self.durable,
                "subject": message.subject,
                "sequence": sequence,
                "deliveries": deliveries,
                "error": error[:300],
            },
        )
        return True


def consumers_check(loops: list[EventLoop]) -> str:
    """Health check ``consumers``: ``ok``, or which re-created durables are still replaying their stream."""
    recovering = [loop for loop in loops if loop.recovering]
    if not recovering:
        return "ok"
    parts = [
        f"{loop.durable} on {loop.stream} re-created, "
        + ("replaying" if loop.pending is None else f"{loop.pending} events pending")
        for loop in recovering
    ]
    return "recovering: " + "; ".join(parts)


def multi_filter(nats: NatsClient) -> bool:
    """Whether the server takes several filter subjects per consumer (NATS >= 2.10)."""
    version = nats.connected_server_version
    return (version.major, version.minor) >= (2, 10)


def filters_of(config: ConsumerConfig) -> tuple[str, ...]:
    """A consumer's filter subjects, sorted (one, several, or none: the whole stream)."""
    if config.filter_subjects:
        return tuple(sorted(config.filter_subjects))
    return (config.filter_subject,) if config.filter_subject else ()


def event_loop(
    runtime: Runtime,
    *,
    subject: str,
    context: Context,
    durable: str,
    apply: Any,
    together: bool = False,
    filters: tuple[str, ...] = (),
    apply_batch: Any = None,
) -> EventLoop:
    settings = runtime.settings
    return EventLoop(
        subject=subject,
        filters=filters,
        together=together,
        stream=stream_name(context, stream_prefix=settings.kit.stream_prefix),
        durable=durable,
        apply=apply,
        apply_batch=apply_batch,
        deadletter_subject=runtime.subjects.deadletter(context, durable),
        max_deliveries=settings.kit.event_max_deliveries,
        backoff_s=settings.kit.event_redelivery_backoff_ms / 1000,
        backoff_max_s=settings.kit.event_redelivery_backoff_max_ms / 1000,
    )


def filter_subjects(subjects: Subjects, context: Context, names: Iterable[str]) -> tuple[str, ...]:
    """The subject of each event name, sorted; a node-scoped event's with the node token after it
    (``Subjects.event``)."""
    scoped = NODE_SCOPED_EVENTS.get(context, ())
    return tuple(
        sorted(subjects.event(context, name) + (".*" if name in scoped else "") for name in dict.fromkeys(names))
    )


def subscribe_consumer(runtime: Runtime, consumer: Consumer, ctx: Any) -> EventLoop:
    handlers = {name: factory(ctx) for name, factory in consumer.on.items()}
    filters = filter_subjects(runtime.subjects, consumer.context, handlers)
    apply = consume(
        uow=runtime.uow,
        schema=runtime.schema,
        consumer=consumer.durable,
        context=consumer.context,
        handlers=handlers,
        skip=consumer.skip,
    )
    return event_loop(
        runtime,
        # one name: its subject, as ever; several: each its own where the server can (``filters``)
        subject=filters[0] if len(filters) == 1 else runtime.subjects.events_of(consumer.context),
        filters=filters if len(filters) > 1 else (),
        context=consumer.context,
        durable=durable_name(runtime.settings, runtime.schema, consumer.durable),
        apply=apply,
        apply_batch=apply.batch,
        together=consumer.together,
    )
