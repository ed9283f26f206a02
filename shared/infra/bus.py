"""NATS/JetStream adapters: stream creation, typed request/reply dispatch, idempotent event consumers."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, BadRequestError, NotFoundError
from nats.nuid import NUID
from opentelemetry.trace import SpanKind
from pydantic import BaseModel, ValidationError
from sqlalchemy.ext.asyncio import AsyncSession

from shared.contracts.base import (
    CONTRACT_MAJOR_VERSION,
    ECHO_MAX,
    NAME_MAX,
    ErrorCode,
    Rejected,
    Request,
    echo,
    major_version,
    rejected,
)
from shared.contracts.envelope import EventEnvelope
from shared.contracts.streams import StreamSpec
from shared.contracts.subjects import Context
from shared.infra import tracing
from shared.infra.inbox import claim, claim_many
from shared.infra.trust import EventReader, summarise
from shared.infra.uow import EventTooLarge, UnitOfWork, UnitOfWorkFactory, committed_on

log = logging.getLogger("hetsched.bus")

RequestT = TypeVar("RequestT", bound=Request)
Handler = Callable[[RequestT], Awaitable[BaseModel]]
# called as handler(uow=UnitOfWork, event=EventEnvelope, payload=<contract model>)
TypedEventHandler = Callable[..., Awaitable[None]]


def _stream_config(spec: StreamSpec) -> StreamConfig:
    return StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE if spec.file_storage else StorageType.MEMORY,
        discard=DiscardPolicy.OLD,
        duplicate_window=spec.duplicate_window_s,
        max_age=spec.max_age_s,
        max_bytes=spec.max_bytes,
        num_replicas=spec.replicas,
    )


def _limits(max_age_s: float | None, max_bytes: int | None) -> tuple[float, int]:
    """A stream's limits as JetStream states them (0 s and -1 bytes: none), to compare a spec with a stream."""
    return (round(max_age_s or 0.0, 3), max_bytes if max_bytes and max_bytes > 0 else -1)


async def ensure_streams(js: JetStreamContext, specs: tuple[StreamSpec, ...], *, update: bool = True) -> None:
    """Create or (``update``) update every stream, limits included (a stream made with other limits gets
    these in place); safe to run from several services at once. A stream this caller may not update
    (``update=False``) whose limits differ from the spec is left as it is, with one WARNING line."""
    for spec in specs:
        config = _stream_config(spec)
        for _attempt in range(3):
            try:
                info = await js.stream_info(spec.name)
            except NotFoundError:
                try:
                    await _create_or_uncap(js, config)
                    break
                except BadRequestError:
                    continue  # another service created it between our two calls: update it instead
            else:
                if update:
                    await _create_or_uncap(js, config, update=True)
                elif _limits(info.config.max_age, info.config.max_bytes) != _limits(spec.max_age_s, spec.max_bytes):
                    log.warning(
                        "a stream's limits differ from the settings; its owner or the operator updates it",
                        extra={
                            "stream": spec.name,
                            "max_age_s": info.config.max_age,
                            "max_bytes": info.config.max_bytes,
                            "wanted_max_age_s": spec.max_age_s,
                            "wanted_max_bytes": spec.max_bytes,
                        },
                    )
                break


INSUFFICIENT_STORAGE = 10047  # JetStream's error code: the store cannot reserve a stream's max_bytes


async def _create_or_uncap(js: JetStreamContext, config: StreamConfig, *, update: bool = False) -> None:
    """Add (or update) a stream; when the server's store cannot reserve its size cap, without the cap,
    with one ERROR line naming the setting (the max age still bounds it, and the stack keeps working)."""
    call = js.update_stream if update else js.add_stream
    try:
        await call(config)
    except APIError as exc:
        if exc.err_code != INSUFFICIENT_STORAGE or not config.max_bytes or config.max_bytes <= 0:
            raise
        log.error(
            "the NATS server's JetStream store cannot reserve this stream's size cap: the stream runs without one "
            "(lower HETSCHED_STREAM_MAX_BYTES or give the server more store)",
            extra={"stream": config.name, "max_bytes": config.max_bytes},
        )
        await call(dataclasses.replace(config, max_bytes=-1))


ORDERED_HEARTBEAT_S = 5.0
"""Idle heartbeat of an ordered consumer: two missed (its consumer deleted, say) and it is re-created."""


def ordered_name() -> str:
    """A fresh, unguessable name for an ordered consumer (no other identity may list consumers)."""
    return NUID().next().decode()


