"""Typed, strict configuration: one settings class per service, loaded TOML -> env.

A run config is one TOML file with a ``[run]`` table shared by every service and one table
per service (``[trainer]``, ``[generator]`` …), which may hold nested tables of its own
(``[trainer.objective]``).  Environment variables override it: ``RLBUS_RUN__MAX_STALENESS=2``,
``RLBUS_TRAINER__LR=1e-4``, and for a nested table one ``__`` per level:
``RLBUS_TRAINER__OBJECTIVE__IS_CAP=3``.  Unknown keys are errors (``extra="forbid"``) whose
message names the key with its table and lists the valid ones, so a typo never silently falls
back to a default; an invalid value's error names the key and quotes its documentation.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.dataclasses import is_pydantic_dataclass
from pydantic.fields import FieldInfo

S = TypeVar("S", bound="Settings")

_SECRET_WORDS = ("password", "token", "secret", "creds", "nkey")


class ConfigError(ValueError):
    """A configuration file or variable is wrong; the message says which key and how to fix it."""


class Settings(BaseModel):
    """Base of every settings class: strict, frozen, documented field by field."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    def redacted(self) -> dict[str, Any]:
        """The resolved config for the start-up log, with secrets masked."""
        out = self.model_dump(mode="json")
        for key in list(out):
            if any(w in key.lower() for w in _SECRET_WORDS) and out[key]:
                out[key] = "***"
            elif isinstance(out[key], str) and "://" in out[key] and "@" in out[key]:
                from rlbus.bus.urls import redact_url

                out[key] = redact_url(out[key])  # a URL's user:password@
        return out


MiB = 1024 * 1024


class RetentionSettings(Settings):
    """``[run.retention]``: how much each stream of the run may hold (``rlbus.bus.retention`` says what
    happens at each limit: work queues and DEAD refuse new messages with an error naming the
    stream and the key to raise; SCORED and CONTROL drop their oldest).  Changing a limit updates
    the live streams in place when a service next connects."""

    queue_max_msgs: int = Field(1_000_000, ge=100, le=1_000_000_000, description=(
        "Messages each work queue (TASKS, ROLLOUTS) may hold; past it publishers get StreamFull (back-pressure)."))
    queue_max_mib: int = Field(0, ge=0, le=1 << 20, description=(
        "MiB each work queue (TASKS, ROLLOUTS) may hold, 0 = no cap of its own; past it publishers get "
        "StreamFull. A byte cap reserves that much of the server's storage when the stream is made."))
    scored_keep_steps: int = Field(10_000, ge=8, le=1_000_000, description=(
        "Optimiser steps of scored groups SCORED keeps for replay (x batch_groups messages); the oldest go "
        "first, read or not: size it above any burst of scored groups published faster than the trainer "
        "reads them (10,000 x batch_groups by default; messages are small, bytes are claim-checked). "
        "Must be at least 4 x (max_staleness + 2) so only long-trained groups are dropped in a steady run."))
    scored_max_mib: int = Field(0, ge=0, le=1 << 20, description=(
        "MiB SCORED may hold, 0 = no cap of its own; past it the oldest groups go first: keep it well above what "
        "the trainer holds un-acked. A byte cap reserves that much of the server's storage."))
    control_per_subject: int = Field(1000, ge=10, le=1_000_000, description=(
        "Decisions kept per CONTROL subject (the audit trail); the latest of every subject is always kept."))
    dead_max_msgs: int = Field(100_000, ge=100, le=100_000_000, description=(
        "Dead letters DEAD may hold; past it a dead letter is refused and its message stays un-acked (retried)."))
    dead_max_mib: int = Field(0, ge=0, le=1 << 20, description=(
        "MiB DEAD may hold, 0 = no cap of its own; past it a dead letter is refused and its message stays "
        "un-acked (retried). A byte cap reserves that much of the server's storage."))
    objects_max_mib: int = Field(0, ge=0, le=1 << 24, description=(
        "MiB the run's object bucket (weights, claim-checked payloads) may hold; 0 = no cap of its own (a cap "
        "reserves that much of the server's storage). "
        "Past it a put fails with StreamFull; weight-broadcast deletes versions beyond its keep_versions."))


