"""Stream and consumer declarations of one run, as code.

| stream     | subjects                  | retention  | limits (``rlbus.bus.retention``)    | notes                                  |
|------------|---------------------------|------------|-------------------------------|----------------------------------------|
| TASKS      | ``rl.<run>.tasks.>``      | work queue | msgs + bytes, discard new     | one durable per pool, disjoint filters |
| ROLLOUTS   | ``rl.<run>.rollouts.>``   | work queue | msgs + bytes, discard new     | generator -> reward                    |
| SCORED     | ``rl.<run>.scored.>``     | limits     | msgs + bytes, discard old     | kept for replay; trainer acks after commit |
| WEIGHTS    | ``rl.<run>.weights.>``    | limits     | last 1024 per subject         | published manifests (watched)          |
| UPLOADS    | ``rl.<run>.uploads.>``    | work queue | msgs + bytes, discard new     | trainer -> weight-broadcast, acked     |
| CONTROL    | ``rl.<run>.control.>``    | limits     | last N per subject            | the controller's audit trail           |
| METRICS    | ``rl.<run>.metrics.>``    | limits     | short max-age                 | heartbeats                             |
| DEAD       | ``rl.<run>.dead.>``       | limits     | msgs + bytes, discard new     | bad messages with their reason         |
| ADVISORIES | max-deliveries advisories | work queue | msgs, discard old             | one durable per followed durable       |

UPLOADS is a work queue like TASKS: an upload stays until weight-broadcast (its only consumer)
acks it, verified and announced or refused into DEAD, and a burst beyond ``queue_max_msgs`` is
refused to its publisher (``StreamFull`` naming the key) instead of pushing out an unread real
version, as a per-subject limit on WEIGHTS would.  Its subjects do not overlap
``rl.<run>.weights.<model>.upload``, where a run made before UPLOADS existed keeps its uploads
(JetStream refuses overlapping streams), so such a run migrates in place: its next connect
creates UPLOADS beside the unchanged WEIGHTS, and weight-broadcast reads uploads from there
under a new durable.  What the old durable (``broadcast`` on WEIGHTS) had not read is left
behind: before upgrading, stop the trainer and let weight-broadcast announce its last upload
(the version ``rlbus status`` shows), or accept that the trainer's next version supersedes it.
The old durable can then be removed (``nats consumer rm RL_<run>_WEIGHTS broadcast``).

Every stream has a ``duplicate_window`` so a publisher retrying with the same ``Nats-Msg-Id``
is stored once.  ``ensure_streams`` is idempotent: it creates what is missing and accepts what is
equal.  An existing stream whose limits or dedupe window differ is *updated in place* (logged):
that is how a changed run config reaches a live run.  Only what JetStream cannot change under a
stream's messages — its subjects, retention policy or storage — is refused (``BusConfigError``),
naming the differing fields.  Limits are applied only by a connection given a ``Retention``
(the services, from the run config); without one (a CLI tool) existing limits are kept.

Replicas (``[run] replicas``, ``Retention.replicas``): every stream above and the object bucket
are kept on that many servers of a cluster; a live run's streams and durables are raised (or
lowered) in place at the next connect.  A cluster that is still electing its leader or joining
its nodes is waited out; a refusal that will not pass is a ``BusConfigError`` at once (see "a
cluster that is not ready yet" below).

Durables: ``ensure_consumer`` creates a missing one and updates ``ack_wait``, ``max_deliver``,
``max_ack_pending`` of an existing one in place (the durable keeps its position and its
un-acked messages); a different filter or ack policy is refused with what to do.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

from nats.js import api
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from rlbus.bus.protocol import BusConfigError, BusError, ConsumerSpec, ServerUnavailable
from rlbus.bus.retention import RETENTION_KEYS, Retention
from rlbus.bus.routing import WORK_QUEUES, origin_token, stream_kind_of  # noqa: F401 - re-exported
from rlbus.bus.subjects import STREAM_KINDS, Subjects

DUPLICATE_WINDOW_S = 600.0
METRICS_MAX_AGE_S = 600.0
# Messages kept per WEIGHTS subject: published manifests, read by watches and ``last``.  Past it
# the oldest are discarded, so nothing that must still be consumed lives there (uploads have
# their own work queue, UPLOADS).  Manifests are small (the bytes live in the object store), so
# a thousand per subject costs little and keeps a history of versions for a lagging reader.
WEIGHTS_PER_SUBJECT = 1024
ADVISORIES_MAX_MSGS = 100_000


@dataclass(frozen=True)
class StreamDecl:
    kind: str
    config: api.StreamConfig
    # The fields a ``Retention`` sets on this stream: kept as the server has them when the
    # connection was given no ``Retention``.
    limit_fields: tuple[str, ...] = ()


def _unlimited(n: int) -> int:
    return n if n > 0 else -1


def _limits(kind: str, r: Retention) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The retention limits of stream ``kind`` (see ``rlbus.bus.retention``) and the fields they set."""
    new, old = api.DiscardPolicy.NEW, api.DiscardPolicy.OLD
    if kind in WORK_QUEUES:
        lim = dict(max_msgs=_unlimited(r.queue_max_msgs), max_bytes=_unlimited(r.queue_max_bytes), discard=new)
    elif kind == "SCORED":
        lim = dict(max_msgs=_unlimited(r.scored_max_msgs), max_bytes=_unlimited(r.scored_max_bytes), discard=old)
    elif kind == "DEAD":
        lim = dict(max_msgs=_unlimited(r.dead_max_msgs), max_bytes=_unlimited(r.dead_max_bytes), discard=new)
    elif kind == "CONTROL":
        lim = dict(max_msgs_per_subject=_unlimited(r.control_per_subject), discard=old)
    else:
        return {}, ()
    return lim, tuple(lim)


