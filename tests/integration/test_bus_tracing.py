"""Trace context crosses the bus: the consumer's span belongs to the producer's trace; traffic
sent outside a trace opens none; a batch of tasks keeps one trace per task."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rlbus.bus.protocol import Delivery
from rlbus.observability import tracing
from rlbus.schemas import Task
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


@pytest.fixture(params=["jetstream", "memory"])
async def either_bus(request, bus):
    """The same promises on both buses (MemoryBus is what handler tests run on)."""
    if request.param == "jetstream":
        yield bus
        return
    from rlbus.bus.memory import MemoryBus

    mem = MemoryBus(bus.subjects.run)
    try:
        yield mem
    finally:
        await mem.close()


def _task(i: int) -> Task:
    return Task(run="r", task_id=f"t{i}", pool="math", env="addition", prompt=f"{i}+1=")


async def test_untraced_traffic_opens_no_span(either_bus, spans):
    """A publish outside any trace (a heartbeat) carries no trace context and makes no span, and
    handling it makes none either: periodic traffic must not flood the trace store."""
    s = either_bus.subjects
    before = len(spans.get_finished_spans())
    await either_bus.publish(s.tasks("math"), _task(1).encode(), msg_id="t1")
    seen: list[tuple[dict[str, str], bool]] = []

    async def handler(task: Task, d: Delivery[Task]) -> None:
        seen.append((dict(d.headers), trace.get_current_span().get_span_context().is_valid))

    async with consuming(either_bus, task_spec(either_bus), Task.decode, handler):
        await eventually(lambda: seen)
    assert "traceparent" not in seen[0][0] and not seen[0][1]
    assert len(spans.get_finished_spans()) == before


async def test_each_task_published_in_a_batch_has_its_own_trace(either_bus, spans):
    s = either_bus.subjects
    tasks = [_task(i) for i in range(3)]
    with tracing.task_traces(tasks) as headers:
        await either_bus.publish_many([(s.tasks("math"), t.encode(), t.msg_id) for t in tasks], item_headers=headers)
    roots = {sp.attributes[tracing.TASK_ID]: sp for sp in spans.get_finished_spans()
             if sp.name.startswith("task ") and sp.attributes.get(tracing.TASK_ID) in {t.task_id for t in tasks}}
    assert len({sp.context.trace_id for sp in roots.values()}) == 3 and all(sp.parent is None for sp in roots.values())
    seen: dict[str, int] = {}

    async def handler(task: Task, d: Delivery[Task]) -> None:
        seen[task.task_id] = trace.get_current_span().get_span_context().trace_id

    async with consuming(either_bus, task_spec(either_bus), Task.decode, handler):
        await eventually(lambda: len(seen) == 3)
    assert seen == {tid: sp.context.trace_id for tid, sp in roots.items()}


async def test_batched_request_carries_each_items_trace(either_bus, spans):
    """The server of a batched request can continue each item's own trace."""
    subject = either_bus.subjects.env("addition", "reset_batch")
    got: list[list[int]] = []

    async def handler(data: bytes) -> bytes:
        ctxs = tracing.item_contexts(int(data))
        got.append([trace.get_current_span(c).get_span_context().trace_id for c in ctxs if c is not None])
        return b"ok"

    await either_bus.serve(subject, handler, queue="environment")
    with tracing.task_traces([_task(i) for i in range(3)]) as headers:
        items = [tracing.start_child("environment call", tracing.extract(h)) for h in headers]
        with tracing.item_traces(items):
            assert await either_bus.request(subject, b"3", timeout=5.0) == b"ok"
        for sp in items:
            sp.end()
    assert got == [[sp.get_span_context().trace_id for sp in items]]
    assert len(set(got[0])) == 3
