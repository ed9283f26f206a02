"""OpenTelemetry setup: one tracer and meter provider per process, exporter chosen by settings."""

from __future__ import annotations

import os

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from shared.infra import tracing


def _one_line(span: ReadableSpan) -> str:
    """A span as one JSON line on stdout (as the JSON logs are), not the exporter's indented block."""
    line: str = span.to_json(indent=None)
    return line + os.linesep


def configure_telemetry(*, service: str, exporter: str) -> tuple[TracerProvider, MeterProvider]:
    """Providers tagged with the service name; ``console`` prints spans, ``none`` keeps them in process.

    ``otlp`` needs the ``opentelemetry-exporter-otlp`` package; without it we fall back to ``none``.
    Only with an exporter does hetsched make its own spans (``shared.infra.tracing``); the trace
    context is carried across NATS either way.
    """
    resource = Resource.create({"service.name": f"hetsched-{service}"})
    tracer_provider = TracerProvider(resource=resource)
    exporting = False
    if exporter == "console":
        tracer_provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(formatter=_one_line)))
        exporting = True
    elif exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter,
            )

            tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            exporting = True
        except ImportError:
            pass
    meter_provider = MeterProvider(resource=resource)
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)
    tracing.export_with(tracer_provider if exporting else None)
    return tracer_provider, meter_provider
