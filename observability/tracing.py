"""OpenTelemetry set-up and trace propagation over NATS headers.

The provider is configured by the standard ``OTEL_*`` variables (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_SERVICE_NAME``, ``OTEL_TRACES_EXPORTER`` …) and exports OTLP, which Jaeger ingests.
With no endpoint configured, spans are created (so ids appear in logs) but not exported.

Spans follow the OpenTelemetry messaging conventions: ``send <subject>`` (PRODUCER) on publish,
``process <subject>`` (CONSUMER) on handling, linked through the W3C ``traceparent`` header.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

_PROVIDER_SET = False
_TRACER: trace.Tracer | None = None
# W3C trace context is two short headers; we budget this much under max_payload for headers.
TRACE_HEADER_BUDGET = 512


def configure_tracing(service: str, *, instance: str = "0", run: str = "") -> None:
    """Install a tracer provider once per process; export OTLP only when configured."""
    global _PROVIDER_SET
    if _PROVIDER_SET:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({
        "service.name": os.environ.get("OTEL_SERVICE_NAME", f"rlbus-{service}"),
        "service.instance.id": instance,
        "rlbus.run": run,
    })
    provider = TracerProvider(resource=resource)
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if endpoint and os.environ.get("OTEL_TRACES_EXPORTER", "otlp") != "none":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _PROVIDER_SET = True
    global _TRACER
    _TRACER = None  # the next span takes a tracer of this provider


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def tracer() -> trace.Tracer:
    # Cached: the SDK builds a new tracer (and instrumentation scope) on every get_tracer call,
    # about a millisecond each on this machine, and every message sent or handled opens a span.
    global _TRACER
    if _TRACER is None:
        _TRACER = trace.get_tracer("rlbus")
    return _TRACER


def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Write the current trace context into NATS headers (returns the dict)."""
    headers = dict(headers or {})
    propagate.inject(headers)
    return headers


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    return propagate.extract(dict(headers or {}))


@contextmanager
def send_span(subject: str, *, msg_id: str = "", **attrs: Any) -> Iterator[trace.Span]:
    with tracer().start_as_current_span(f"send {subject}", kind=SpanKind.PRODUCER) as span:
        span.set_attribute("messaging.system", "nats")
        span.set_attribute("messaging.destination.name", subject)
        span.set_attribute("messaging.operation.type", "send")
        if msg_id:
            span.set_attribute("messaging.message.id", msg_id)
        for k, v in attrs.items():
            span.set_attribute(k, v)
        yield span


@contextmanager
def process_span(subject: str, headers: Mapping[str, str] | None, *, msg_id: str = "", **attrs: Any) -> Iterator[trace.Span]:
    """A consumer span whose parent is the producer's context from the headers."""
    ctx = extract(headers)
    with tracer().start_as_current_span(f"process {subject}", context=ctx, kind=SpanKind.CONSUMER) as span:
        span.set_attribute("messaging.system", "nats")
        span.set_attribute("messaging.destination.name", subject)
        span.set_attribute("messaging.operation.type", "process")
        if msg_id:
            span.set_attribute("messaging.message.id", msg_id)
        for k, v in attrs.items():
            span.set_attribute(k, v)
        yield span