def declarations(subjects: Subjects, *, retention: Retention | None = None,
                 weights_per_subject: int = WEIGHTS_PER_SUBJECT,
                 metrics_max_age: float = METRICS_MAX_AGE_S) -> list[StreamDecl]:
    def cfg(kind: str, token: str, retention_policy: api.RetentionPolicy, **extra: Any) -> StreamDecl:
        params: dict[str, Any] = dict(
            name=subjects.stream(kind),
            subjects=[subjects.all_of(token)],
            retention=retention_policy,
            storage=api.StorageType.FILE,
            discard=api.DiscardPolicy.OLD,
            duplicate_window=DUPLICATE_WINDOW_S,
            allow_direct=True,
            num_replicas=r.replicas,
        )
        limits, fields = _limits(kind, r)
        params.update(limits)
        params.update(extra)
        return StreamDecl(kind, api.StreamConfig(**params), (*fields, "num_replicas"))

    r = retention or Retention()

    wq, limits = api.RetentionPolicy.WORK_QUEUE, api.RetentionPolicy.LIMITS
    return [
        cfg("TASKS", "tasks", wq),
        cfg("ROLLOUTS", "rollouts", wq),
        cfg("SCORED", "scored", limits),
        cfg("WEIGHTS", "weights", limits, max_msgs_per_subject=weights_per_subject),
        cfg("UPLOADS", "uploads", wq),
        cfg("CONTROL", "control", limits),
        # The dedupe window may not exceed max_age.
        cfg("METRICS", "metrics", limits, max_age=metrics_max_age,
            duplicate_window=min(DUPLICATE_WINDOW_S, metrics_max_age)),
        cfg("DEAD", "dead", limits),
    ]


def advisory_declaration(subjects: Subjects, *, retention: Retention | None = None) -> StreamDecl:
    """The run's captured max-deliveries advisories (``rlbus.bus.advisories``): a small work queue."""
    return StreamDecl("ADVISORIES", api.StreamConfig(
        name=subjects.advisory_stream, subjects=subjects.max_deliveries_advisories(),
        retention=api.RetentionPolicy.WORK_QUEUE, storage=api.StorageType.FILE, discard=api.DiscardPolicy.OLD,
        max_msgs=ADVISORIES_MAX_MSGS, duplicate_window=120.0, num_replicas=(retention or Retention()).replicas,
    ), ("num_replicas",))


