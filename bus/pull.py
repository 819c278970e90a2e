"""Pull requests to a JetStream consumer, answered on one inbox of our own.

nats-py's ``fetch`` cannot cap a pull by bytes, and it sends a no-wait probe plus a second
lingering request on every call.  We need both a byte cap (batch x 8 MiB messages must stay far
below the server's per-client ``max_pending`` or the server drops us as a slow consumer) and
*continuous* pulls (a consume loop keeps one request open and handles messages as they arrive,
instead of waiting for a batch to fill).  The wire protocol is small: publish
``{"batch", "max_bytes", "expires", "no_wait"}`` to ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>``
with a reply inbox; messages arrive on that inbox with their own subjects and a ``$JS.ACK`` reply;
a request ends with a status message on its own reply subject (404 no messages, 408 expired with
``Nats-Pending-Messages``, 409 terminal conditions) or silently once its batch is full.
Each request gets its own reply subject ``<inbox>.<n>`` so a late status of an old request is
never mistaken for the end of the current one.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg
from nats.errors import OutboundBufferLimitError

# Client-side buffer for one inbox; the byte cap on each pull keeps us far below it.
_SUB_PENDING_BYTES = 1024 * 1024 * 1024
_SUB_PENDING_MSGS = 1 << 20


@dataclass
class PullStatus:
    request: int
    code: str
    description: str
    pending_msgs: int


class PullInbox:
    """One consumer's pull requests and the messages they bring, buffered in arrival order."""

    def __init__(self, nc: Any, api_prefix: str, stream: str, consumer: str, *,
                 on_message: Callable[[Msg], None] | None = None,
                 on_leftover: Callable[[Msg], None] | None = None) -> None:
        self._nc = nc
        # Told of every message as it lands in the buffer (a consumer's heartbeat starts there).
        self._on_message = on_message
        # Told, besides, of a message that lands while no ``fetch`` runs: the answer to a request a
        # fetch gave up on (sent before a disconnect and answered after it).  A puller whose caller
        # stops fetching (a generator without grant) would otherwise hold it, heartbeated, forever.
        self._on_leftover = on_leftover
        self._fetching = False
        self.stream = stream
        self.consumer = consumer
        self._next_subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._inbox = nc.new_inbox()
        self._sub: Any = None
        self._seq = 0
        self.buffer: deque[Msg] = deque()
        self.statuses: dict[int, PullStatus] = {}
        self._changed = asyncio.Event()
        self.received = 0

    async def start(self) -> PullInbox:
        if self._sub is None:
            self._sub = await self._nc.subscribe(
                f"{self._inbox}.*", cb=self._on_msg,
                pending_msgs_limit=_SUB_PENDING_MSGS, pending_bytes_limit=_SUB_PENDING_BYTES,
            )
        return self

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection already closed: nothing left to undo
                pass
        self._changed.set()

    async def _on_msg(self, msg: Msg) -> None:
        hdrs = msg.headers
        if not msg.reply and hdrs and "Status" in hdrs:
            code = hdrs["Status"]
            if code != "100":  # idle heartbeat: proof of life only
                try:
                    req = int(msg.subject.rsplit(".", 1)[1])
                except ValueError:
                    req = -1
                self.statuses[req] = PullStatus(
                    req, code, hdrs.get("Description", ""), int(hdrs.get("Nats-Pending-Messages", "0") or 0)
                )
        else:
            self.buffer.append(msg)
            self.received += 1
            if self._on_message is not None:
                self._on_message(msg)
            if self._on_leftover is not None and not self._fetching:
                self._on_leftover(msg)
        self._changed.set()

    def take_back(self, msg: Msg) -> bool:
        """Remove ``msg`` from the buffer; False when a fetch took it already."""
        try:
            self.buffer.remove(msg)
        except ValueError:
            return False
        return True

    async def request(self, batch: int, *, expires: float | None, max_bytes: int = 0,
                      no_wait: bool = False) -> int:
        """Send one pull request; returns its id (for ``statuses``)."""
        self._seq += 1
        req: dict[str, Any] = {"batch": int(batch)}
        if expires:
            req["expires"] = max(int(expires * 1e9), 1_000_000)
        if max_bytes:
            req["max_bytes"] = int(max_bytes)
        if no_wait:
            req["no_wait"] = True
        try:
            await self._nc.publish(self._next_subject, json.dumps(req).encode(), reply=f"{self._inbox}.{self._seq}")
        except OutboundBufferLimitError:
            # Disconnected with the client's buffer full: this request is lost, as one sent just
            # before a disconnect would be; callers ask again once it should have been answered.
            pass
        return self._seq

    async def wait(self, timeout: float) -> None:
        """Wait until something arrives (a message or a status) or ``timeout`` passes."""
        self._changed.clear()
        if self.buffer:
            return
        await self._wait_changed(timeout)

    async def wait_any(self, timeout: float) -> None:
        """Wait for the next arrival (message or status), even if messages are already buffered."""
        self._changed.clear()
        await self._wait_changed(timeout)

    async def _wait_changed(self, timeout: float) -> None:
        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
        # lands as the event fires, and a consume loop that misses its cancel never stops.
        try:
            async with asyncio.timeout(timeout):
                await self._changed.wait()
        except TimeoutError:
            pass

    def status_of(self, request: int) -> PullStatus | None:
        return self.statuses.pop(request, None)

    def forget_statuses_before(self, request: int) -> None:
        for k in [k for k in self.statuses if k < request]:
            del self.statuses[k]

    async def fetch(self, batch: int, timeout: float, *, max_bytes: int = 0) -> list[Msg]:
        """Up to ``batch`` messages: what is available now, else wait up to ``timeout`` for a batch.

        A no-wait request first returns immediately with whatever is there; only when there is
        nothing does a lingering request wait, and it is waited out (full batch or the server's
        expiry status) so no request is left open to deliver messages nobody is waiting for.
        While the client is disconnected no request is sent (it would wait in the client's buffer
        and reach the server long after this fetch returned): what is buffered is returned."""
        self._fetching = True
        try:
            return await self._fetch(batch, timeout, max_bytes)
        finally:
            self._fetching = False

    async def _fetch(self, batch: int, timeout: float, max_bytes: int) -> list[Msg]:
        out: list[Msg] = []
        while self.buffer and len(out) < batch:  # leftovers of an earlier, timed-out wait
            out.append(self.buffer.popleft())
        if len(out) >= batch:
            return out
        if not out and not self._nc.is_connected:
            # Wait as a pull that found nothing would, from a cleared event: one left set by a
            # status or message after the last fetch would return at once without yielding, and
            # a caller fetching in a loop would starve the client's reconnect for good.
            await self.wait(timeout)
            return [self.buffer.popleft() for _ in range(min(batch, len(self.buffer)))]
        loop = asyncio.get_running_loop()
        for linger in (False, True):
            if (linger and (out or timeout <= 0)) or not self._nc.is_connected:
                break
            want = batch - len(out)
            expires = None if not linger else max(timeout - 0.002, 0.001)
            req = await self.request(want, expires=expires, max_bytes=max_bytes, no_wait=not linger)
            self.forget_statuses_before(req)
            deadline = loop.time() + (timeout + 1.0 if linger else 5.0)
            got = 0
            while True:
                while self.buffer and got < want:
                    out.append(self.buffer.popleft())
                    got += 1
                if got >= want:
                    break
                st = self.status_of(req)
                if st is not None:
                    # Messages of this request all precede its status; take any still buffered.
                    while self.buffer and got < want:
                        out.append(self.buffer.popleft())
                        got += 1
                    break
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break  # the server went away; what it still sends lands in the buffer
                await self.wait(remaining)
        return out
