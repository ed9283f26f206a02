"""NATS/JetStream adapters: stream creation, typed request/reply dispatch, idempotent event consumers."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError
from pydantic import BaseModel, ValidationError

from shared.contracts.base import CONTRACT_MAJOR_VERSION, ErrorCode, Rejected, Request, major_version, rejected
from shared.contracts.envelope import EventEnvelope
from shared.contracts.registry import EVENTS
from shared.contracts.streams import StreamSpec
from shared.contracts.subjects import Context
from shared.infra.inbox import claim
from shared.infra.uow import UnitOfWork, UnitOfWorkFactory

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
    )


async def ensure_streams(js: JetStreamContext, specs: tuple[StreamSpec, ...]) -> None:
    """Create or update every stream; safe to run from several services at once."""
    for spec in specs:
        config = _stream_config(spec)
        for _attempt in range(3):
            try:
                await js.stream_info(spec.name)
            except NotFoundError:
                try:
                    await js.add_stream(config)
                    break
                except BadRequestError:
                    continue  # another service created it between our two calls: update it instead
            else:
                await js.update_stream(config)
                break


def _summarise(error: ValidationError) -> str:
    parts = []
    for item in error.errors()[:5]:
        where = ".".join(str(p) for p in item["loc"]) or "body"
        parts.append(f"field '{where}': {item['msg']}")
    return "; ".join(parts)


def invalid_request(error: ValidationError, *, request_id: object = None) -> Rejected:
    """The ``invalid_request`` reply to a body its contract refuses (the message names the fields)."""
    reply = rejected(ErrorCode.INVALID_REQUEST, _summarise(error))
    return reply.model_copy(update={"request_id": request_id}) if isinstance(request_id, str) else reply


def _encode(model: BaseModel) -> bytes:
    return model.model_dump_json().encode()


async def dispatch(raw: bytes, model: type[RequestT], handler: Handler[RequestT]) -> bytes:
    """Turn raw request bytes into a reply, never raising.

    Malformed JSON, a body that is not an object, or a body that does not validate gives
    ``invalid_request``; an unknown major version gives ``unsupported_version``; an unexpected
    exception in the handler gives ``internal`` (logged with its stack, not sent to the caller).
    """
    try:
        data: Any = json.loads(raw) if raw else None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return _encode(rejected(ErrorCode.INVALID_REQUEST, f"body is not valid JSON: {exc}"))
    if not isinstance(data, dict):
        return _encode(rejected(ErrorCode.INVALID_REQUEST, "body must be a JSON object"))
    if "version" in data:
        major = major_version(data["version"])
        if major is None:
            return _encode(rejected(ErrorCode.INVALID_REQUEST, f"unreadable version {data['version']!r}"))
        if major != CONTRACT_MAJOR_VERSION:
            return _encode(
                rejected(
                    ErrorCode.UNSUPPORTED_VERSION,
                    f"version {data['version']!r} is not supported; this server speaks {CONTRACT_MAJOR_VERSION}",
                    supported=[CONTRACT_MAJOR_VERSION],
                )
            )
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        return _encode(invalid_request(exc, request_id=data.get("request_id")))
    try:
        return _encode(await handler(request))
    except Exception:
        log.exception("request handler failed", extra={"model": model.__name__})
        return _encode(rejected(ErrorCode.INTERNAL, "internal error; the server logged it"))


def consume(
    *,
    uow: UnitOfWorkFactory,
    schema: str,
    consumer: str,
    context: Context,
    handlers: dict[str, TypedEventHandler],
) -> Callable[[bytes], Awaitable[None]]:
    """Apply one context's events by name, each event id once, with its effects and their events in
    one transaction; the payload reaches the handler as its contract model (``EVENTS``).

    A message that is not an envelope, or whose payload does not match its contract, is logged and
    dropped (redelivering it cannot help); an exception from a handler propagates so the
    subscriber's ack policy redelivers the event.
    """

    async def on_message(raw: bytes) -> None:
        try:
            event = EventEnvelope.model_validate_json(raw)
        except ValidationError as exc:
            log.warning("dropping a message that is not an event envelope", extra={"error": str(exc)[:300]})
            return
        name = event.type.rsplit(".", 1)[-1]
        handler = handlers.get(name)
        if handler is None:
            return
        model = EVENTS.get((context, name))
        try:
            payload = model.model_validate(event.payload) if model is not None else event.payload
        except ValidationError as exc:
            log.warning(
                "dropping an event whose payload does not match its contract",
                extra={"event_id": str(event.event_id), "type": event.type, "error": str(exc)[:300]},
            )
            return
        emitted = False
        async with uow.sessions() as session, session.begin():
            if await claim(session=session, schema=schema, consumer=consumer, event_id=event.event_id):

                async def work(unit: UnitOfWork) -> None:
                    nonlocal emitted
                    await handler(uow=unit, event=event, payload=payload)
                    emitted = bool(unit.events)

                await uow.run(work, session=session)
        if emitted:
            uow.wake()

    return on_message
