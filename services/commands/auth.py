"""``rlbus auth init``: one NATS user per role of a run, each allowed only what its dataflow needs.

Writes, into ``--out`` (mode 0700):

- ``auth.conf``: an ``authorization { users = [...] }`` block for ``nats-server`` (``include`` it
  from the server config), passwords bcrypt-hashed;
- per role ``<role>.password`` (the password on one line, for ``[run] nats_password_file``) and
  ``<role>.env`` (``RLBUS_RUN__NATS_USER`` and ``RLBUS_NATS_PASSWORD``, for an env file), mode 0600.
  No password is ever printed.

Roles: the services of the catalog (``rlbus.services.catalog``) plus ``operator`` (``rlbus publish``, ``status``, ``streams``, ``control``
and stream administration).  What each service may publish and subscribe follows its module's
dataflow contract; the JetStream API subjects follow what the bus does for it (``rlbus.bus.connection``,
``rlbus.bus.streams``, ``rlbus.bus.objects``, ``rlbus.bus.advisories``):

| role        | publishes                              | consumes (durable)         | watches / reads last   | bucket |
|-------------|----------------------------------------|----------------------------|------------------------|--------|
| generator   | rollouts, env requests, replica steps  | TASKS generator_<pool>     | WEIGHTS, CONTROL       | yes    |
| environment | replies to env requests only           | (core request/reply)       |                        | no     |
| reward      | scored                                 | ROLLOUTS reward            |                        | yes    |
| trainer     | weight uploads (UPLOADS)               | SCORED trainer             | WEIGHTS (last)         | yes    |
| broadcast   | weight versions (policy and draft)     | UPLOADS broadcast, broadcast_draft | WEIGHTS, METRICS, CONTROL | yes |
| speculator  | draft weight uploads (UPLOADS)         | SCORED speculator          | WEIGHTS (last)         | yes    |
| controller  | control decisions, eval-pool tasks     |                            | CONTROL, METRICS, SCORED (held-out rounds), stream state | no |

The environment subscribes to the env request subjects in its queue group and to every replica's
step subject ``env.*.step.*`` (an episode's later steps go to the replica holding it; one user
serves all replicas, so the grant cannot name one instance); the generator may request both.

Every service also publishes its own heartbeats (``metrics.<role>.*``) and dead letters, and pulls,
for each durable it consumes, that durable's own max-deliveries advisory durable on ADVISORIES
(``Subjects.advisory_durable``), and none of another role's: an advisory names a message that only
the durable's role may read.  Consumers may also delete the one advisory durable a run made
before that split (``rlbus.bus.streams.LEGACY_ADVISORY_DURABLE``), which the first declaration removes.
Each user receives replies only on its own inbox prefix ``_INBOX.<role>`` (the bus sets it from
``nats_user``), so no role can subscribe to another's pulled messages or API replies.

Who declares streams: every role may CREATE, UPDATE and INFO the run's streams (and bucket users the
bucket's), because the bus declares them idempotently on connect, so services start in any order
with no admin step first.  No service may DELETE or PURGE a stream of the run: those are the
operator's.  The residual risk is that a compromised service could UPDATE a stream's limits or
subjects; servers that must rule that out can give services INFO only and run
``rlbus streams`` as the operator first (not automated here).  Bucket users may PURGE the object
bucket's stream: deleting an object (a released claim check, an old weight version) is a purge of
its chunk subject, and nats-server cannot restrict a purge by its filter.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rlbus.bus.credentials import inbox_prefix
from rlbus.bus.routing import WORK_QUEUES
from rlbus.bus.streams import LEGACY_ADVISORY_DURABLE
from rlbus.bus.subjects import ENV_OPS, STREAM_KINDS, Subjects, draft_model_name
from rlbus.services.catalog import SERVICES
from rlbus.services.runtime.config import ConfigError, RunSettings, load_section, read_toml

OPERATOR = "operator"
ROLES: tuple[str, ...] = (*SERVICES, OPERATOR)
# The hash keeps the passwords out of the server config.  They are 256-bit random tokens, so no
# work factor is needed against guessing; a high one only slows every login (the server checks
# the hash on each connect: cost 11 took 0.8 s on a loaded 2-core machine, and a few services
# logging in at once ran past nats-py's 2 s connect timeout).
BCRYPT_COST = 8
PASSWORD_BYTES = 32
API = "$JS.API"


@dataclass
class Grant:
    """One user's permissions, in the order they were added (duplicates dropped)."""

    publish: list[str] = field(default_factory=list)
    subscribe: list[str] = field(default_factory=list)
    allow_responses: bool = False

    def pub(self, *subjects: str) -> None:
        self.publish.extend(s for s in subjects if s not in self.publish)

    def sub(self, *subjects: str) -> None:
        self.subscribe.extend(s for s in subjects if s not in self.subscribe)


