"""A nak carries its error: a task naked again and again until ``max_deliver`` runs out is
dead-lettered naming the last thing that failed, not only "delivered 5 times without an ack"
(found by fuzzing: the generator's nak path for sampling and environment failures lost it)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from rlbus.bus.memory import MemoryBus
from rlbus.bus.protocol import ConsumerSpec, Delivery
from rlbus.schemas import EnvReplyBatch
from rlbus.services.generator.batch import BatchDriver
from rlbus.services.generator.intake import TASK_MAX_DELIVER
from tests.unit.test_generator_intake import Harness, eventually


async def test_a_naked_message_dead_lettered_by_max_deliveries_names_the_last_error() -> None:
    bus = MemoryBus("r")
    spec = ConsumerSpec(stream="TASKS", durable="d", filter_subjects=(bus.subjects.tasks("p"),), max_deliver=3)
    seen: list[int] = []

    async def handler(msg: bytes, d: Delivery[bytes]) -> None:
        seen.append(d.deliveries)
        await d.nak(0.0, error=f"the backend failed on delivery {d.deliveries}")

    await bus.publish(bus.subjects.tasks("p"), b"task", msg_id="t1")
    task = asyncio.create_task(bus.consume(spec, bytes, handler, batch=1))
    try:
        await eventually(lambda: len(bus.dead_letters) == 1, what="the dead letter")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    [letter] = bus.dead_letters
    assert seen == [1, 2, 3]
    assert letter.reason == "max_deliveries" and letter.error == "the backend failed on delivery 3"


async def test_tasks_naked_for_an_environment_failure_are_dead_lettered_with_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BatchDriver, "ENV_RETRY_S", 0.01)

    async def refusing_env(data: bytes) -> bytes:
        return EnvReplyBatch(replies=[], error="verifier pool exhausted").encode()

    async with Harness(tmp_path, env=False) as h:
        await h.bus.serve(h.s.env_any("reset_batch"), refusing_env, queue="environment")
        await h.tasks("train", 2, prefix="t")
        await h.admit(2 * TASK_MAX_DELIVER)
        await eventually(lambda: len(h.bus.dead_letters) == 2, timeout=30.0, what="both tasks dead-lettered")
        letters: list[Any] = h.bus.dead_letters
    for letter in letters:
        assert letter.reason == "max_deliveries" and letter.deliveries == TASK_MAX_DELIVER
        assert "environment 'addition' unavailable: verifier pool exhausted" in letter.error, letter.error