class RunSettings(Settings):
    """What every service of one run agrees on.  Few primary knobs; the rest is derived."""

    run: str = Field("demo", description="Run name: the namespace rl.<run>.… of every subject and stream.")
    nats_url: str = Field("nats://127.0.0.1:4222", description=(
        "NATS server URL, or the members of a cluster separated by commas (rlbus up sets it to its embedded server)."))
    nats_user: str = Field("", description=(
        "NATS user this service logs in as (its role, e.g. generator; `rlbus auth init` makes one per role); "
        "empty = no user/password login. Also sets the inbox prefix _INBOX.<user> the role is confined to."))
    nats_password_file: str = Field("", description=(
        "File whose first line is nats_user's password (`rlbus auth init` writes one, mode 0600); if empty the "
        "password comes from the environment variable RLBUS_NATS_PASSWORD. Never put the password itself here."))
    nats_creds_file: str = Field("", description="NATS .creds file (JWT + nkey seed) to log in with, instead of a user.")
    nats_nkey_seed_file: str = Field("", description="File holding an nkey seed (SU...) to log in with, instead of a user.")
    nats_tls_ca: str = Field("", description="CA bundle that signed the NATS server's certificate (turns TLS on).")
    nats_tls_cert: str = Field("", description="Client certificate for mutual TLS (with nats_tls_key).")
    nats_tls_key: str = Field("", description="Private key of nats_tls_cert.")
    model_name: str = Field("policy", description="Logical model name: the WEIGHTS subject token.")
    model_path: str = Field("models/tiny-addition", description="Hugging Face folder of the initial policy.")
    pools: list[str] = Field(default_factory=lambda: ["train"], description="Task pools that are trained on.")
    eval_pool: str = Field("eval", description="Pool of held-out tasks: scored and reported, never trained on.")
    group_size: int = Field(8, ge=1, le=1024, description="Samples per task (GRPO group).")
    batch_groups: int = Field(32, ge=1, description="Groups per optimiser step (prompts per step).")
    # 2, not 1: at 1 the generator may start batch V+1 only once weights V exist, so weight
    # hand-over and generation race every trainer step (idle 0.37 vs 0.12 at 2, with held-out
    # accuracy per step unchanged within noise: bench/staleness_sweep.py,
    # docs/measurements/staleness-sweep-cpu2-2026-12-02.md).
    max_staleness: int = Field(2, ge=0, le=64, description="Max policy versions between sampling and training (0 = on-policy).")
    run_dir: str = Field("runs/demo", description="Where metrics.jsonl, checkpoints, report.png and the final policy go.")
    retention: RetentionSettings = Field(default_factory=RetentionSettings, description=(
        "[run.retention]: stream and object-bucket limits; see RetentionSettings."))
    replicas: int = Field(1, ge=1, le=5, description=(
        "Copies of each stream and of the object bucket, kept on distinct servers of a NATS cluster: 1 on a "
        "single server (it cannot keep more), 3 on a 3-node cluster so that losing one node loses nothing. At "
        "most the cluster's servers; raising it on a live run's streams copies them in place at next connect."))
    publish_outage_s: float = Field(900.0, ge=1.0, le=86_400.0, description=(
        "Seconds a publish waits for an unreachable NATS server before the service gives up (its input stays "
        "un-acked and is redelivered): a server restart or outage shorter than this only pauses the run."))
    metrics_port: int = Field(0, ge=0, le=65_535, description=(
        "TCP port of the service's Prometheus endpoint (path /metrics, all interfaces), 0 = none. One process "
        "serves one port: replicas on one host each need their own, e.g. RLBUS_RUN__METRICS_PORT in each "
        "systemd instance's environment file."))

    @model_validator(mode="before")
    @classmethod
    def _no_clear_password(cls, data: Any) -> Any:
        if isinstance(data, dict) and "nats_password" in data:
            raise ValueError(
                "nats_password is not a key: a clear password does not belong in a config file (or its variable "
                "RLBUS_RUN__NATS_PASSWORD); put it in a 0600 file named by nats_password_file, or in the environment "
                "variable RLBUS_NATS_PASSWORD (`rlbus auth init` writes both forms)")
        return data

    @model_validator(mode="after")
    def _scored_outlives_the_window(self) -> RunSettings:
        need = 4 * (self.max_staleness + 2)
        if self.retention.scored_keep_steps < need:
            raise ValueError(
                f"[run.retention] scored_keep_steps = {self.retention.scored_keep_steps} is below 4 x (max_staleness + 2) "
                f"= {need}: SCORED would drop groups before they are trained; raise it to at least {need}")
        return self

    @field_validator("nats_url")
    @classmethod
    def _urls(cls, v: str) -> str:
        from rlbus.bus.urls import server_urls

        server_urls(v)  # raises naming the member that is no NATS URL
        return v

    @field_validator("run", "model_name")
    @classmethod
    def _token(cls, v: str) -> str:
        from rlbus.bus.subjects import Subjects

        Subjects(v)  # raises with a clear message on dots/wildcards
        return v

    @property
    def batch_samples(self) -> int:
        return self.batch_groups * self.group_size

    def bus_options(self) -> dict[str, Any]:
        """Keyword options of ``JetStreamBus.connect`` that come from the run config."""
        from rlbus.bus.retention import Retention

        r = self.retention
        retention = Retention(
            queue_max_msgs=r.queue_max_msgs, queue_max_bytes=r.queue_max_mib * MiB,
            scored_max_msgs=r.scored_keep_steps * self.batch_groups, scored_max_bytes=r.scored_max_mib * MiB,
            control_per_subject=r.control_per_subject, dead_max_msgs=r.dead_max_msgs,
            dead_max_bytes=r.dead_max_mib * MiB, objects_max_bytes=r.objects_max_mib * MiB,
            replicas=self.replicas,
        )
        return {"retention": retention, "publish_outage": self.publish_outage_s, "credentials": self.credentials()}

    def credentials(self) -> Any:
        """The login of this run's services (``rlbus.bus.credentials.Credentials``); reads the password file."""
        from rlbus.bus.credentials import Credentials

        return Credentials.build(
            user=self.nats_user, password_file=self.nats_password_file, creds_file=self.nats_creds_file,
            nkey_seed_file=self.nats_nkey_seed_file, tls_ca=self.nats_tls_ca, tls_cert=self.nats_tls_cert,
            tls_key=self.nats_tls_key)

    @property
    def admission_window_groups(self) -> int:
        """Groups that may be accepted or running beyond what the trainer consumed."""
        return (self.max_staleness + 1) * self.batch_groups


