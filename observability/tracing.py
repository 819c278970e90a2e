"""OpenTelemetry set-up and trace propagation over NATS headers: one trace per task.

The provider is configured by the standard ``OTEL_*`` variables (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_SERVICE_NAME``, ``OTEL_TRACES_SAMPLER`` …) and exports OTLP, which Jaeger ingests.
With no endpoint configured, spans are created (so ids appear in logs) but not exported.

What opens a trace, and what only continues one:

- A task's publish opens its trace (``task_traces``: a root span ``task <task_id>``); the
  generator's work on it (``generate``, one ``environment <call>`` span per environment call,
  ``sample``), the environment's handling and the reward's scoring continue that trace across
  processes through the W3C ``traceparent`` header, so a rollout is one trace, found by its
  ``rlbus.task_id``.
- A trainer step is a trace of its own (``root_span``) with a span link to each group it trained
  (the link carries the scored message's trace context); a weight upload is a short trace too.
- The bus's ``send <subject>`` / ``process <subject>`` spans only *continue* a trace: a publish
  with no span current, or a delivery whose headers carry no ``traceparent``, opens nothing.
  Heartbeats, control decisions and status traffic therefore make no spans at all (opening a
  trace per message would make a thousand or more one-span traces of them in a 60-second run:
  docs/measurements/trace-spans-cpu2-2026-12-05.md).
- A request that serves many tasks at once (the generator's batched environment reset) carries
  the trace context of each task in ``Rlbus-Item-Traces`` (``item_traces``), so the server can
  give each task's trace its own span (``item_contexts``).

Attribute names are the constants below, used by every service.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import (
    CarrierT,
    Getter,
    Setter,
    TextMapPropagator,
    default_getter,
    default_setter,
)
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROVIDER_SET = False
_TRACER: trace.Tracer | None = None
# W3C trace context is two short headers; we budget this much under max_payload for headers.
TRACE_HEADER_BUDGET = 512

# --- attribute names (one place, so a Jaeger search means the same everywhere) ---------------
RUN = "rlbus.run"
TASK_ID = "rlbus.task_id"
POOL = "rlbus.pool"
ENV = "rlbus.env"
GROUP_SIZE = "rlbus.group_size"
ROLLOUT_COUNT = "rlbus.rollout_count"
ROLLOUT_IDS = "rlbus.rollout_ids"
POLICY_VERSION = "rlbus.policy_version"  # the version a step made, or a manifest carries
POLICY_VERSIONS = "rlbus.policy_versions"  # every version that produced tokens of a group
PROMPT_TOKENS = "rlbus.tokens.prompt"  # per group: prompt length (each rollout shares it)
COMPLETION_TOKENS = "rlbus.tokens.completion"  # per group: sum over its rollouts
REWARD_MEAN = "rlbus.reward.mean"
REWARDS = "rlbus.rewards"
STALENESS_MAX = "rlbus.staleness.max"
STALENESS_MEAN = "rlbus.staleness.mean"
STEP = "rlbus.trainer.step"
GROUPS = "rlbus.groups"
GENERATOR_ID = "rlbus.generator_id"
DELIVERIES = "rlbus.deliveries"  # which delivery of its task this is (a redelivery stays in the trace)
EVAL = "rlbus.eval"  # a held-out task
BATCH_GROUPS = "rlbus.batch_groups"  # groups sampled together in one backend call
OUTCOME = "rlbus.outcome"  # what became of a task at a hop: published, handed_back, refused …
ERROR = "rlbus.error"

ITEM_TRACES_HEADER = "Rlbus-Item-Traces"
_ITEM_TRACES_KEY = otel_context.create_key("rlbus-item-traces")


class _ItemTraces(TextMapPropagator):
    """Carries the per-item ``traceparent``s of a batched request (space-separated, in item order)."""

    def inject(self, carrier: CarrierT, context: otel_context.Context | None = None,
               setter: Setter[CarrierT] = default_setter) -> None:
        items = otel_context.get_value(_ITEM_TRACES_KEY, context)
        if items:
            setter.set(carrier, ITEM_TRACES_HEADER, " ".join(items))  # type: ignore[arg-type]

    def extract(self, carrier: CarrierT, context: otel_context.Context | None = None,
                getter: Getter[CarrierT] = default_getter) -> otel_context.Context:
        values = getter.get(carrier, ITEM_TRACES_HEADER)
        ctx = context if context is not None else otel_context.Context()
        if not values:
            return ctx
        return otel_context.set_value(_ITEM_TRACES_KEY, tuple(values[0].split()), ctx)

    @property
    def fields(self) -> set[str]:
        return {ITEM_TRACES_HEADER}


_TRACECONTEXT = TraceContextTextMapPropagator()
# Our own propagator, not the global one: the bus must carry the same headers whether or not a
# process configured tracing (handler tests run on MemoryBus without a provider).
_PROPAGATOR = CompositePropagator([_TRACECONTEXT, _ItemTraces()])


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
        RUN: run,
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
    """Flush the spans still batched for export (a process that exits without this loses them)."""
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


# --- propagation ------------------------------------------------------------------------------
def inject(headers: Mapping[str, str] | None = None, *, span: trace.Span | None = None) -> dict[str, str]:
    """The headers plus the trace context of ``span`` (default: the current context).  A
    ``traceparent`` the caller already put in ``headers`` is kept: it names the item's own trace."""
    out = dict(headers or {})
    if "traceparent" in out:
        return out
    ctx = trace.set_span_in_context(span) if span is not None else None
    _PROPAGATOR.inject(out, context=ctx)
    return out


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    return _PROPAGATOR.extract(dict(headers or {}))