class RunPermissions:
    """The permissions of every role of one run, derived from the run's names."""

    def __init__(self, run_cfg: RunSettings) -> None:
        self.cfg = run_cfg
        self.s = Subjects(run_cfg.run)
        self.streams = [self.s.stream(k) for k in STREAM_KINDS] + [self.s.advisory_stream]
        self.bucket_stream = f"OBJ_{self.s.object_bucket}"
        self.pools = list(dict.fromkeys([*run_cfg.pools, run_cfg.eval_pool]))

    def all(self) -> dict[str, Grant]:
        return {role: self.of(role) for role in ROLES}

    def of(self, role: str) -> Grant:
        if role == OPERATOR:
            return self.operator()
        g = self.service_base(role)
        s, model = self.s, self.cfg.model_name
        draft = draft_model_name(model)
        if role == "generator":
            self.consume(g, "TASKS", [s.durable("generator", p) for p in self.pools])
            self.watch(g, "WEIGHTS", "CONTROL")
            g.pub(*(s.rollouts(p) for p in self.pools), *(s.env_any(op) for op in ENV_OPS), self.replica_steps())
            self.bucket(g)
        elif role == "environment":
            # Its replica's own step subject too; one user serves every replica (the instance names
            # are not known here), so the grant covers every replica's step subject.
            g.sub(*(s.env_any(op) for op in ENV_OPS), self.replica_steps())
            g.allow_responses = True  # its replies go to the requester's inbox, once each
        elif role == "reward":
            self.consume(g, "ROLLOUTS", [s.durable("reward")])
            g.pub(*(s.scored(p) for p in self.pools))
            self.bucket(g)
        elif role == "trainer":
            self.consume(g, "SCORED", [s.durable("trainer")])
            self.read_last(g, "WEIGHTS")
            g.pub(s.weight_uploads(model))
            self.bucket(g)
        elif role == "broadcast":
            self.consume(g, "UPLOADS", [s.durable("broadcast"), s.durable("broadcast-draft")])
            self.watch(g, "WEIGHTS", "METRICS", "CONTROL")
            g.pub(s.weights(model), s.weights(draft))
            self.bucket(g)
        elif role == "speculator":
            self.consume(g, "SCORED", [s.durable("speculator")])
            self.read_last(g, "WEIGHTS")  # its newest published draft, to resume from
            g.pub(s.weight_uploads(draft))
            self.bucket(g)
        elif role == "controller":
            # SCORED: it reads the held-out pool's scored groups (rl.<run>.scored.<eval_pool>) to score each
            # round; an ordered consumer's filter is in the request body, so the grant covers the stream.
            self.watch(g, "CONTROL", "METRICS", "SCORED")
            g.pub(s.all_of("control"), s.tasks(self.cfg.eval_pool))
            # The planner reads every stream's consumers (queue depths, lag): read-only listing.
            g.pub(*(f"{API}.CONSUMER.LIST.{st}" for st in self.streams))
        else:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        return g

    def replica_steps(self) -> str:
        """Every environment replica's own step subject (``Subjects.env_step``): an episode's later steps."""
        return f"{self.s.env_any('step')}.*"

    # --- building blocks ------------------------------------------------------------------
    def service_base(self, role: str) -> Grant:
        """What every service does: declare the run's streams (see the module docstring), publish its
        heartbeats and dead letters, get replies on its inbox."""
        g = Grant()
        for st in self.streams:
            g.pub(*(f"{API}.STREAM.{op}.{st}" for op in ("INFO", "CREATE", "UPDATE")))
        g.pub(self.s.metrics_of(role), f"{self.s.root}.dead.*")
        g.sub(f"{inbox_prefix(role)}.>")
        return g

    def consume(self, g: Grant, kind: str, durables: list[str]) -> None:
        """Pull from ``durables`` of one stream: declare and read them, ack, nak and heartbeat their
        messages; follow each one's max-deliveries advisories (``rlbus.bus.advisories``), read the message
        an advisory names by sequence to dead-letter it, and delete it then from a work queue."""
        st = self.s.stream(kind)
        self.pull(g, st, durables)
        self.pull(g, self.s.advisory_stream, [self.s.advisory_durable(kind, d) for d in durables])
        g.pub(f"{API}.CONSUMER.DELETE.{self.s.advisory_stream}.{LEGACY_ADVISORY_DURABLE}")
        g.pub(f"{API}.STREAM.MSG.GET.{st}")
        if kind in WORK_QUEUES:
            g.pub(f"{API}.STREAM.MSG.DELETE.{st}")

    @staticmethod
    def pull(g: Grant, st: str, durables: list[str]) -> None:
        """Declare ``durables`` of stream ``st``, pull from them, ack their messages."""
        for d in durables:
            g.pub(f"{API}.CONSUMER.DURABLE.CREATE.{st}.{d}", f"{API}.CONSUMER.CREATE.{st}.{d}",
                  f"{API}.CONSUMER.CREATE.{st}.{d}.>", f"{API}.CONSUMER.INFO.{st}.{d}",
                  f"{API}.CONSUMER.MSG.NEXT.{st}.{d}", f"$JS.ACK.{st}.{d}.>")

    def read_last(self, g: Grant, *kinds: str) -> None:
        """The newest message on a subject (``Bus.last``): a direct get."""
        for kind in kinds:
            st = self.s.stream(kind)
            g.pub(f"{API}.DIRECT.GET.{st}", f"{API}.DIRECT.GET.{st}.>")

    def watch(self, g: Grant, *kinds: str) -> None:
        """Ordered ephemeral push consumers (``Bus.watch``) and last-message reads of a limits stream.
        The filter is in the request body, not the subject, so the grant is per stream."""
        self.read_last(g, *kinds)
        for kind in kinds:
            st = self.s.stream(kind)
            g.pub(f"{API}.CONSUMER.CREATE.{st}", f"$JS.FC.{st}.>")

    def bucket(self, g: Grant) -> None:
        """The run's object bucket: weights and claim-checked payloads (put, get, delete)."""
        st = self.bucket_stream
        g.pub(f"$O.{self.s.object_bucket}.>",
              *(f"{API}.STREAM.{op}.{st}" for op in ("INFO", "CREATE", "UPDATE", "PURGE")),
              f"{API}.DIRECT.GET.{st}", f"{API}.DIRECT.GET.{st}.>", f"{API}.CONSUMER.CREATE.{st}.>",
              f"{API}.CONSUMER.DELETE.{st}.>", f"{API}.CONSUMER.MSG.NEXT.{st}.>", f"{API}.CONSUMER.INFO.{st}.>")

    def operator(self) -> Grant:
        """Administration of this run only: any API call on its streams and bucket (delete and purge
        included), any subject of the run; nothing of another run on the same server."""
        g = Grant()
        g.pub(f"{API}.INFO", f"{self.s.root}.>", f"$O.{self.s.object_bucket}.>")
        for st in [*self.streams, self.bucket_stream]:
            g.pub(f"{API}.STREAM.*.{st}", f"{API}.STREAM.MSG.*.{st}", f"{API}.CONSUMER.*.{st}",
                  f"{API}.CONSUMER.*.{st}.>", f"{API}.CONSUMER.DURABLE.CREATE.{st}.>", f"{API}.CONSUMER.MSG.NEXT.{st}.>",
                  f"{API}.DIRECT.GET.{st}", f"{API}.DIRECT.GET.{st}.>", f"$JS.ACK.{st}.>", f"$JS.FC.{st}.>")
        g.sub(f"{inbox_prefix(OPERATOR)}.>")
        return g