async def follow(
    js: JetStreamContext,
    subject: str,
    *,
    stream: str,
    cb: Callable[[Msg], Awaitable[None]],
    deliver_policy: DeliverPolicy,
    log: logging.Logger = log,
    idle_heartbeat_s: float = ORDERED_HEARTBEAT_S,
) -> JetStreamContext.PushSubscription:
    """An ordered (ephemeral, push) consumer of ``subject`` on ``stream`` that calls ``cb`` with each event.

    It is created under a name of our own in the subject that names it and its filter
    (``$JS.API.CONSUMER.CREATE.<stream>.<name>.<subject>``), the only form a service's permissions allow
    for ordered consumers (``shared.contracts.permissions.consumer_grants``). nats-py re-creates an ordered
    consumer from the next sequence after a gap or two missed heartbeats (one deleted under it): each
    re-creation gets a new name, as the old consumer may still exist (reusing its name would be an update
    the server refuses), and is logged.
    """
    subscription = await js.subscribe(
        subject,
        stream=stream,
        cb=cb,
        ordered_consumer=True,
        deliver_policy=deliver_policy,
        idle_heartbeat=idle_heartbeat_s,
        config=ConsumerConfig(name=ordered_name()),
    )
    state: Any = subscription._sub._jsi  # nats-py's ordered-consumer state: what its reset re-creates
    recreate = state.recreate_consumer

    async def renamed() -> None:
        state._ccreq.name = ordered_name()
        log.warning(
            "ordered consumer re-created",
            extra={"stream": stream, "subject": subject, "from_sequence": state._ccreq.opt_start_seq},
        )
        await recreate()

    state.recreate_consumer = renamed
    return subscription


# Request bodies (API.md "Limits"): the size cap comes from settings (`HETSCHED_REQUEST_MAX_BYTES`).
DEFAULT_MAX_REQUEST_BYTES = 512 * 1024
MAX_DEPTH = 64  # no contract nests deeper than a few levels
REPLY_MARGIN_BYTES = 4096  # headers travel in the same NATS message as the reply body
PART_MAX = 200  # one part of an error message (a parser's or a validator's own words)


def invalid_request(error: ValidationError, *, request_id: object = None) -> Rejected:
    """The ``invalid_request`` reply to a body its contract refuses (the message names the fields)."""
    reply = rejected(ErrorCode.INVALID_REQUEST, summarise(error))
    return reply.model_copy(update={"request_id": _echoed_id(request_id)})


def _echoed_id(request_id: object) -> str | None:
    """A request id worth repeating in a refusal: a string of a sane length, else none."""
    return request_id if isinstance(request_id, str) and 0 < len(request_id) <= NAME_MAX else None


def _encode(model: BaseModel) -> bytes:
    return model.model_dump_json().encode()


def _refuse(message: str, *, code: ErrorCode = ErrorCode.INVALID_REQUEST, request_id: object = None) -> bytes:
    reply = rejected(code, message)
    return _encode(reply.model_copy(update={"request_id": _echoed_id(request_id)}))


def _problem(data: object) -> str | None:
    """Why a parsed body is refused before its contract sees it: nested too deep, or a NUL in a string
    (Postgres cannot store one). Walks the body once, without recursion."""
    stack: list[tuple[object, int, str]] = [(data, 0, "")]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_DEPTH:
            return f"body is nested deeper than {MAX_DEPTH} levels"
        if isinstance(value, str):
            if "\x00" in value:
                return f"field '{where[:ECHO_MAX] or 'body'}': NUL characters are not allowed"
        elif isinstance(value, dict):
            for key, item in value.items():
                if "\x00" in key:
                    return "a field name contains a NUL character"
                stack.append((item, depth + 1, f"{where}.{key}" if where else key))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, f"{where}[{i}]") for i, item in enumerate(value))
    return None


def _plainly_sound(raw: bytes) -> bool:
    """Whether a body that parsed as an object cannot hold what ``_problem`` refuses, read off its bytes
    without walking it. With no zero byte it was UTF-8 (JSON's punctuation in UTF-16 or 32 has zero bytes),
    so a NUL in a string or a name is the escape ``\\u0000`` (JSON holds no raw control character);
    nesting deeper than MAX_DEPTH takes more than MAX_DEPTH brackets. Brackets or a backslash inside
    strings only make it say no: then ``_problem`` walks the body."""
    return b"\x00" not in raw and b"\\u0000" not in raw and raw.count(b"{") + raw.count(b"[") <= MAX_DEPTH