# The one advisory durable every consuming connection shared before each durable got its own
# (``rlbus.bus.advisories``).  Unfiltered, it overlaps every per-durable one on the work queue, so it
# is removed when found; the advisories it had not acked stay in the stream for the new ones.
LEGACY_ADVISORY_DURABLE = "rlbus_max_deliveries"
ADVISORY_ACK_WAIT_S = 60.0
_WQ_OVERLAP = (10100, 10101)  # a work queue refused a consumer whose filter overlaps another's


def advisory_consumer_config(subjects: Subjects, kind: str, durable: str,
                             replicas: int | None = None) -> api.ConsumerConfig:
    """The ADVISORIES durable following only ``durable`` of stream ``kind``: a service reads the
    advisories of what it consumes, never another role's (which it could not act on)."""
    return api.ConsumerConfig(
        durable_name=subjects.advisory_durable(kind, durable), ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=ADVISORY_ACK_WAIT_S, max_deliver=-1, deliver_policy=api.DeliverPolicy.ALL, max_ack_pending=1000,
        filter_subject=subjects.max_deliveries_advisory(kind, durable), num_replicas=replicas,
    )


async def ensure_advisory_consumer(js: Any, subjects: Subjects, kind: str, durable: str, *,
                                   replicas: int | None = None, log: Any = None) -> str:
    """Declare the advisory durable of (``kind``, ``durable``); with ``replicas`` (the run's
    ``Retention.replicas``) an existing one is given that many copies in place, like the run's
    other durables.  Returns its name."""
    cfg = advisory_consumer_config(subjects, kind, durable, replicas)
    stream, name = subjects.advisory_stream, cfg.durable_name
    try:
        info = await js.consumer_info(stream, name)
    except NotFoundError:
        try:
            await js.add_consumer(stream, cfg)
        except APIError as exc:
            if exc.err_code in _WQ_OVERLAP and await _drop_legacy(js, stream, log):
                await js.add_consumer(stream, cfg)
            elif exc.err_code != 10148:  # already exists: another replica made it meanwhile
                raise
        return name
    if replicas is not None and _copies(info) != replicas:
        await js.add_consumer(stream, replace(info.config, num_replicas=replicas))
        if log is not None:
            log.warning("durable_updated", stream=stream, durable=name,
                        changes=[f"num_replicas: {_copies(info)} -> {replicas}"])
    return name


async def _drop_legacy(js: Any, stream: str, log: Any) -> bool:
    try:
        await js.delete_consumer(stream, LEGACY_ADVISORY_DURABLE)
    except NotFoundError:
        return False
    if log is not None:
        log.warning("advisory_durable_migrated", stream=stream, removed=LEGACY_ADVISORY_DURABLE,
                    why="each consumed durable now has its own advisory durable; pending advisories stay")
    return True


def limit_key(subjects: Subjects, stream: str, why: str) -> str:
    """The run config key that raises the limit ``why`` (the server's words) of ``stream``."""
    by_bytes = "bytes" in why
    prefix = {**{subjects.stream(k): "queue" for k in WORK_QUEUES},
              subjects.stream("SCORED"): "scored", subjects.stream("DEAD"): "dead"}.get(stream)
    if prefix is not None:
        return RETENTION_KEYS[f"{prefix}_max_{'bytes' if by_bytes else 'msgs'}"]
    if stream == f"OBJ_{subjects.object_bucket}":
        return RETENTION_KEYS["objects_max_bytes"]
    return ""


# Fields JetStream cannot change under a stream's messages: refused.  Every other declared
# field is updated in place.
_FIXED_FIELDS = ("subjects", "retention", "storage")
_STREAM_FIELDS = ("subjects", "retention", "storage", "discard", "duplicate_window", "max_age", "max_msgs",
                  "max_bytes", "max_msgs_per_subject", "num_replicas")
_COUNT_FIELDS = ("max_msgs", "max_bytes", "max_msgs_per_subject")


def _norm(value: Any) -> Any:
    if isinstance(value, list):
        return sorted(value)
    if hasattr(value, "value"):  # enums
        return value.value
    if value is None:
        return 0  # the server reports unset limits as 0 / -1; compared below with that in mind
    return value


