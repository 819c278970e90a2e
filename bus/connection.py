"""``Connection``: one NATS connection of a ``JetStreamBus`` and everything its parts share.

``JetStreamBus`` is the service-facing ``Bus``; its parts — the consume loop (``rlbus.bus.consume``),
pullers (``rlbus.bus.puller``), watches (``rlbus.bus.watch``) — work through the public methods of this one
object and never reach into the bus.  It owns:

- the nats client (``nc``), its JetStream context (``js``) and API prefix, the run's ``Subjects``,
  the run's object store and the claim check on it, the publisher, the logger;
- the open/closed state and the background tasks (``spawn``), cancelled or finished on close;
- consumer declaration (``ensure_consumer``, once per durable; changed tunables are updated in
  place, ``rlbus.bus.streams``), and with each one the follower of that durable's captured
  max-deliveries advisories (``rlbus.bus.advisories``);
- the last handler error per stored message (``note_error``), so the max-deliveries dead letter
  says what went wrong, and the retry backoff of failed handlers.

Max deliveries: a message that exhausts ``max_deliver`` stays in its stream and the server emits
an advisory, which the run's ADVISORIES stream keeps until a connection acts on it — even one that
connects later (``rlbus.bus.advisories``).  ``dead_letter_stored`` copies the message byte for byte to
DEAD with reason ``max_deliveries`` and the last handler error seen, then deletes it from a
work-queue stream — so it is neither lost nor stuck.

Server outages: the client reconnects forever (``max_reconnect_attempts=-1``); publishes wait
for the reconnect under a long outage deadline (``rlbus.bus.publish``); consume loops, pullers and
watches resume on the new connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import nats
import nats.errors
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import NotFoundError

from rlbus.bus.advisories import MaxDeliveries
from rlbus.bus.claims import CLAIM_HEADER, CLOCK_SLACK_S, ClaimCheck, ClaimCollector
from rlbus.bus.credentials import Credentials, CredentialsError, inbox_prefix
from rlbus.bus.deadletter import build_dead_letter, dead_letter_id, never_acked
from rlbus.bus.objects import JetStreamObjectStore
from rlbus.bus.outage import api_errors, through_outage
from rlbus.bus.permissions import Denials
from rlbus.bus.protocol import BusClosed, BusError, ClaimsCollected, ConsumerSpec, StreamFull
from rlbus.bus.publish import Publisher
from rlbus.bus.pull import PullInbox
from rlbus.bus.retention import Retention
from rlbus.bus.routing import WORK_QUEUES, stream_kind_of
from rlbus.bus.streams import PlacementWait, ensure_consumer, ensure_streams, limit_key
from rlbus.bus.subjects import STREAM_KINDS, Subjects
from rlbus.bus.urls import BadServerURL, redact_url, server_urls, url_has_userinfo, url_user
from rlbus.observability.logging import get_logger

T = TypeVar("T")

KiB, MiB = 1024, 1024 * 1024
CLAIM_HEADROOM = 512 * KiB
DEFAULT_PUBLISH_OUTAGE_S = 900.0  # see rlbus.bus.publish: how long a publish waits out a server outage
LAST_ERRORS_KEPT = 10_000  # only needed until the advisory arrives
DECLARE_ATTEMPT_S = 2.0  # one try of a stream or durable declaration (see ``Connection.js_declare``)

_DELIVER = {
    "new": api.DeliverPolicy.NEW,
    "last_per_subject": api.DeliverPolicy.LAST_PER_SUBJECT,
    "all": api.DeliverPolicy.ALL,
}


class _Events:
    """nats-py's callbacks for one connection: quiet about our own close, and one log line per
    100 failed reconnect attempts (they come four a second while the server is away).

    Two server refusals are made loud, because nats-py only reports them to this callback and the
    request that caused them then times out with no reason given: a refused login (``refused``,
    which ``Connection.open`` waits on beside the connect) and a permission violation
    (``denials``, which ``Connection.startup`` waits on beside the start-up declarations)."""

    def __init__(self, log: Any, url: str) -> None:
        self.log = log
        self.url = redact_url(url)
        self.conn: Connection | None = None
        self.errors = 0  # since the last (re)connect
        self.refused = asyncio.Event()
        self.denials = Denials()

    def _ours(self) -> bool:
        return self.conn is not None and self.conn.closed

    async def on_error(self, exc: Exception) -> None:
        if self._ours():
            return
        # During the first connect nats-py reports a refused login as a plain Error with this text.
        if isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in str(exc).lower():
            self.refused.set()
        denial = self.denials.note(exc)
        if denial is not None:
            self.log.error("nats_permission_denied", permission=denial.permission, subject=denial.subject,
                           todo="grant it to this connection's user in the server's auth config (rlbus auth init)")
            return
        self.errors += 1
        if self.errors == 1 or self.errors % 100 == 0:
            self.log.warning("nats_error", error=repr(exc), errors_since_connected=self.errors)

    async def on_disconnect(self) -> None:
        if not self._ours():
            self.log.warning("nats_disconnected", url=self.url)

    async def on_reconnect(self) -> None:
        self.log.info("nats_reconnected", url=self.url, errors_while_away=self.errors)
        self.errors = 0

    async def on_closed(self) -> None:
        # With unlimited reconnects only a fatal protocol error (e.g. an over-size payload)
        # closes the client for good; every later call then raises BusClosed.
        if self.conn is not None and not self.conn._closing:
            self.log.error("nats_connection_closed", url=self.url, todo="the bus is closed for good; restart the service")


async def _connect_outcome(nc: Any, connecting: asyncio.Future[Any], events: _Events,
                           timeout: float) -> BaseException | None:
    """None once ``connecting`` succeeded; else why not: the server refused the login (at once, not
    after ``timeout``: nats-py would retry a refused login forever), the timeout, or the error."""
    refused = asyncio.ensure_future(events.refused.wait())
    try:
        await asyncio.wait([connecting, refused], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        refused.cancel()
    if events.refused.is_set() and not nc.is_connected:
        return PermissionError("login refused")
    if not connecting.done():
        return TimeoutError()
    return connecting.exception()


class Connection:
    """What a ``JetStreamBus`` and its consume loops, pullers and watches share."""

    def __init__(self, nc: Any, run: str, *, name: str, claim_threshold: int | None = None,
                 publish_deadline: float = 30.0, publish_outage: float = DEFAULT_PUBLISH_OUTAGE_S,
                 attempt_timeout: float = 5.0, error_backoff: tuple[float, float] = (1.0, 30.0),
                 shutdown_grace: float = 10.0, serve_concurrency: int = 64,
                 retention: Retention | None = None) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=10.0)
        # Declarations (idempotent, retried) ask with a short timeout: JetStream drops, rather than
        # queues, what reaches it before a fresh cluster has elected its meta leader (measured: 0.7 s
        # after the servers were up), so a 10 s attempt made every service of a start-up wait 10 s.
        self.js_declare = nc.jetstream(timeout=DECLARE_ATTEMPT_S)
        self.api_prefix = "$JS.API"
        self.subjects = Subjects(run)
        self.name = name
        self.log = get_logger(component="bus", bus=name, run=run)
        self.max_payload = int(nc.max_payload)
        default_threshold = max(self.max_payload - CLAIM_HEADROOM, self.max_payload // 2)
        self.claim_threshold = min(claim_threshold or default_threshold, default_threshold)
        self.error_backoff = error_backoff
        self.shutdown_grace = shutdown_grace
        self.serve_concurrency = serve_concurrency
        # Each pull is capped by bytes: a few of the largest messages, far below max_pending.
        self.pull_max_bytes = max(4 * self.max_payload, 32 * MiB)
        # None: limits are not this connection's to set (a CLI tool); existing ones are kept.
        self.retention = retention
        self.objects = JetStreamObjectStore(
            nc, self.js, self.subjects.object_bucket,
            max_bytes=retention.objects_max_bytes if retention is not None else None,
            replicas=retention.replicas if retention is not None else None,
            full_error=self.full_error, deadline=publish_deadline, outage=publish_outage)
        self.claims = ClaimCheck(self.objects, spawn=self.spawn, log=self.log)
        # Every service of a run publishes under the same [run] deadline and outage budget, so this
        # connection's own bound how long after its claim any message of the run is stored.
        self.claim_collector = ClaimCollector(
            self.objects, nc=nc, api_prefix=self.api_prefix, subjects=self.subjects,
            margin=publish_deadline + publish_outage + attempt_timeout + CLOCK_SLACK_S,
            deadline=publish_deadline, outage=publish_outage, log=self.log)
        self.publisher = Publisher(self.js, self.claims, name=name, max_payload=self.max_payload,
                                   claim_threshold=self.claim_threshold, deadline=publish_deadline,
                                   attempt_timeout=attempt_timeout, outage=publish_outage,
                                   connected=lambda: bool(nc.is_connected), full_error=self.full_error)
        self._closing = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self.max_deliveries: dict[tuple[str, str], MaxDeliveries] = {}  # by (stream kind, durable)
        self._consumers_ok: set[ConsumerSpec] = set()
        self._last_errors: dict[tuple[str, int], str] = {}
        self.denials = Denials()  # replaced by the one the connection's error callback feeds (``open``)
        self.user: str | None = None  # the NATS user logged in as, for error messages (set by ``open``)

    # --- open / state / close ------------------------------------------------------------
    @classmethod
    async def open(cls, url: str, run: str, *, name: str, connect_timeout: float = 10.0,
                   credentials: Credentials | None = None, **options: Any) -> Connection:
        """Connect (reconnecting forever after the first success) within ``connect_timeout``, as
        ``credentials`` (default: from the environment, ``Credentials.from_env``).  A login the
        server refuses fails at once with the key to check, not after the timeout."""
        try:
            servers = server_urls(url or "")
        except BadServerURL as exc:
            raise BusError(str(exc)) from None
        creds = credentials if credentials is not None else Credentials.from_env()
        login = creds.connect_options()
        user = creds.user or url_user(url)  # a user named in the URL gets its own inboxes too
        if user and not (creds.creds_file or creds.nkey_seed_file):
            login["inbox_prefix"] = inbox_prefix(user)
        events = _Events(get_logger(component="bus", bus=name, run=run), url)
        nc = nats.NATS()
        # Pings every 5 s, 3 unanswered = lost: a server that vanished without closing the socket
        # is noticed within ~20 s, inside a publish's deadline, so publishes wait it out as an outage.
        connecting = asyncio.ensure_future(nc.connect(
            servers=servers, name=name, allow_reconnect=True, max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,  # type: ignore[arg-type]  # nats-py takes float seconds
            connect_timeout=2, ping_interval=5, max_outstanding_pings=3,
            pending_size=64 * MiB, drain_timeout=10, error_cb=events.on_error,
            disconnected_cb=events.on_disconnect, reconnected_cb=events.on_reconnect,
            closed_cb=events.on_closed, **login,
        ))
        failure = await _connect_outcome(nc, connecting, events, connect_timeout)
        if failure is not None:
            connecting.cancel()
            try:
                await nc.close()
            except Exception:  # noqa: BLE001 - we are already reporting the real failure
                pass
            if events.refused.is_set():
                raise CredentialsError(
                    f"authorization violation: the NATS server at {redact_url(url)} refused the login of "
                    f"{name!r} ({creds.what_to_check(url_has_userinfo(url))})")
            if not isinstance(failure, (TimeoutError, OSError, nats.errors.Error)):
                raise failure
            raise BusError(
                f"cannot connect to NATS at {redact_url(url)} within {connect_timeout:.0f}s ({failure!r}); "
                "is the server running (`rlbus nats`) and the URL right?"
            ) from None
        conn = cls(nc, run, name=name, **options)
        events.denials.known = (run, *(conn.subjects.stream(k) for k in STREAM_KINDS), conn.subjects.advisory_stream,
                                conn.objects.stream, conn.subjects.object_bucket)
        conn.denials = events.denials
        conn.user = user
        events.conn = conn
        return conn

    async def startup(self, op: Awaitable[T], what: str) -> T:
        """``op`` (a declaration: streams, a durable, a watch, a last-message read — what a service
        does as it starts), failing at once with ``PermissionDenied`` naming the subject if the
        server refuses this user a permission meanwhile, instead of waiting out the request's
        timeout and the outage deadline behind it."""
        return await self.denials.guard(op, what, user=self.user)

    async def ensure_streams(self, *, deadline: float | None = None) -> None:
        """Declare the run's streams (idempotent), riding out a server that goes away meanwhile and
        a cluster that cannot answer yet, for ``deadline`` seconds of the server being reachable
        (``JetStreamBus.connect`` passes its ``connect_timeout``)."""
        placement = PlacementWait()
        what = f"declaring the streams of run {self.subjects.run!r}"
        await self.startup(self.through_outage(
            lambda: ensure_streams(self.js_declare, self.subjects, retention=self.retention, log=self.log,
                                   placement=placement),
            what, deadline=deadline), what)

    async def through_outage(self, op: Callable[[], Awaitable[T]], what: str, *, deadline: float | None = None) -> T:
        """Run the idempotent request ``op`` until the server answers, bounded like a publish (or by
        ``deadline`` s of the server being reachable, if longer): what a service must know before it
        can start (its streams, its durable, the newest weight version) waits out a server lost in
        the seconds after connecting instead of ending the service."""
        return await through_outage(op, what, connected=lambda: bool(self.nc.is_connected),
                                    deadline=max(deadline or 0.0, self.publisher.deadline),
                                    outage=self.publisher.outage)

    def full_error(self, subject_or_stream: str, why: str) -> StreamFull:
        """The ``StreamFull`` of a publish (or object put) refused at a discard-new limit."""
        if subject_or_stream.startswith("rl."):
            stream = self.subjects.stream(stream_kind_of(subject_or_stream))
        else:
            stream = subject_or_stream
        return StreamFull(stream, why, key=limit_key(self.subjects, stream, why))

    @property
    def closed(self) -> bool:
        """Closing or closed by us, or the connection lost for good."""
        return self._closing or self.nc.is_closed

    def check_open(self) -> None:
        if self.closed:
            raise BusClosed(f"bus {self.name!r} is closed")

    def begin_close(self) -> bool:
        """Mark the connection as closing; False if that had already happened."""
        if self._closing:
            return False
        self._closing = True
        return True

    async def close(self) -> None:
        """Stop background work and drain the connection (after ``begin_close``)."""
        self._closing = True
        for t in list(self._tasks):
            if t.get_name().startswith(("release-", "serve-")):
                continue  # short, and worth finishing
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5.0)
        if not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), timeout=10.0)
            except Exception:  # noqa: BLE001 - drain failed (server gone): close hard
                pass
            if not self.nc.is_closed:
                try:
                    await self.nc.close()
                except (ConnectionError, OSError) as exc:  # the socket died under the close: closed all the same
                    self.log.warning("close_failed", error=f"{type(exc).__name__}: {exc}"[:300])

    def spawn(self, coro: Awaitable[Any], *, name: str) -> asyncio.Task[Any]:
        """A background task that lives until it ends or the connection closes."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def backoff(self, deliveries: int) -> float:
        """Seconds before a failed handler's message is redelivered: doubling, capped."""
        base, cap = self.error_backoff
        return float(min(base * 2 ** max(deliveries - 1, 0), cap))

    # --- publish / claim check -------------------------------------------------------------
    async def publish(self, subject: str, data: bytes, *, msg_id: str, headers: dict[str, str] | None = None) -> None:
        self.check_open()
        await self.publisher.publish(subject, data, msg_id=msg_id, headers=headers)

    async def publish_many(self, items: Sequence[tuple[str, bytes, str]], *, headers: dict[str, str] | None = None,
                           item_headers: Sequence[dict[str, str]] | None = None) -> None:
        self.check_open()
        await self.publisher.publish_many(items, headers=headers, item_headers=item_headers)

    async def resolve(self, data: bytes, headers: dict[str, str]) -> tuple[bytes, dict[str, str], str | None]:
        """The original bytes of a possibly claim-checked message (see ``rlbus.bus.claims``)."""
        return await self.claims.resolve(data, headers)

    @staticmethod
    def claim_is_gone(exc: BaseException) -> bool:
        return ClaimCheck.is_gone(exc)

    def release_claim(self, name: str) -> None:
        self.claims.release(name)

    async def collect_claims(self, *, margin: float | None = None) -> ClaimsCollected:
        self.check_open()
        return await self.claim_collector.collect(margin=margin)

    # --- consumers -------------------------------------------------------------------------
    async def ensure_consumer(self, spec: ConsumerSpec) -> str:
        """Declare the durable (once per connection) and watch its max-deliveries advisory.
        Returns the stream name."""
        stream = self.subjects.stream(spec.stream)
        if spec not in self._consumers_ok:  # by spec: a changed spec is declared (updated) again
            replicas = self.retention.replicas if self.retention is not None else None
            what = f"declaring the durable {spec.durable!r} of {stream}"
            await self.startup(self.through_outage(
                lambda: ensure_consumer(self.js_declare, self.subjects, spec, log=self.log, replicas=replicas),
                what), what)
            self._consumers_ok.add(spec)
        key = (spec.stream, spec.durable)
        if key not in self.max_deliveries:
            self.max_deliveries[key] = MaxDeliveries(self, spec.stream, spec.durable)
        self.max_deliveries[key].start()
        return stream

    async def pull_inbox(self, stream: str, durable: str, *, on_message: Callable[[Msg], None] | None = None,
                         on_leftover: Callable[[Msg], None] | None = None) -> PullInbox:
        """A started inbox for pull requests to ``durable`` (declared with ``ensure_consumer``)."""
        inbox = PullInbox(self.nc, self.api_prefix, stream, durable, on_message=on_message, on_leftover=on_leftover)
        return await inbox.start()

    async def consumer_pending(self, stream: str, durable: str) -> int:
        info = await self.js.consumer_info(stream, durable)
        return int(info.num_pending or 0)

    async def subscribe_ordered(self, subject: str, *, stream: str, deliver: str,
                                cb: Callable[[Msg], Awaitable[None]]) -> Any:
        """An ordered, ephemeral, ack-none push consumer of ``subject`` (for watches)."""
        return await self.startup(self.js.subscribe(
            subject, stream=stream, ordered_consumer=True, deliver_policy=_DELIVER[deliver], cb=cb,
            pending_bytes_limit=512 * MiB,
        ), f"watching {subject!r}")

    async def last_msg(self, stream: str, subject: str, *, wait: bool = False) -> tuple[bytes, dict[str, str]] | None:
        """The newest stored message on ``subject`` (resolved), or None.  ``wait``: ride out an
        outage (``through_outage``) instead of raising ``ServerUnavailable`` at once."""
        what = f"reading the last message on {subject!r}"

        async def get() -> Any:
            try:
                with api_errors(what):
                    return await self.startup(self.js.get_last_msg(stream, subject, direct=True), what)
            except NotFoundError:
                return None

        raw = await (self.through_outage(get, what) if wait else get())
        if raw is None:
            return None
        data, headers, _ = await self.resolve(raw.data or b"", dict(raw.headers or {}))
        return data, headers

    # --- dead letters ----------------------------------------------------------------------
    def note_error(self, stream: str, seq: int, error: str) -> None:
        """Remember the last handler error of stored message ``seq`` for its dead letter."""
        self._last_errors[(stream, seq)] = error
        if len(self._last_errors) > LAST_ERRORS_KEPT:
            for k in list(self._last_errors)[:LAST_ERRORS_KEPT // 2]:
                del self._last_errors[k]

    async def dead_letter(self, origin_subject: str, data: bytes, *, error: str, reason: str, deliveries: int = 1,
                          headers: dict[str, str] | None = None, msg_id: str | None = None,
                          stream_seq: int = 0) -> None:
        """Record a bad message on DEAD (see ``rlbus.bus.deadletter``); large originals by claim check."""
        subject, letter, msg_id = build_dead_letter(
            self.subjects, origin_subject, data, error=error, reason=reason, deliveries=deliveries,
            headers=headers, service=self.name, msg_id=msg_id, stream_seq=stream_seq)
        self.log.warning("dead_letter", origin=origin_subject, reason=reason, error=error[:500], deliveries=deliveries)
        await self.publish(subject, letter.encode(), msg_id=msg_id)

    async def dead_letter_stored(self, stream: str, seq: int, deliveries: int) -> None:
        """Dead-letter stored message ``seq`` of ``stream`` (it exhausted max_deliver); raises if
        the dead letter could not be written, leaving the message where it is."""
        try:
            raw = await self.js.get_msg(stream, seq)
        except NotFoundError:
            return  # already handled (another replica, or acked at the last moment)
        headers = {k: v for k, v in (raw.headers or {}).items() if not k.startswith("Nats-") or k == "Nats-Msg-Id"}
        data = raw.data or b""
        claim = headers.get(CLAIM_HEADER)
        if claim:
            try:
                data, headers, _ = await self.resolve(data, headers)
            except BusError as exc:
                headers["Rlbus-Claim-Error"] = str(exc)[:200]
        error = self._last_errors.pop((stream, seq), never_acked(deliveries))
        await self.dead_letter(raw.subject, data, error=error, reason="max_deliveries", deliveries=deliveries,
                               headers=headers, msg_id=dead_letter_id(stream, seq), stream_seq=seq)
        if stream.rsplit("_", 1)[-1] in WORK_QUEUES:
            try:
                await self.js.delete_msg(stream, seq)
            except NotFoundError:
                pass
            if claim:
                self.release_claim(claim)
        self.log.warning("dead_lettered", stream=stream, seq=seq, reason="max_deliveries", error=error)