async def dispatch(
    raw: bytes,
    model: type[RequestT],
    handler: Handler[RequestT],
    *,
    max_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_reply_bytes: int | None = None,
    scope: str | None = None,
    scope_of: Callable[[Any], str | None] | None = None,
) -> bytes:
    """Turn raw request bytes into a reply, never raising.

    A body over ``max_bytes``, malformed JSON (or nested past the parser's recursion limit, or with an
    integer longer than Python converts), a body that is not an object, nested deeper than
    ``MAX_DEPTH``, holding a NUL character, or that does not validate gives ``invalid_request``; an
    unknown major version gives ``unsupported_version``; an unexpected exception in the handler gives
    ``internal`` (logged with its stack, not sent to the caller). Messages repeat the caller's input
    cut short (``echo``). A reply longer than ``max_reply_bytes`` (what NATS can carry) becomes a short
    ``internal`` saying the answer was too large. A request that came on a scoped subject (``scope``: the
    tenant or node its subject names, see ``shared.contracts.subjects.TENANT_SCOPED``) whose body names
    another (``scope_of``) is ``forbidden`` and reaches no handler.
    """
    if len(raw) > max_bytes:
        return _refuse(f"body is {len(raw)} bytes; the limit is {max_bytes}")
    try:
        data: Any = json.loads(raw) if raw else None
    except RecursionError:
        return _refuse("body is nested too deeply to parse")
    except (UnicodeDecodeError, ValueError) as exc:  # ValueError: JSONDecodeError, or an over-long integer
        return _refuse(f"body is not valid JSON: {str(exc)[:PART_MAX]}")
    if not isinstance(data, dict):
        return _refuse("body must be a JSON object")
    problem = None if _plainly_sound(raw) else _problem(data)
    if problem is not None:
        return _refuse(problem, request_id=data.get("request_id"))
    if "version" in data:
        major = major_version(data["version"])
        if major is None:
            return _refuse(f"unreadable version {echo(data['version'])}")
        if major != CONTRACT_MAJOR_VERSION:
            return _encode(
                rejected(
                    ErrorCode.UNSUPPORTED_VERSION,
                    f"version {echo(data['version'])} is not supported; this server speaks {CONTRACT_MAJOR_VERSION}",
                    supported=[CONTRACT_MAJOR_VERSION],
                )
            )
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        return _encode(invalid_request(exc, request_id=data.get("request_id")))
    except (ValueError, RecursionError) as exc:  # a validator that failed outside pydantic's own errors
        return _refuse(f"body does not validate: {type(exc).__name__}", request_id=data.get("request_id"))
    if scope is not None and scope_of is not None and scope_of(request) != scope:
        return _refuse(
            f"this subject acts for {echo(scope)} only; the request names {echo(scope_of(request))}",
            code=ErrorCode.FORBIDDEN,
            request_id=data.get("request_id"),
        )
    try:
        reply = _encode(await handler(request))
    except EventTooLarge as exc:  # the request would announce more than one event can carry
        return _refuse(str(exc), code=exc.code, request_id=data.get("request_id"))
    except Exception:
        log.exception("request handler failed", extra={"model": model.__name__})
        return _refuse(
            "internal error; the server logged it", code=ErrorCode.INTERNAL, request_id=data.get("request_id")
        )
    if max_reply_bytes is not None and len(reply) > max_reply_bytes:
        log.error("a reply is too large to send", extra={"model": model.__name__, "bytes": len(reply)})
        return _refuse(
            f"the answer was too large to send ({len(reply)} bytes; the limit is {max_reply_bytes}); ask for less",
            code=ErrorCode.INTERNAL,
            request_id=data.get("request_id"),
        )
    return reply


class BatchFailed(Exception):
    """An event of a batch applied together raised: its position in the batch and what it raised (an
    ``UnappliableEvent`` for a message the trust check refused)."""

    def __init__(self, position: int, error: Exception) -> None:
        super().__init__(f"event {position} of the batch failed: {type(error).__name__}: {error}")
        self.position = position
        self.error = error


