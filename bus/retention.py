"""``Retention``: how much each stream of a run (and its object bucket) may hold, what happens
at the limit, and on how many servers of a cluster each is kept (``replicas``).  Pure data, no nats import: the run config (``rlbus.services.runtime.config``) builds it
and ``rlbus.bus.streams`` applies it.

Without limits a run's streams grow until the server's storage is full, and then *every* publish
fails, dead letters included.  Each stream therefore gets limits, chosen so that reaching one
never loses data silently:

| stream / bucket    | limit                                   | at the limit                                     |
|--------------------|-----------------------------------------|--------------------------------------------------|
| TASKS, ROLLOUTS,   | ``queue_max_msgs``, ``queue_max_bytes`` | discard *new*: the publisher gets ``StreamFull`` |
| UPLOADS            | (each)                                  | naming the stream, the limit and the key to raise |
|                    |                                         | (queued uploads are kept: the new one is refused) |
| SCORED             | ``scored_max_msgs``, ``scored_max_bytes`` | discard *old*: the oldest groups, trained and    |
|                    |                                         | acked long ago (kept only for replay), go first; |
|                    |                                         | a burst larger than the cap, published faster    |
|                    |                                         | than the trainer reads, loses its oldest unread  |
|                    |                                         | groups: the cap must exceed any burst            |
| CONTROL            | ``control_per_subject`` per subject     | discard old per subject: the latest decision of  |
|                    |                                         | every subject is always kept                     |
| DEAD               | ``dead_max_msgs``, ``dead_max_bytes``   | discard *new*: the dead letter is refused, so the |
|                    |                                         | bad message stays un-acked and comes back        |
| object bucket      | ``objects_max_bytes``                   | discard new: a put fails with ``StreamFull``;    |
|                    |                                         | weight-broadcast deletes versions past its keep, |
|                    |                                         | and claims no held message can reference any     |
|                    |                                         | more (``rlbus.bus.claims``)                            |
| WEIGHTS, METRICS   | last N per subject / max age (fixed)    | discard old (superseded published manifests, old |
|                    |                                         | heartbeats); nothing there awaits a consumer     |

A limit of 0 means "no limit" (the server's own storage bound applies).  Byte limits are off by
default: the server *reserves* a stream's ``max_bytes`` of its storage when the stream is made
(measured: a server on this machine refused the seventh 8 GiB stream), so default byte caps on
every run would exhaust a shared server; message caps reserve nothing.  A stream that exists with
other limits is updated in place (``rlbus.bus.streams.ensure_stream``); limits are given to the bus only by
services that know the run config, so a tool connecting without them leaves existing limits alone.

``replicas`` (``[run] replicas``) is how many servers of a cluster keep each stream, each durable
and the object bucket; changed the same way, in place, and likewise left alone by a tool.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1024 * 1024


@dataclass(frozen=True)
class Retention:
    """Limits of one run's streams; see the module docstring for what happens at each."""

    queue_max_msgs: int = 1_000_000
    queue_max_bytes: int = 0
    scored_max_msgs: int = 1_000_000
    scored_max_bytes: int = 0
    control_per_subject: int = 1000
    dead_max_msgs: int = 100_000
    dead_max_bytes: int = 0
    objects_max_bytes: int = 0
    # Copies of every stream and of the object bucket kept on distinct servers of a cluster
    # (``[run] replicas``): 1 on a single server, 3 on a cluster so one node may be lost.
    replicas: int = 1


# The run config key that sets each limit, named in the error a publisher gets at the limit.
RETENTION_KEYS = {
    "queue_max_msgs": "[run.retention] queue_max_msgs",
    "queue_max_bytes": "[run.retention] queue_max_mib",
    "scored_max_msgs": "[run.retention] scored_keep_steps",
    "scored_max_bytes": "[run.retention] scored_max_mib",
    "dead_max_msgs": "[run.retention] dead_max_msgs",
    "dead_max_bytes": "[run.retention] dead_max_mib",
    "objects_max_bytes": "[run.retention] objects_max_mib",
}
