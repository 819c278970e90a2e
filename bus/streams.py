"""Stream and consumer declarations of one run, as code.

| stream   | subjects                  | retention  | notes                                           |
|----------|---------------------------|------------|-------------------------------------------------|
| TASKS    | ``rl.<run>.tasks.>``      | work queue | one durable per pool, non-overlapping filters   |
| ROLLOUTS | ``rl.<run>.rollouts.>``   | work queue | generator -> reward                             |
| SCORED   | ``rl.<run>.scored.>``     | limits     | kept for replay; trainer acks after commit      |
| WEIGHTS  | ``rl.<run>.weights.>``    | limits     | last N per subject (manifests and uploads)      |
| CONTROL  | ``rl.<run>.control.>``    | limits     | the controller's audit trail                    |
| METRICS  | ``rl.<run>.metrics.>``    | limits     | short max-age                                   |
| DEAD     | ``rl.<run>.dead.>``       | limits     | bad messages with their reason                  |

Every stream has a ``duplicate_window`` so a publisher retrying with the same ``Nats-Msg-Id``
is stored once.  ``ensure_streams`` is idempotent: it creates what is missing, accepts what is
equal, and refuses (``BusConfigError``) a stream or durable that exists with different settings,
naming the differing fields — silently re-configuring a live run's streams would change its
delivery semantics under running services.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nats.js import api
from nats.js.errors import APIError, NotFoundError

from bus.protocol import BusConfigError, ConsumerSpec, StreamKind
from bus.routing import WORK_QUEUES, origin_token, stream_kind_of  # noqa: F401 - re-exported
from bus.subjects import STREAM_KINDS, Subjects

DUPLICATE_WINDOW_S = 600.0
METRICS_MAX_AGE_S = 600.0
WEIGHTS_PER_SUBJECT = 8


@dataclass(frozen=True)
class StreamDecl:
    kind: StreamKind
    config: api.StreamConfig


def declarations(subjects: Subjects, *, weights_per_subject: int = WEIGHTS_PER_SUBJECT,
                 metrics_max_age: float = METRICS_MAX_AGE_S) -> list[StreamDecl]:
    def cfg(kind: StreamKind, token: str, retention: api.RetentionPolicy, **extra: Any) -> StreamDecl:
        params: dict[str, Any] = dict(
            name=subjects.stream(kind),
            subjects=[subjects.all_of(token)],
            retention=retention,
            storage=api.StorageType.FILE,
            discard=api.DiscardPolicy.OLD,
            duplicate_window=DUPLICATE_WINDOW_S,
            allow_direct=True,
            num_replicas=1,
        )
        params.update(extra)
        return StreamDecl(kind, api.StreamConfig(**params))

    wq, limits = api.RetentionPolicy.WORK_QUEUE, api.RetentionPolicy.LIMITS
    return [
        cfg("TASKS", "tasks", wq),
        cfg("ROLLOUTS", "rollouts", wq),
        cfg("SCORED", "scored", limits),
        cfg("WEIGHTS", "weights", limits, max_msgs_per_subject=weights_per_subject),
        cfg("CONTROL", "control", limits),
        # The dedupe window may not exceed max_age.
        cfg("METRICS", "metrics", limits, max_age=metrics_max_age,
            duplicate_window=min(DUPLICATE_WINDOW_S, metrics_max_age)),
        cfg("DEAD", "dead", limits),
    ]


# Fields we declare and therefore compare; everything else is the server's business.
_STREAM_FIELDS = ("subjects", "retention", "storage", "discard", "duplicate_window", "max_age",
                  "max_msgs_per_subject", "num_replicas")


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
    if field in ("max_msgs_per_subject",):
        return (w if w not in (0, None) else -1) == (h if h not in (0, None) else -1)
    if field == "num_replicas":
        return (w or 1) == (h or 1)
    return w == h


def stream_conflicts(want: api.StreamConfig, have: api.StreamConfig) -> list[str]:
    out = []
    for f in _STREAM_FIELDS:
        w, h = getattr(want, f), getattr(have, f)
        if not _same(f, w, h):
            out.append(f"{f}: declared {_norm(w)!r}, server has {_norm(h)!r}")
    return out


async def ensure_stream(js: Any, decl: StreamDecl) -> None:
    name = decl.config.name
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        try:
            await js.add_stream(decl.config)
            return
        except APIError as exc:
            if exc.err_code != 10058:  # 10058: stream name already in use (a racing creator)
                raise BusConfigError(f"could not create stream {name}: {exc}") from None
            info = await js.stream_info(name)
    diffs = stream_conflicts(decl.config, info.config)
    if diffs:
        raise BusConfigError(
            f"stream {name} exists with a different configuration ({'; '.join(diffs)}). "
            f"Delete it (`nats stream rm {name}`) if its contents can go, or use a new run name."
        )


async def ensure_streams(js: Any, subjects: Subjects, **options: Any) -> None:
    """Create the run's streams if missing; refuse conflicting existing ones."""
    decls = declarations(subjects, **options)
    if {d.kind for d in decls} != set(STREAM_KINDS):
        raise BusConfigError("stream declarations do not cover every stream kind")  # a code defect
    for decl in decls:
        await ensure_stream(js, decl)


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


def consumer_conflicts(spec: ConsumerSpec, have: api.ConsumerConfig) -> list[str]:
    out = []
    if sorted(spec.filter_subjects) != _filters(have):
        out.append(f"filter_subjects: declared {sorted(spec.filter_subjects)}, server has {_filters(have)}")
    for f in ("ack_wait", "max_deliver", "max_ack_pending"):
        w, h = getattr(spec, f), getattr(have, f)
        if not _same(f, w, h):
            out.append(f"{f}: declared {w!r}, server has {h!r}")
    if _norm(have.ack_policy) != api.AckPolicy.EXPLICIT.value:
        out.append(f"ack_policy: declared 'explicit', server has {_norm(have.ack_policy)!r}")
    return out


async def ensure_consumer(js: Any, subjects: Subjects, spec: ConsumerSpec) -> str:
    """Create the durable if missing; refuse a conflicting one.  Returns the stream name."""
    stream = subjects.stream(spec.stream)
    try:
        info = await js.consumer_info(stream, spec.durable)
    except NotFoundError:
        try:
            await js.add_consumer(stream, consumer_config(spec))
            return stream
        except APIError as exc:
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
    diffs = consumer_conflicts(spec, info.config)
    if diffs:
        raise BusConfigError(
            f"durable {spec.durable!r} on stream {stream} exists with a different configuration "
            f"({'; '.join(diffs)}). Delete it (`nats consumer rm {stream} {spec.durable}`; its position "
            "is lost) or use a new run name."
        )
    return stream