class EventApplier:
    """``consume``'s result: applies one context's events by name, each event id once (see ``consume``).

    Called with one message (``await applier(raw, subject)``), or ``batch`` for several in one open
    transaction: every message is checked first, the events to apply are claimed in the inbox with one
    statement, then their handlers run in stream order."""

    def __init__(
        self,
        *,
        uow: UnitOfWorkFactory,
        schema: str,
        consumer: str,
        context: Context,
        handlers: dict[str, TypedEventHandler],
        publisher: str | None = None,
        skip: Callable[[Any], bool] | None = None,
    ) -> None:
        self._uow = uow
        self._schema = schema
        self._consumer = consumer
        self._handlers = handlers
        self._skip = skip
        self._reader = EventReader(context, publisher=publisher)

    def _open(self, raw: bytes, subject: str | None) -> tuple[EventEnvelope, Any, TypedEventHandler] | None:
        """The event, its payload and its handler; None for an event this consumer has nothing to do with."""
        event, name = self._reader.envelope(raw)
        handler = self._handlers.get(name)
        if handler is None:
            return None
        payload = self._reader.payload(event, name, subject)
        if self._skip is not None and self._skip(payload):
            return None
        return event, payload, handler

    async def __call__(self, raw: bytes, subject: str | None = None, session: AsyncSession | None = None) -> None:
        opened = self._open(raw, subject)
        if opened is None:
            return
        event, payload, handler = opened
        if session is not None:  # part of a batch's transaction: the caller commits (and wakes the relay)
            if await claim(session=session, schema=self._schema, consumer=self._consumer, event_id=event.event_id):
                await self._traced(event, payload, handler, session)
            return
        emitted = False
        async with self._uow.sessions() as own, own.begin():
            if await claim(session=own, schema=self._schema, consumer=self._consumer, event_id=event.event_id):
                emitted = await self._traced(event, payload, handler, own)
        if emitted:
            self._uow.wake()
        committed_on(own)  # memory follows only what committed

    async def batch(self, messages: Sequence[tuple[bytes, str | None]], session: AsyncSession) -> bool:
        """Apply ``messages`` (body, subject) in the caller's open transaction, in order; whether their
        handlers emitted events (the caller wakes the relay once it committed). Raises ``BatchFailed`` at the
        first message in order that cannot be applied (the trust check refused it, or its handler raised):
        the caller rolls the transaction back."""
        opened: list[tuple[int, EventEnvelope, Any, TypedEventHandler]] = []
        refused: BatchFailed | None = None
        for position, (raw, subject) in enumerate(messages):
            try:
                one = self._open(raw, subject)
            except Exception as exc:  # the events before it still go first: a handler there may fail earlier
                refused = BatchFailed(position, exc)
                break
            if one is not None:
                opened.append((position, *one))
        emitted = False
        if opened:
            claimed = await claim_many(
                session=session,
                schema=self._schema,
                consumer=self._consumer,
                event_ids=[event.event_id for _, event, _, _ in opened],
            )
            for position, event, payload, handler in opened:
                if event.event_id not in claimed:  # applied before, or earlier in this batch
                    continue
                claimed.discard(event.event_id)
                try:
                    emitted = await self._traced(event, payload, handler, session) or emitted
                except Exception as exc:
                    raise BatchFailed(position, exc) from exc
        if refused is not None:
            raise refused
        return emitted

    async def _traced(
        self, event: EventEnvelope, payload: Any, handler: TypedEventHandler, session: AsyncSession
    ) -> bool:
        """Run the handler in the event's trace (a CONSUMER span when spans are exported); whether it emitted."""
        parent = tracing.from_traceparent(event.traceparent)
        if parent is None:  # an event no request caused (a sweep, an agent's report): no trace to continue
            return await self._run(event, payload, handler, session)
        attributes = {
            "messaging.system": "nats",
            "messaging.operation.type": "process",
            "messaging.consumer.group.name": self._consumer,
            "messaging.message.id": str(event.event_id),
        }
        with tracing.span(event.type, kind=SpanKind.CONSUMER, parent=parent, attributes=attributes):
            return await self._run(event, payload, handler, session)

    async def _run(self, event: EventEnvelope, payload: Any, handler: TypedEventHandler, session: AsyncSession) -> bool:
        emitted = False

        async def work(unit: UnitOfWork) -> None:
            nonlocal emitted
            await handler(uow=unit, event=event, payload=payload)
            emitted = bool(unit.events)

        await self._uow.run(work, session=session)
        return emitted


def consume(
    *,
    uow: UnitOfWorkFactory,
    schema: str,
    consumer: str,
    context: Context,
    handlers: dict[str, TypedEventHandler],
    publisher: str | None = None,
    skip: Callable[[Any], bool] | None = None,
) -> EventApplier:
    """Apply one context's events by name, each event id once, with its effects and their events in
    one transaction; the payload reaches the handler as its contract model (``EVENTS``). Given an open
    ``session``, the event joins that transaction instead (a batch of events applied together; or
    ``EventApplier.batch``, which claims a batch's events in one statement).

    Nothing on the bus is trusted: a message that is not an envelope, whose ``type`` is not of this
    context, whose ``source`` is not the context's publisher (``publisher``, by default
    ``EVENT_PUBLISHERS``), whose payload does not match its contract, or (a node-scoped event, given the
    ``subject`` it came on) whose payload names another node than its subject, raises
    ``UnappliableEvent`` (redelivering it cannot help: the caller dead-letters it); an exception from a
    handler propagates so the caller redelivers the event with backoff, then dead-letters it. An event
    ``skip`` says is none of this consumer's business (after those checks) is done with at once.

    An event that records a trace (``EventEnvelope.traceparent``) is applied in that trace: inside a
    CONSUMER span named after its type when spans are exported (``shared.infra.tracing``), and the
    events its handler emits carry the trace on.
    """
    return EventApplier(
        uow=uow, schema=schema, consumer=consumer, context=context, handlers=handlers, publisher=publisher, skip=skip
    )