def _same(field: str, want: Any, have: Any) -> bool:
    w, h = _norm(want), _norm(have)
    if field in ("max_age", "duplicate_window", "ack_wait"):
        return math.isclose(float(w or 0), float(h or 0), abs_tol=1e-3)
    if field in _COUNT_FIELDS:
        return (w if w not in (0, None) else -1) == (h if h not in (0, None) else -1)
    if field == "num_replicas":
        return (w or 1) == (h or 1)
    return w == h


def stream_conflicts(want: api.StreamConfig, have: api.StreamConfig, fields: tuple[str, ...] = _STREAM_FIELDS) -> list[str]:
    out = []
    for f in fields:
        w, h = getattr(want, f), getattr(have, f)
        if not _same(f, w, h):
            out.append(f"{f}: declared {_norm(w)!r}, server has {_norm(h)!r}")
    return out


async def ensure_stream(js: Any, decl: StreamDecl, *, apply_limits: bool = True, log: Any = None,
                        placement: PlacementWait | None = None) -> None:
    """Create ``decl`` if missing; update an existing stream in place; refuse a fixed-field change.
    A cluster that cannot answer yet raises ``ServerUnavailable`` (the caller tries again)."""
    name = decl.config.name
    placement = placement or PlacementWait()
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        try:
            await js.add_stream(decl.config)
            return
        except APIError as exc:
            if exc.err_code != 10058:  # 10058: stream name already in use (a racing creator)
                raise _declare_error(exc, name, decl.config.num_replicas, placement,
                                     f"could not create stream {name}") from None
            info = await js.stream_info(name)
    want = decl.config
    if not apply_limits:  # keep the limits the server has (set by a service that knows the run config)
        want = replace(want, **{f: getattr(info.config, f) for f in decl.limit_fields})
    fixed = stream_conflicts(want, info.config, _FIXED_FIELDS)
    if fixed:
        raise BusConfigError(
            f"stream {name} exists with a configuration that cannot be changed in place ({'; '.join(fixed)}). "
            f"Use a new run name, or delete the stream (`nats stream rm {name}`) if its contents can go."
        )
    changed = stream_conflicts(want, info.config)
    if changed:
        # The replica count is among what is updated in place: a clustered server copies the
        # stream to new peers (or drops copies) under its messages, with no refusal; only a
        # server outside a cluster refuses any count above 1 (10074).
        try:
            await js.update_stream(want)
        except APIError as exc:
            raise _declare_error(
                exc, name, want.num_replicas, placement,
                f"stream {name} could not be updated to the declared configuration ({'; '.join(changed)})",
                todo="Lower the limits in [run.retention] (the server may not have the storage to reserve), or "
                     "update the stream by hand.") from None
        if log is not None:
            log.warning("stream_updated", stream=name, changes=changed)


async def ensure_streams(js: Any, subjects: Subjects, *, retention: Retention | None = None, log: Any = None,
                         placement: PlacementWait | None = None, **options: Any) -> None:
    """Create the run's streams if missing, update changed ones in place, refuse fixed-field changes.
    Without ``retention``, existing streams keep their limits and replica counts (new ones get
    the defaults).  Pass one ``placement`` across the attempts of one start-up."""
    decls = declarations(subjects, retention=retention, **options)
    if {d.kind for d in decls} != set(STREAM_KINDS):
        raise BusConfigError("stream declarations do not cover every stream kind")  # a code defect
    placement = placement or PlacementWait()
    for decl in [*decls, advisory_declaration(subjects, retention=retention)]:
        await ensure_stream(js, decl, apply_limits=retention is not None, log=log, placement=placement)


# --- a cluster that is not ready yet ---------------------------------------------------------
#
# Services started together with the servers of a fresh cluster declare their streams while
# JetStream elects its meta leader and the nodes find each other.  Meanwhile the API answers
# 503 (10008 "JetStream system temporarily unavailable", 10023 "insufficient resources" before
# the peers have reported their storage), "no suitable peers for placement" (10005: fewer
# servers joined than the replicas asked), or nothing at all (a timeout, which ``rlbus.bus.outage``
# already retries).  Those are waited out; everything else is a configuration error at once.

PLACEMENT_GRACE_S = 60.0  # nodes started together join within seconds; past this the cluster is too small


