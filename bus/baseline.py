"""The raw nats-py baseline that ``bench/bus_bench.py`` measures the bus against.

It lives in ``bus/`` because only ``bus/`` imports nats.  Nothing here is used by services: it
is stock nats-py doing the same work the bus does, the way a user of the plain client would —

- ``RawClient.rollouts``: a work-queue stream of its own, ``publish_async`` of ``n`` payloads,
  then a durable ``pull_subscribe`` with ``fetch(batch)``, decode and ``ack`` of each message;
- ``RawClient.stock_get``/``stock_get_into``: nats-py's own ``ObjectStore.get`` of an object
  the bus wrote (plain, and with ``writeinto``), against the bus's reader.

Keep it plain: a faster baseline here is a slower-looking bus, and the other way round.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Callable
from typing import Any

import nats
from nats.js import api

MiB = 1024 * 1024


class RawClient:
    """One plain nats-py connection and its JetStream context."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.js = nc.jetstream()

    @classmethod
    async def connect(cls, url: str, *, pending_size: int = 64 * MiB, quiet: bool = False) -> RawClient:
        """``quiet``: swallow async errors (stock object-store reads can trip slow-consumer notices)."""
        options: dict[str, Any] = {"pending_size": pending_size}
        if quiet:
            async def ignore(exc: Exception) -> None:
                pass

            options["error_cb"] = ignore
        return cls(await nats.connect(url, **options))

    async def close(self) -> None:
        await self.nc.close()

    async def rollouts(self, payload: bytes, n: int, batch: int, tag: str,
                       decode: Callable[[bytes], Any]) -> dict[str, float]:
        """msgs/s of publishing ``n`` copies of ``payload`` and of consuming them (decode + ack)."""
        stream = f"RAWBENCH_{tag}"
        subject = f"rawbench.{tag}"
        await self.js.add_stream(name=stream, subjects=[subject], retention=api.RetentionPolicy.WORK_QUEUE,
                                 duplicate_window=600.0)
        t0 = time.perf_counter()
        futs = [await self.js.publish_async(subject, payload) for _ in range(n)]
        await asyncio.gather(*futs)
        t_pub = time.perf_counter() - t0

        sub = await self.js.pull_subscribe(subject, durable=f"raw_{tag}", stream=stream,
                                           config=api.ConsumerConfig(ack_wait=60, max_ack_pending=max(4 * batch, 1000)))
        t0 = time.perf_counter()
        count = 0
        while count < n:
            msgs = await sub.fetch(batch, timeout=5)
            for m in msgs:
                decode(m.data)
                await m.ack()
                count += 1
        t_con = time.perf_counter() - t0
        await self.js.delete_stream(stream)
        return {"publish_msgs_s": n / t_pub, "consume_msgs_s": n / t_con}

    async def stock_get(self, bucket: str, name: str) -> None:
        store = await self.js.object_store(bucket)
        await store.get(name)

    async def stock_get_into(self, bucket: str, name: str) -> None:
        store = await self.js.object_store(bucket)
        await store.get(name, writeinto=io.BytesIO())
