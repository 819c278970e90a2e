"""On a real server: a message a handler naks with its error until ``max_deliver`` runs out is
dead-lettered (by the max-deliveries advisory) naming that error."""

from __future__ import annotations

import pytest

from rlbus.bus.protocol import ConsumerSpec, Delivery
from tests.integration.helpers import consuming, dead_letters

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


async def test_a_nak_with_an_error_names_it_in_the_max_deliveries_dead_letter(bus):
    s = bus.subjects
    spec = ConsumerSpec(stream="TASKS", durable="naker", filter_subjects=(s.tasks("p"),), max_deliver=2, ack_wait=30)
    seen: list[int] = []

    async def handler(msg: bytes, d: Delivery[bytes]) -> None:
        seen.append(d.deliveries)
        await d.nak(0.0, error=f"sampling failed on delivery {d.deliveries}: backend out of memory")

    await bus.publish(s.tasks("p"), b"task", msg_id="t1")
    async with consuming(bus, spec, bytes, handler, batch=1):
        [letter] = await dead_letters(bus, 1, timeout=30)
    assert seen == [1, 2]
    assert letter.reason == "max_deliveries" and letter.deliveries == 2
    assert letter.error == "sampling failed on delivery 2: backend out of memory"