def _env_overrides(section: str) -> dict[str, Any]:
    """``RLBUS_<SECTION>__<KEY>`` variables as a dict, nested at each further ``__``.  A value is
    parsed as TOML (numbers, booleans, lists, inline tables), else taken as a bare string."""
    prefix = f"RLBUS_{section.upper()}__"
    out: dict[str, Any] = {}
    for key, raw in sorted(os.environ.items()):
        if not key.startswith(prefix):
            continue
        *tables, name = key[len(prefix):].lower().split("__")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # a bare string
        into = out
        for i, table in enumerate(tables):
            into = into.setdefault(table, {})
            if not isinstance(into, dict):
                where = ".".join([section, *tables[: i + 1]])
                raise ConfigError(f"{key} sets a key inside [{where}], but another variable sets {where} itself "
                                  "to a value: keep one of the two")
        into[name] = value
    return out


def _merged(base: dict[str, Any], over: dict[str, Any], where: str) -> dict[str, Any]:
    """``base`` with ``over`` laid on top, nested tables merged key by key (neither is changed)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and key in out:
            if not isinstance(out[key], dict):
                raise ConfigError(f"[{where}] {key} is a value in the config file, but an environment variable sets "
                                  f"keys inside it as the table [{where}.{key}]: make it a table in the file, or "
                                  "drop the variable")
            out[key] = _merged(out[key], value, f"{where}.{key}")
        else:
            out[key] = value
    return out


def read_toml(path: str | Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {p} does not exist; pass an existing TOML file or omit --config")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None


def load_section(cls: type[S], data: dict[str, Any], section: str) -> S:
    """Build ``cls`` from ``data[section]`` plus ``RLBUS_<SECTION>__*`` variables."""
    values = _merged(dict(data.get(section, {})), _env_overrides(section), section)
    try:
        return cls(**values)
    except ValidationError as exc:
        lines = [_describe(cls, section, err) for err in exc.errors()]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


_UNKNOWN = ("extra_forbidden", "unexpected_keyword_argument")


def _describe(cls: type, section: str, err: Any) -> str:
    """One validation error as ``[table.nested] key: what was wrong (got …) — its documentation``."""
    owner, table, loc = cls, section, list(err["loc"])
    # Walk into nested tables ([trainer.objective]) so the error names the table the key is in.
    while len(loc) > 1 and isinstance(loc[0], str) and (inner := _table_class(owner, loc[0])) is not None:
        owner, table, loc = inner, f"{table}.{loc[0]}", loc[1:]
    key = ".".join(str(p) for p in loc)
    if not key:
        return f"[{table}] {err['msg']}"
    if err["type"] in _UNKNOWN:
        return f"[{table}] unknown key '{key}'; valid keys: {', '.join(sorted(_fields(owner)))}"
    line = f"[{table}] {key}: {err['msg']} (got {err.get('input')!r})"
    field = _fields(owner).get(str(loc[0]))
    if field is not None and field.description:
        # The documentation says what the key means and why its bounds are what they are.
        line += " — " + " ".join(field.description.replace("``", "").split())
    return line


def _fields(owner: type) -> dict[str, FieldInfo]:
    return dict(getattr(owner, "__pydantic_fields__", None) or {})


def _table_class(owner: type, name: str) -> type | None:
    """The settings class of ``owner``'s field ``name`` when that field is a nested table."""
    field = _fields(owner).get(name)
    t = field.annotation if field is not None else None
    if isinstance(t, type) and (issubclass(t, BaseModel) or is_pydantic_dataclass(t)):
        return t
    return None


def load(path: str | Path | None, service_cls: type[S], section: str) -> tuple[RunSettings, S]:
    data = read_toml(path)
    return load_section(RunSettings, data, "run"), load_section(service_cls, data, section)
