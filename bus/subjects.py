"""Every subject, stream, consumer and bucket name of a run, built in one place.

One run is one namespace ``rl.<run>.…``; no other module spells a subject, so renaming a
subject or adding a run prefix is a change here and nowhere else.  Names are validated
because a ``.`` or a wildcard smuggled into a run or pool name would silently widen a
subscription to another run's traffic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class SubjectError(ValueError):
    """A run, pool, service or instance name cannot be used as a subject token."""


def _token(kind: str, value: str) -> str:
    # fullmatch: with match, '$' also matches before a trailing newline, and a newline in a
    # subject breaks the protocol line.
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise SubjectError(
            f"{kind} {value!r} is not a valid subject token: use 1-64 characters of "
            "letters, digits, '_' or '-' (no dots, spaces or wildcards)"
        )
    return value


# Stream names are global on a server, so they carry the run too.
STREAM_KINDS = ("TASKS", "ROLLOUTS", "SCORED", "WEIGHTS", "UPLOADS", "CONTROL", "METRICS", "DEAD")
ENV_OPS = ("reset", "reset_batch", "step")
# Emitted by the server (core NATS) when a message exhausts a consumer's max_deliver.
MAX_DELIVERIES_ADVISORY = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES"


@dataclass(frozen=True)
class Subjects:
    """The names of one run.  ``Subjects("demo").tasks("math")`` -> ``rl.demo.tasks.math``."""

    run: str

    def __post_init__(self) -> None:
        _token("run", self.run)

    @property
    def root(self) -> str:
        return f"rl.{self.run}"

    # --- work streams -------------------------------------------------------------
    def tasks(self, pool: str) -> str:
        return f"{self.root}.tasks.{_token('pool', pool)}"

    def rollouts(self, pool: str) -> str:
        return f"{self.root}.rollouts.{_token('pool', pool)}"

    def scored(self, pool: str) -> str:
        return f"{self.root}.scored.{_token('pool', pool)}"

    def weights(self, model: str) -> str:
        return f"{self.root}.weights.{_token('model', model)}"

    def weight_uploads(self, model: str) -> str:
        """Trainer -> weight-broadcast hand-off of a freshly written version: its own work-queue
        stream (UPLOADS, see ``rlbus.bus.streams``), outside WEIGHTS, so no burst can push a real version
        out before weight-broadcast has read it."""
        return f"{self.root}.uploads.{_token('model', model)}"

    def control(self, service: str, instance: str = "all") -> str:
        return f"{self.root}.control.{_token('service', service)}.{_token('instance', instance)}"

    def control_action(self, service: str, instance: str, action: str) -> str:
        """One kind of decision for one instance: ``rl.<run>.control.<service>.<instance>.<action>``.
        Each action has its own subject so a reader of the last message per subject gets the latest
        decision of every kind (a new pool assignment does not hide the last admission grant)."""
        return f"{self.control(service, instance)}.{_token('action', action)}"

    def control_actions(self, service: str, instance: str = "all") -> str:
        """Every action subject of one instance (``control_action``'s wildcard)."""
        return f"{self.control(service, instance)}.>"

    def metrics(self, service: str, instance: str) -> str:
        return f"{self.root}.metrics.{_token('service', service)}.{_token('instance', instance)}"

    def metrics_of(self, service: str = "*") -> str:
        """Every instance of one service (or of all services with ``"*"``)."""
        svc = service if service == "*" else _token("service", service)
        return f"{self.root}.metrics.{svc}.*"

    def dead(self, origin: str) -> str:
        return f"{self.root}.dead.{_token('origin', origin)}"

    def env(self, name: str, op: str) -> str:
        if op not in ENV_OPS:
            raise SubjectError(f"environment op {op!r} must be one of {', '.join(ENV_OPS)}")
        return f"{self.root}.env.{_token('env', name)}.{op}"

    def env_step(self, name: str, replica: str) -> str:
        """The step subject of one environment replica: an episode's steps go to the replica that
        holds its state (``EnvReply.replica`` of its reset)."""
        return f"{self.root}.env.{_token('env', name)}.step.{_token('replica', replica)}"

    def env_step_of(self, replica: str) -> str:
        """Every environment's step subject of one replica (what that replica subscribes to)."""
        return f"{self.root}.env.*.step.{_token('replica', replica)}"

    def env_any(self, op: str) -> str:
        """Every environment's ``op`` subject: the environment service answers unknown names too,
        with an error that lists the registered ones."""
        if op not in ENV_OPS:
            raise SubjectError(f"environment op {op!r} must be one of {', '.join(ENV_OPS)}")
        return f"{self.root}.env.*.{op}"

    # --- wildcards used by stream declarations and fan-in consumers ---------------
    def all_of(self, kind: str) -> str:
        """``rl.<run>.<kind>.>`` — every subject of one stream."""
        return f"{self.root}.{kind}.>"

    # --- streams, consumers, buckets -------------------------------------------------
    def stream(self, kind: str) -> str:
        if kind not in STREAM_KINDS:
            raise SubjectError(f"unknown stream kind {kind!r}; expected one of {STREAM_KINDS}")
        return f"RL_{self.run}_{kind}".replace("-", "_")

    @property
    def advisory_stream(self) -> str:
        """The run's stream of captured max-deliveries advisories (``rlbus.bus.advisories``)."""
        return f"RL_{self.run}_ADVISORIES".replace("-", "_")

    def max_deliveries_advisories(self) -> list[str]:
        """The server's max-deliveries advisory subjects of every stream of this run (any consumer)."""
        return [f"{MAX_DELIVERIES_ADVISORY}.{self.stream(kind)}.*" for kind in STREAM_KINDS]

    def max_deliveries_advisory(self, kind: str, durable: str) -> str:
        """The server's max-deliveries advisory subject of one durable of one stream of this run."""
        return f"{MAX_DELIVERIES_ADVISORY}.{self.stream(kind)}.{_token('durable', durable)}"

    def advisory_durable(self, kind: str, durable: str) -> str:
        """The ADVISORIES durable that follows ``max_deliveries_advisory(kind, durable)`` only."""
        if kind not in STREAM_KINDS:
            raise SubjectError(f"unknown stream kind {kind!r}; expected one of {STREAM_KINDS}")
        return f"rlbus_maxdel_{kind}_{_token('durable', durable)}".replace("-", "_")

    def durable(self, role: str, pool: str | None = None) -> str:
        name = f"{_token('role', role)}" + (f"_{_token('pool', pool)}" if pool else "")
        return name.replace("-", "_")

    @property
    def object_bucket(self) -> str:
        """Object store bucket for weight bytes and claim-checked payloads."""
        return f"rl_{self.run}_objects".replace("-", "_")

    @property
    def env_queue_group(self) -> str:
        return "environment"


DRAFT_SUFFIX = "-draft"


def draft_model_name(model: str) -> str:
    """The model name a run's draft model travels under (WEIGHTS and UPLOADS subject token): the
    speculator uploads it, weight-broadcast announces it, generators with drafter "model" follow it.
    One spelling, here, so the three cannot drift apart."""
    return _token("model", f"{_token('model', model)}{DRAFT_SUFFIX}")


def split_metrics_subject(subject: str) -> tuple[str, str]:
    """``rl.<run>.metrics.<service>.<instance>`` -> (service, instance)."""
    parts = subject.split(".")
    if len(parts) < 5 or parts[2] != "metrics":
        raise SubjectError(f"{subject!r} is not a metrics subject")
    return parts[3], parts[4]


def pool_of(subject: str) -> str:
    """The last token of a per-pool subject (tasks, rollouts, scored)."""
    return subject.rsplit(".", 1)[-1]