# --- files -------------------------------------------------------------------------------------
def auth_conf(grants: dict[str, Grant], hashes: dict[str, str], run: str) -> str:
    """The ``authorization`` block; every value quoted, so a ``$`` is never read as a variable."""
    q = json.dumps
    lines = [f"# Generated by `rlbus auth init` for run {run!r}: one user per role, least privilege",
             "# (services/commands/auth.py explains each grant). Include it from nats-server.conf.",
             "authorization {", "  users = ["]
    def allow(subjects: list[str]) -> list[str]:
        return [f"          {q(s)}," for s in subjects]

    for role, g in grants.items():
        lines += [f"    {{ user: {q(role)}, password: {q(hashes[role])}, permissions: {{",
                  "        publish: { allow: [", *allow(g.publish), "        ] },",
                  "        subscribe: { allow: [", *allow(g.subscribe), "        ] },"]
        if g.allow_responses:
            lines.append("        allow_responses: true")
        lines.append("    } }")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def _write_secret(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its old mode through O_CREAT


def init(out: str | Path, run_cfg: RunSettings, *, force: bool = False) -> dict[str, Path]:
    """Write the server's ``auth.conf`` and each role's secret files into ``out``; returns the
    paths by name.  Refuses to overwrite an existing ``auth.conf`` unless ``force`` (that rotates
    every password)."""
    import bcrypt  # deferred: only this command hashes

    out = Path(out)
    conf = out / "auth.conf"
    if conf.exists() and not force:
        raise FileExistsError(f"{conf} exists; pass --force to replace it (every role gets a new password)")
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    grants = RunPermissions(run_cfg).all()
    written: dict[str, Path] = {}
    hashes = {}
    for role in grants:
        password = secrets.token_urlsafe(PASSWORD_BYTES)
        hashes[role] = bcrypt.hashpw(password.encode(), bcrypt.gensalt(BCRYPT_COST)).decode()
        _write_secret(out / f"{role}.password", password + "\n")
        _write_secret(out / f"{role}.env", f"RLBUS_RUN__NATS_USER={role}\nRLBUS_NATS_PASSWORD={password}\n")
        written[f"{role}.password"] = out / f"{role}.password"
        written[f"{role}.env"] = out / f"{role}.env"
    conf.write_text(auth_conf(grants, hashes, run_cfg.run))
    written["auth.conf"] = conf
    return written


def auth_init_cmd(out: str, config: str | None, *, run: str | None = None, force: bool = False) -> int:
    try:
        data = read_toml(config)
        if run is not None:
            data["run"] = {**data.get("run", {}), "run": run}
        run_cfg = load_section(RunSettings, data, "run")
        written = init(out, run_cfg, force=force)
    except (ConfigError, FileExistsError) as exc:
        print(f"rlbus auth init: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {written['auth.conf']} for run {run_cfg.run!r} (include it from nats-server.conf) and, mode 0600, "
          f"one <role>.password and <role>.env per role in {Path(out)}: {', '.join(ROLES)}")
    print("each service: set [run] nats_user = \"<role>\" and nats_password_file = \"<out>/<role>.password\", "
          "or load <role>.env into its environment; the CLI tools read operator.env's variables")
    return 0
