"""Permission violations, made into errors that name the subject and the permission missing.

The server answers a publish or subscribe this user may not make with ``-ERR 'Permissions
Violation for Publish to "<subject>"'``; nats-py hands that only to the error callback (lower-cased)
and the request behind it then times out with no reason given.  ``Denials`` collects them from the
callback; ``Denials.guard`` runs a start-up declaration and fails it with ``PermissionDenied`` as
soon as a violation arrives meanwhile, so a misconfigured role stops at start-up with the subject
to grant instead of an opaque timeout.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from rlbus.bus.protocol import BusError

T = TypeVar("T")
_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "([^"]+)"', re.IGNORECASE)
# The client lower-cases the server's error line; these tokens of a JetStream subject are upper case.
_UPPER = {"$js", "api", "$o", "ack", "fc", "stream", "consumer", "direct", "get", "msg", "next", "info",
          "create", "update", "delete", "purge", "durable", "names", "list", "_inbox", "c", "m", "$kv"}


class PermissionDenied(BusError):
    """The server refused this connection's user a publish or a subscription."""

    def __init__(self, message: str, *, permission: str, subject: str) -> None:
        super().__init__(message)
        self.permission = permission
        self.subject = subject


@dataclass(frozen=True)
class Denial:
    permission: str  # "publish" or "subscribe"
    subject: str


def restore_case(subject: str, known: tuple[str, ...] = ()) -> str:
    """Undo the client's lower-casing as far as names are known: JetStream's own tokens are upper
    case, and ``known`` names (streams, runs, consumers) get their spelling back.  A token neither
    covers stays lower case."""
    spelled = {k.lower(): k for k in known}
    out = []
    for token in subject.split("."):
        if token in spelled:
            out.append(spelled[token])
        elif token in _UPPER and not out[-1:] == ["_INBOX"]:
            out.append(token.upper())
        else:
            out.append(token)
    return ".".join(out)


class Denials:
    """The permission violations one connection was told of (``note``) and a waiter for the next."""

    def __init__(self, known: tuple[str, ...] = ()) -> None:
        self.known = known
        self.seen: list[Denial] = []
        self._waiters: set[asyncio.Future[Denial]] = set()

    def note(self, exc: BaseException) -> Denial | None:
        """The denial ``exc`` reports (recorded), or None if it is another error."""
        m = _VIOLATION.search(str(exc))
        if m is None:
            return None
        permission = "publish" if m.group(1).lower() == "publish" else "subscribe"
        denial = Denial(permission, restore_case(m.group(2), self.known))
        self.seen.append(denial)
        del self.seen[:-100]
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(denial)
        return denial

    async def guard(self, op: Awaitable[T], what: str, *, user: str | None) -> T:
        """``op``, or ``PermissionDenied`` as soon as a violation arrives while it runs.  The server does
        not say which request it refused, so operations running at once all fail with the one
        subject it named (``what`` says what each was doing, not that it caused the refusal)."""
        denied: asyncio.Future[Denial] = asyncio.get_running_loop().create_future()
        self._waiters.add(denied)
        work = asyncio.ensure_future(op)
        either: list[asyncio.Future[Any]] = [work, denied]
        try:
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._waiters.discard(denied)
        if work.done():
            return work.result()
        work.cancel()
        try:
            await work
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the denial is the error to report
            pass
        d = denied.result()
        who = f"user {user!r}" if user else "this connection's user"
        raise PermissionDenied(
            f"the NATS server denied {who} permission to {d.permission} {d.subject!r} while {what}; grant it in "
            "the server's auth config (regenerate it with `rlbus auth init` for this run's names) or connect as the "
            "role that owns this work", permission=d.permission, subject=d.subject)