def traceparent(span: trace.Span) -> str:
    sc = span.get_span_context()
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def _valid(ctx: otel_context.Context | None) -> bool:
    return trace.get_current_span(ctx).get_span_context().is_valid


@contextmanager
def item_traces(spans: Sequence[trace.Span]) -> Iterator[None]:
    """While inside, a request sent on the bus carries the trace of each of its items (``spans``,
    in the request's item order) for the server's ``item_contexts``."""
    if not any(s.get_span_context().is_valid for s in spans):  # tasks published without a trace
        yield
        return
    token = otel_context.attach(otel_context.set_value(_ITEM_TRACES_KEY, tuple(traceparent(s) for s in spans)))
    try:
        yield
    finally:
        otel_context.detach(token)


def item_contexts(n: int) -> list[otel_context.Context | None]:
    """The trace context of each of the ``n`` items of the request being served (None for an item
    whose trace the requester did not send)."""
    items = otel_context.get_value(_ITEM_TRACES_KEY) or ()
    if len(items) != n:  # type: ignore[arg-type]
        return [None] * n
    return [_TRACECONTEXT.extract({"traceparent": tp}) for tp in items]  # type: ignore[union-attr]


# --- spans ------------------------------------------------------------------------------------
def _set(span: trace.Span, attrs: Mapping[str, Any]) -> None:
    for k, v in attrs.items():
        span.set_attribute(k, v)


@contextmanager
def send_span(subject: str, *, msg_id: str = "", **attrs: Any) -> Iterator[trace.Span]:
    """A producer span, only inside a trace: a publish with no span current opens nothing."""
    if not _valid(None):
        yield trace.INVALID_SPAN
        return
    with tracer().start_as_current_span(f"send {subject}", kind=SpanKind.PRODUCER) as span:
        span.set_attribute("messaging.system", "nats")
        span.set_attribute("messaging.destination.name", subject)
        span.set_attribute("messaging.operation.type", "send")
        if msg_id:
            span.set_attribute("messaging.message.id", msg_id)
        _set(span, attrs)
        yield span


@contextmanager
def process_span(subject: str, headers: Mapping[str, str] | None, *, msg_id: str = "", **attrs: Any) -> Iterator[trace.Span]:
    """A consumer span whose parent is the producer's context from the headers; nothing is
    opened for a message that carries no trace context (periodic traffic)."""
    ctx = extract(headers)
    if not _valid(ctx):
        token = otel_context.attach(ctx)  # item traces of a batched request still reach the handler
        try:
            yield trace.INVALID_SPAN
        finally:
            otel_context.detach(token)
        return
    with tracer().start_as_current_span(f"process {subject}", context=ctx, kind=SpanKind.CONSUMER) as span:
        span.set_attribute("messaging.system", "nats")
        span.set_attribute("messaging.destination.name", subject)
        span.set_attribute("messaging.operation.type", "process")
        if msg_id:
            span.set_attribute("messaging.message.id", msg_id)
        _set(span, attrs)
        yield span


@contextmanager
def root_span(name: str, *, links: Sequence[tuple[Mapping[str, str] | None, Mapping[str, Any]]] = (),
              **attrs: Any) -> Iterator[trace.Span]:
    """A span that starts a trace of its own whatever is current, linked to the trace context in
    each ``(headers, link attributes)`` of ``links`` (a trainer step to the groups it trained)."""
    span_links = []
    for headers, link_attrs in links:
        sc = trace.get_current_span(extract(headers)).get_span_context()
        if sc.is_valid:
            span_links.append(Link(sc, attributes=dict(link_attrs)))
    with tracer().start_as_current_span(name, context=otel_context.Context(), links=span_links) as span:
        _set(span, attrs)
        yield span


def annotate(**attrs: Any) -> None:
    """Attributes on the current span (a no-op outside a trace)."""
    _set(trace.get_current_span(), attrs)


@contextmanager
def untraced() -> Iterator[None]:
    """No trace is current inside: for periodic traffic sent from traced code (a heartbeat a
    trainer step sends), which must not join the trace nor open one."""
    token = otel_context.attach(otel_context.Context())
    try:
        yield
    finally:
        otel_context.detach(token)


@contextmanager
def child_span(name: str, **attrs: Any) -> Iterator[trace.Span]:
    """A span under the current one, made current while inside; nothing outside a trace."""
    if not _valid(None):
        yield trace.INVALID_SPAN
        return
    with tracer().start_as_current_span(name) as span:
        _set(span, attrs)
        yield span


def start_child(name: str, parent: otel_context.Context | trace.Span | None, **attrs: Any) -> trace.Span:
    """A span under ``parent`` (a context, a span, or None for no trace: a non-recording span), to
    be ended by the caller; for work that runs for many tasks at once, one such span per task."""
    ctx = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
    if not _valid(ctx):
        return trace.INVALID_SPAN
    span = tracer().start_span(name, context=ctx)
    _set(span, attrs)
    return span


class TaskLike(Protocol):
    run: str
    task_id: str
    pool: str
    env: str
    group_size: int


@contextmanager
def task_traces(tasks: Sequence[TaskLike]) -> Iterator[list[dict[str, str]]]:
    """Open each task's trace (root span ``task <task_id>``) around its publish: yields the
    headers each task's message must carry (``publish_many(..., item_headers=...)``)."""
    spans = [tracer().start_span(f"task {t.task_id}", context=otel_context.Context(), kind=SpanKind.PRODUCER,
                                 attributes={RUN: t.run, TASK_ID: t.task_id, POOL: t.pool, ENV: t.env,
                                             GROUP_SIZE: t.group_size})
             for t in tasks]
    try:
        yield [inject(span=s) for s in spans]
    finally:
        for s in spans:
            s.end()
