"""OpenTelemetry setup: one tracer and meter provider per process, exporter chosen by settings."""

from __future__ import annotations

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter


def configure_telemetry(*, service: str, exporter: str) -> tuple[TracerProvider, MeterProvider]:
    """Providers tagged with the service name; ``console`` prints spans, ``none`` keeps them in process.

    ``otlp`` needs the ``opentelemetry-exporter-otlp`` package; without it we fall back to ``none``.
    """
    resource = Resource.create({"service.name": f"hetsched-{service}"})
    tracer_provider = TracerProvider(resource=resource)
    if exporter == "console":
        tracer_provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter,
            )

            tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        except ImportError:
            pass
    meter_provider = MeterProvider(resource=resource)
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)
    return tracer_provider, meter_provider