class PlacementWait:
    """Since when the cluster has refused to place the run's streams for want of servers (10005):
    waited out for ``grace`` seconds, then reported as ``[run] replicas`` above the cluster's size."""

    def __init__(self, grace: float = PLACEMENT_GRACE_S) -> None:
        self.grace = grace
        self.since: float | None = None

    def refused(self, stream: str, replicas: int, why: str) -> BusError:
        now = time.monotonic()
        self.since = now if self.since is None else self.since
        if now - self.since < self.grace:
            return ServerUnavailable(f"stream {stream} cannot be placed yet ({why}): waiting for the servers of "
                                     f"the cluster to join")
        return BusConfigError(
            f"stream {stream} asks for {replicas} replicas, and for {self.grace:.0f}s the cluster has had too few "
            f"JetStream servers to place them ({why}): [run] replicas may not exceed the servers of the cluster "
            "that are up. Start the missing servers, or lower [run] replicas.")


def _declare_error(exc: APIError, name: str, replicas: int | None, placement: PlacementWait, what: str,
                   todo: str = "") -> BusError:
    """The error of a refused stream create or update: transient ones as ``ServerUnavailable``."""
    why = f"{exc.description} (JetStream error {exc.err_code})"
    if isinstance(exc, ServiceUnavailableError) or exc.code == 503:
        return ServerUnavailable(f"{what}: {why}; the cluster is electing a leader or still starting")
    if exc.err_code == 10005:
        return placement.refused(name, replicas or 1, why)
    if exc.err_code == 10074:
        return BusConfigError(f"{what}: {why}. [run] replicas = {replicas} needs a JetStream cluster; a single "
                              "server keeps one copy: set [run] replicas = 1, or point nats_url at a cluster.")
    return BusConfigError(f"{what}: {why}. {todo}".rstrip())


# --- durable consumers ---------------------------------------------------------------------

_DELIVER = {
    "all": api.DeliverPolicy.ALL,
    "new": api.DeliverPolicy.NEW,
    "last_per_subject": api.DeliverPolicy.LAST_PER_SUBJECT,
}


def consumer_config(spec: ConsumerSpec) -> api.ConsumerConfig:
    if not spec.filter_subjects:
        raise BusConfigError(f"consumer {spec.durable!r} needs at least one filter subject")
    params: dict[str, Any] = dict(
        durable_name=spec.durable,
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=spec.ack_wait,
        max_deliver=spec.max_deliver,
        max_ack_pending=spec.max_ack_pending,
        deliver_policy=_DELIVER[spec.deliver_policy],
        replay_policy=api.ReplayPolicy.INSTANT,
    )
    if len(spec.filter_subjects) == 1:
        params["filter_subject"] = spec.filter_subjects[0]
    else:
        params["filter_subjects"] = list(spec.filter_subjects)
    return api.ConsumerConfig(**params)


def _filters(cfg: api.ConsumerConfig) -> list[str]:
    if cfg.filter_subjects:
        return sorted(cfg.filter_subjects)
    return [cfg.filter_subject] if cfg.filter_subject else []


_TUNABLE = ("ack_wait", "max_deliver", "max_ack_pending")  # JetStream updates these on a live durable


def consumer_conflicts(spec: ConsumerSpec, have: api.ConsumerConfig) -> list[str]:
    """Differences JetStream cannot apply to an existing durable (its filter, its ack policy)."""
    out = []
    if sorted(spec.filter_subjects) != _filters(have):
        out.append(f"filter_subjects: declared {sorted(spec.filter_subjects)}, server has {_filters(have)}")
    if _norm(have.ack_policy) != api.AckPolicy.EXPLICIT.value:
        out.append(f"ack_policy: declared 'explicit', server has {_norm(have.ack_policy)!r}")
    return out


def consumer_changes(spec: ConsumerSpec, have: api.ConsumerConfig) -> list[str]:
    """Differences applied in place (``ack_wait``, ``max_deliver``, ``max_ack_pending``)."""
    return [f"{f}: {getattr(have, f)!r} -> {getattr(spec, f)!r}" for f in _TUNABLE
            if not _same(f, getattr(spec, f), getattr(have, f))]


