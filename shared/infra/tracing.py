"""W3C trace context across NATS: one trace per outside request, through every service it reaches.

A request's context travels in NATS headers (``traceparent``, ``tracestate``): ``RpcClient.call``
injects the current one, ``RequestServer`` extracts it and serves the request inside a SERVER span, so
a call made while serving is a child of it. An event records the context it was emitted in
(``EventEnvelope.traceparent``); the outbox relay publishes it as a header too, and ``bus.consume``
applies the event inside a CONSUMER span continuing that trace.

Propagation is always on and costs a header or two. Spans are only made while a provider exports
them (``HETSCHED_OTEL_EXPORTER=console|otlp``, see ``shared.infra.telemetry``): otherwise ``span``
makes none and only makes the incoming context current, so an outgoing call still carries the
caller's trace on.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
INSTRUMENTATION = "hetsched"

_TRACE_CONTEXT = TraceContextTextMapPropagator()
# The tracer of an exporting provider, or None: no span is made at all (not even a no-op one).
_tracer: Tracer | None = None
# What ``serving`` says: the traces of the requests the current work serves, by correlation id.
_serving: ContextVar[Mapping[str, str | None] | None] = ContextVar("hetsched_serving_traces", default=None)

Attributes = Mapping[str, AttributeValue]


def export_with(provider: trace.TracerProvider | None) -> None:
    """Make real spans with ``provider`` (one that exports them), or none (``None``)."""
    global _tracer
    _tracer = provider.get_tracer(INSTRUMENTATION) if provider is not None else None


def recording() -> bool:
    """Whether spans are made (an exporter is configured)."""
    return _tracer is not None


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add the current trace context (``traceparent``, ``tracestate``, baggage) to ``headers``; nothing
    when there is none."""
    if trace.get_current_span().get_span_context().is_valid:
        propagate.inject(headers)
    return headers


def extract(headers: Mapping[str, str] | None) -> Context | None:
    """The trace context ``headers`` carry, or None when they carry none."""
    if not headers or TRACEPARENT not in headers:
        return None
    return propagate.extract(headers)


@contextmanager
def serving(traces: Mapping[str, str | None]) -> Iterator[None]:
    """Work done for several requests at once, outside their tasks (a group commit's lane): the trace of
    each (a ``traceparent``, captured where the request was taken) by its correlation id, for
    ``traceparent`` to give an event emitted for that request."""
    token = _serving.set(traces)
    try:
        yield
    finally:
        _serving.reset(token)


def traceparent(correlation_id: str | None = None) -> str | None:
    """The trace an event emitted now belongs to, as a ``traceparent`` value: that of the request
    ``correlation_id`` names when ``serving`` says, else the current context's; None without one."""
    if correlation_id is not None:
        traces = _serving.get()
        if traces is not None and (value := traces.get(correlation_id)):
            return value
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _TRACE_CONTEXT.inject(carrier)
    return carrier.get(TRACEPARENT)


def from_traceparent(value: str | None) -> Context | None:
    """The context a recorded ``traceparent`` names, or None (absent or unreadable)."""
    if not value:
        return None
    parent = _TRACE_CONTEXT.extract({TRACEPARENT: value})
    return parent if trace.get_current_span(parent).get_span_context().is_valid else None


def headers_of(value: str | None) -> dict[str, str]:
    """NATS headers carrying a recorded ``traceparent`` (empty without one)."""
    return {TRACEPARENT: value} if value else {}


_NO_SPAN: AbstractContextManager[None] = nullcontext()  # reusable: entering it does nothing


def span(
    name: str,
    *,
    kind: SpanKind,
    parent: Context | None = None,
    attributes: Attributes | None = None,
) -> AbstractContextManager[None]:
    """Run the body inside a ``kind`` span named ``name``, child of ``parent`` (else of the current
    context). Without an exporter no span is made: ``parent``, when given, just becomes current, and
    without one either nothing is done at all (every request without a trace takes that path)."""
    tracer = _tracer
    if tracer is None:
        return _NO_SPAN if parent is None else _current(parent)
    return _recorded(tracer, name, kind, parent, attributes)


@contextmanager
def _current(parent: Context) -> Iterator[None]:
    token = otel_context.attach(parent)
    try:
        yield
    finally:
        otel_context.detach(token)


@contextmanager
def _recorded(
    tracer: Tracer, name: str, kind: SpanKind, parent: Context | None, attributes: Attributes | None
) -> Iterator[None]:
    with tracer.start_as_current_span(name, context=parent, kind=kind, attributes=attributes):
        yield
