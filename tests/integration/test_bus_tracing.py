"""Trace context crosses the bus: the consumer's span belongs to the producer's trace."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bus.protocol import Delivery
from schemas import Task
from tests.integration.helpers import consuming, eventually, task_spec

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # the global provider can be set once per process
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


async def test_consumer_span_has_the_producers_trace_id(bus, spans):
    s = bus.subjects
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("feeder step") as parent:
        trace_id = parent.get_span_context().trace_id
        await bus.publish(s.tasks("math"), Task(run="r", task_id="t1", pool="math", env="addition",
                                                prompt="1+1=").encode(), msg_id="t1")
    seen: list[tuple[int, str]] = []

    async def handler(task: Task, d: Delivery[Task]) -> None:
        seen.append((trace.get_current_span().get_span_context().trace_id, d.headers.get("traceparent", "")))

    async with consuming(bus, task_spec(bus), Task.decode, handler):
        await eventually(lambda: seen)
    assert seen[0][0] == trace_id
    assert format(trace_id, "032x") in seen[0][1]
    by_name = {sp.name: sp for sp in spans.get_finished_spans() if sp.context.trace_id == trace_id}
    send, process = by_name[f"send {s.tasks('math')}"], by_name[f"process {s.tasks('math')}"]
    assert process.parent is not None and process.parent.span_id == send.context.span_id
    assert send.attributes["messaging.message.id"] == "t1"


async def test_request_reply_carries_trace_context(bus, spans):
    subject = bus.subjects.env("addition", "reset")
    seen: list[int] = []

    async def handler(data: bytes) -> bytes:
        seen.append(trace.get_current_span().get_span_context().trace_id)
        return data

    await bus.serve(subject, handler, queue="environment")
    with trace.get_tracer("test").start_as_current_span("generator step") as parent:
        assert await bus.request(subject, b"ping", timeout=2.0) == b"ping"
    assert seen == [parent.get_span_context().trace_id]