def _copies(info: api.ConsumerInfo) -> int:
    """Servers that keep a durable: as configured, else (0: its stream's count when it was made)
    its leader and its peers; one outside a cluster.  A raised count shows in the config at once
    and in the peers only once the server has copied the durable (seconds)."""
    if info.config.num_replicas:
        return int(info.config.num_replicas)
    return 1 + len(info.cluster.replicas or []) if info.cluster is not None else 1


async def ensure_consumer(js: Any, subjects: Subjects, spec: ConsumerSpec, *, log: Any = None,
                          replicas: int | None = None) -> str:
    """Create the durable if missing; update its tunables in place; refuse a changed filter or
    ack policy.  Returns the stream name.  A new durable has as many copies as its stream; an
    existing one is given ``replicas`` copies in place (None: kept): raising a stream's replicas
    leaves its durables where they were, on one server that a node loss would take away."""
    stream = subjects.stream(spec.stream)
    try:
        info = await js.consumer_info(stream, spec.durable)
    except NotFoundError:
        try:
            await js.add_consumer(stream, consumer_config(spec))
            return stream
        except APIError as exc:
            if isinstance(exc, ServiceUnavailableError) or exc.code == 503:  # a cluster not ready yet
                raise ServerUnavailable(f"could not create durable {spec.durable!r} on {stream}: {exc.description} "
                                        f"(JetStream error {exc.err_code}); the cluster is electing a leader") from None
            if exc.err_code in (10099, 10100, 10101):  # overlapping / unfiltered work-queue consumers
                raise BusConfigError(
                    f"durable {spec.durable!r} on {stream} was refused: {exc.description}. A work-queue "
                    "stream allows one consumer per subject: give each pool its own durable with a "
                    "filter that does not overlap another durable's, or reuse the existing durable."
                ) from None
            if exc.err_code == 10059 or exc.code == 404:  # stream not found
                raise BusConfigError(f"stream {stream} does not exist; run ensure_streams first") from None
            if exc.err_code != 10148:  # 10148: consumer already exists (a racing creator)
                raise BusConfigError(f"could not create durable {spec.durable!r} on {stream}: {exc}") from None
            info = await js.consumer_info(stream, spec.durable)
    fixed = consumer_conflicts(spec, info.config)
    if fixed:
        raise BusConfigError(
            f"durable {spec.durable!r} on stream {stream} exists with a filter or ack policy that cannot change "
            f"in place ({'; '.join(fixed)}). Its position and un-acked messages are kept on the server: run "
            "with the configuration it was made with (e.g. the same [run] pools) to go on consuming, or "
            "start a new run name for the new set of subjects. Deleting the durable "
            f"(`nats consumer rm {stream} {spec.durable}`) would redeliver the stream from its start."
        )
    changes = consumer_changes(spec, info.config)
    copies = {}
    if replicas is not None and _copies(info) != replicas:
        copies = {"num_replicas": replicas}
        changes.append(f"num_replicas: {_copies(info)} -> {replicas}")
    if changes:
        await _update_consumer(js, stream, spec, info.config, changes, copies)
        if log is not None:
            log.warning("durable_updated", stream=stream, durable=spec.durable, changes=changes)
    return stream


async def _update_consumer(js: Any, stream: str, spec: ConsumerSpec, have: api.ConsumerConfig,
                           changes: list[str], copies: dict[str, int]) -> None:
    # The server's own config with our tunables: the deliver policy, start position and
    # everything else the durable was made with stay as they are (they cannot change).
    cfg = replace(have, **{f: getattr(spec, f) for f in _TUNABLE}, **copies)
    try:
        await js.add_consumer(stream, cfg)  # create-or-update: an existing durable is updated
    except APIError as exc:
        if exc.code == 503:
            raise ServerUnavailable(f"durable {spec.durable!r} on {stream}: {exc.description}") from None
        raise BusConfigError(
            f"durable {spec.durable!r} on {stream} could not be updated in place ({'; '.join(changes)}): {exc}. "
            "Keep the old settings (they are shown above as 'old -> new') or update the durable by hand."
        ) from None
