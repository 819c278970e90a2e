"""Prometheus metrics of a service, read from the heartbeats it sends.

Every value here is a value of the service's own heartbeat (``services/runtime/heartbeat.py``
hands each ``Heartbeat`` it builds to ``observe``), so Prometheus, ``rlbus status``, the
controller and ``metrics.jsonl`` can never disagree about a number: there is one source.

Why a collector rendering the latest heartbeat at scrape time, not ``Gauge.set``/``Counter.inc``
at each beat: the heartbeat already carries cumulative counts (``trainer/groups_trained_total``,
``generator/groups_published``), and a ``prometheus_client.Counter`` can only be incremented, so
it would be a second count kept beside the service's own.  Rendered from the heartbeat, a counter
*is* the service's count; one that restarts from zero with its process is a counter reset, which
``rate()`` and ``increase()`` handle.

``MAPPED`` names each heartbeat key Prometheus sees under a metric of its own (``rlbus_`` prefix,
path segments that vary, such as a pool or a generator instance, as labels); every other key of
a heartbeat is still exported, as ``rlbus_heartbeat_value{key="…"}``, so a metric a service adds
is visible before it is given a name here.  Every sample carries ``service``, ``instance`` and
``run`` labels.  ``exposed_names`` lists every metric name this module can produce, which the
Grafana dashboard test checks its queries against.

The HTTP endpoint (``MetricsEndpoint``, path ``/metrics``) is started by ``rlbus serve`` when
``[run] metrics_port`` is set; one process serves one port, so replicas on one host each need
their own (``RLBUS_RUN__METRICS_PORT`` in each instance's environment).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from rlbus.schemas import Heartbeat
from rlbus.schemas.metric_keys import OUTCOMES, STALE_HELD

PREFIX = "rlbus_"
BASE_LABELS = ("service", "instance", "run")
# Values a placeholder may take; one not listed here matches any single path segment.  Outcomes
# are spelled out so ``trainer/groups_trained_total`` is not read as outcome "trained_total".
_PLACEHOLDER_VALUES = {"outcome": "|".join((*OUTCOMES, STALE_HELD))}

Kind = Literal["counter", "gauge"]


@dataclass(frozen=True)
class Mapped:
    """One heartbeat key (``{label}`` segments match a varying part, kept as that label) and the
    metric it is exported as: ``rlbus_<name>``, a counter (exposed with ``_total``) or a gauge."""

    key: str
    name: str
    kind: Kind
    doc: str

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(re.findall(r"\{(\w+)\}", self.key))

    @property
    def exposed(self) -> str:
        """The sample name a scrape shows (what a PromQL query names)."""
        return PREFIX + self.name + ("_total" if self.kind == "counter" else "")

    def pattern(self) -> re.Pattern[str]:
        parts = re.split(r"(\{\w+\})", self.key)
        rx = "".join(f"(?P<{p[1:-1]}>{_PLACEHOLDER_VALUES.get(p[1:-1], '[^/]+')})" if p.startswith("{")
                     else re.escape(p) for p in parts)
        return re.compile(rx + r"\Z")


def _c(key: str, name: str, doc: str) -> Mapped:
    return Mapped(key, name, "counter", doc)


def _g(key: str, name: str, doc: str) -> Mapped:
    return Mapped(key, name, "gauge", doc)


MAPPED: tuple[Mapped, ...] = (
    # generator (services/generator/core.py, torch_backend.py, vllm_backend.py)
    _c("generator/groups_started", "generator_groups_started", "Groups this generator process started"),
    _c("generator/groups_published", "generator_groups_published", "Rollout groups this generator process published"),
    _c("generator/pool/{pool}/published", "generator_pool_groups_published", "Rollout groups published, by pool"),
    _c("generator/eval_groups_published", "generator_eval_groups_published", "Held-out groups published"),
    _g("generator/groups_per_s", "generator_groups_per_second", "Groups published per second (recent window)"),
    _g("generator/in_flight", "generator_groups_in_flight", "Groups being generated now"),
    _g("generator/concurrency", "generator_concurrency_groups", "Groups per batch the controller allows now"),
    _g("generator/grant_total", "generator_grant_groups", "Cumulative admission grant of this boot (2^40: admission off)"),
    _g("generator/paused", "generator_paused", "1 while the controller holds this generator paused"),
    _g("generator/min_version", "generator_min_version", "Oldest policy version the controller lets it sample with"),
    _c("generator/dead_lettered", "generator_dead_lettered", "Tasks and weight versions this generator dead-lettered"),
    _c("generator/tasks_redelivered", "generator_tasks_redelivered", "Tasks it received more than once"),
    _c("generator/tokens", "generator_tokens", "Completion tokens sampled"),
    _c("generator/prefill_tokens", "generator_prefill_tokens", "Episode tokens prefilled by the PyTorch episode engine"),
    _c("generator/prefill_reused_tokens", "generator_prefill_reused_tokens",
       "Episode tokens not prefilled again because the row's KV cache was kept across turns"),
    _c("generator/kv_rebuilds", "generator_kv_rebuilds", "Episode KV caches dropped by a weight swap (rebuilt at the next turn)"),
    _c("generator/swaps", "generator_weight_swaps", "Weight versions swapped into the sampler"),
    _g("generator/swap_pause_last_s", "generator_weight_swap_pause_last_seconds", "Sampling pause of the last weight swap"),
    _g("generator/swap_pause_max_s", "generator_weight_swap_pause_max_seconds", "Longest sampling pause of a weight swap"),
    _g("generator/weight_load_last_s", "generator_weight_load_last_seconds", "Seconds the last weight load took (vLLM)"),
    _c("generator/weights_refused", "generator_weights_refused", "Weight versions refused (unreadable or mismatched)"),
    _c("generator/weights_skipped", "generator_weights_skipped", "Weight versions skipped for a newer one"),
    # speculative decoding on the generator (torch_backend.py, weight_follower.py)
    _g("generator/spec/{measure}", "generator_speculative",
       "The last sampler call's speculative tail (acceptance_rate, mean_accepted_len, tokens_per_forward, k …)"),
    _g("generator/draft_version", "generator_draft_version", "Draft model version in the drafting rounds (drafter model)"),
    _g("generator/draft_version_lag", "generator_draft_version_lag",
       "Policy version minus the policy version the draft in use was distilled on"),
    _c("generator/draft_refused", "generator_draft_refused", "Draft versions refused (unreadable or mismatched)"),
    # speculator (services/speculator: the draft's online distillation; schemas/metric_keys.py SpeculatorKeys)
    _c("speculator/steps", "speculator_steps", "Distillation steps of the draft model"),
    _g("speculator/distill_loss", "speculator_distill_loss", "Loss per trained token of the latest distillation step"),
    _c("speculator/samples", "speculator_samples", "Rollouts taken in for distillation"),
    _c("speculator/samples_dropped", "speculator_samples_dropped", "Buffered rollouts pushed out by newer ones"),
    _c("speculator/groups", "speculator_groups", "Scored groups taken in"),
    _c("speculator/groups_skipped", "speculator_groups_skipped", "Scored groups not distilled on (another temperature, greedy)"),
    _c("speculator/groups_dead", "speculator_groups_dead", "Scored groups dead-lettered: they cannot be distilled on"),
    _g("speculator/published_version", "speculator_published_version", "Newest draft version handed to weight-broadcast"),
    _g("speculator/policy_version", "speculator_policy_version", "Newest policy version seen in a scored group"),
    _g("speculator/policy_version_lag", "speculator_policy_version_lag",
       "Newest policy version seen minus the one the newest published draft was distilled on"),
    # trainer (services/trainer/telemetry.py: counters; step.py, objective.py, mismatch.py: each step)
    _g("trainer/step", "trainer_step", "Optimiser steps taken in this run"),
    _g("trainer/version", "trainer_version", "Policy version of the latest step"),
    _c("trainer/groups_trained_total", "trainer_groups_trained", "Groups trained in this run (continues from the checkpoint)"),
    _c("trainer/groups_dropped_total", "trainer_groups_dropped", "Groups dropped in this run (stale, invalid, refused)"),
    _c("trainer/rollouts_stale_total", "trainer_rollouts_stale", "Rollouts that arrived past max_staleness"),
    _c("trainer/groups_{outcome}", "trainer_groups_judged", "Groups judged by this trainer process, by outcome"),
    _c("trainer/pool/{pool}/groups_{outcome}", "trainer_pool_groups_judged", "Groups judged, by pool and outcome"),
    _c("trainer/generator/{generator}/groups_{outcome}", "trainer_generator_groups_judged",
       "Groups judged, by the generator instance that made them and outcome"),
    _g("trainer/pending_groups", "trainer_pending_groups", "Groups kept, waiting for the next batch"),
    _g("trainer/unacked_groups", "trainer_unacked_groups", "Groups trained, not yet acked (until a checkpoint covers them)"),
    _g("trainer/idle_fraction", "trainer_idle_fraction", "Share of wall time spent waiting for a batch"),
    _c("trainer/idle_s", "trainer_idle_seconds", "Seconds this trainer process waited for a batch"),
    _g("staleness/mean", "trainer_staleness_mean", "Mean staleness (policy versions) of the latest batch's rollouts"),
    _g("staleness/max", "trainer_staleness_max", "Largest staleness in the latest batch"),
    _g("staleness/hist_{versions}", "trainer_staleness_rollouts",
       "Rollouts of the latest batch at each staleness (versions=0..4, 5plus)"),
    _g("mismatch/{measure}", "trainer_mismatch", "Training-inference mismatch of the latest batch (k3_kl, abs_diff_mean …)"),
    _g("mismatch_fresh/{measure}", "trainer_mismatch_fresh",
       "The same on fresh (staleness 0) samples only: the numerical gap without staleness"),
    _g("mismatch_exact/{measure}", "trainer_mismatch_exact",
       "Deterministic mode: the gap on fresh samples labelled exact (0 when exactness holds) and the tokens outside it"),
    _g("batch/reward_mean", "trainer_batch_reward_mean", "Mean reward of the latest batch"),
    _g("batch/accuracy", "trainer_batch_accuracy", "Share of the latest batch's rollouts with reward >= 1"),
    _g("batch/completion_len", "trainer_batch_completion_tokens", "Mean completion length of the latest batch"),
    _g("batch/groups", "trainer_batch_groups", "Groups in the latest batch"),
    _g("batch/rollouts_trained", "trainer_batch_rollouts", "Rollouts trained in the latest batch"),
    _g("loss/{part}", "trainer_loss", "Loss of the latest step (pg, kl)"),
    _g("clip/{measure}", "trainer_clip", "Clipped token fractions of the latest step"),
    _g("is/{measure}", "trainer_importance", "Importance-sampling statistics of the latest step"),
    _g("train/grad_norm", "trainer_grad_norm", "Gradient norm of the latest step"),
    _g("train/tokens", "trainer_batch_loss_tokens", "Tokens in the latest step's loss"),
    _g("train/step_s", "trainer_step_seconds", "Seconds of the latest step's forward/backward/optimiser"),
    _g("time/step_total_s", "trainer_step_total_seconds", "Seconds of the latest step, hand-over and checkpoint included"),
    _g("time/weight_upload_s", "trainer_weight_upload_seconds", "Seconds the previous version's weight upload took"),
    _g("time/checkpoint_s", "trainer_checkpoint_seconds", "Seconds the latest step's checkpoint took (0: none)"),
    # controller (services/controller/balance.py: C, P, E; state.py: queues; stall.py; divergence.py)
    _g("controller/balance/consumption", "controller_consumption_groups_per_second", "C: groups the trainer trains per second"),
    _g("controller/balance/production", "controller_production_groups_per_second", "P: groups the generators publish per second"),
    _g("controller/balance/effective", "controller_effective_groups_per_second",
       "E: production x the share of arrivals actually trained"),
    _g("controller/balance/kept_fraction", "controller_kept_fraction", "Share of arrivals that pass the filter"),
    _g("controller/balance/usable_fraction", "controller_usable_fraction", "Share of arrivals kept and in time"),
    _g("controller/balance/stale_fraction", "controller_stale_fraction", "Share of arrivals that came too stale"),
    _g("controller/balance/trainer_idle", "controller_trainer_idle_fraction", "Recent share of time the trainer waited"),
    _g("controller/pool/{pool}/consumption", "controller_pool_consumption_groups_per_second", "C per pool"),
    _g("controller/pool/{pool}/production", "controller_pool_production_groups_per_second", "P per pool"),
    _g("controller/pool/{pool}/effective", "controller_pool_effective_groups_per_second", "E per pool"),
    _g("controller/pool/{pool}/kept_fraction", "controller_pool_kept_fraction", "Kept fraction per pool"),
    _g("controller/generator/{generator}/effective_rate", "controller_generator_effective_groups_per_second",
       "Published rate of a generator while it had work"),
    _g("controller/generator/{generator}/latency_s", "controller_generator_latency_seconds",
       "Seconds a group takes on a generator (Little's law)"),
    _g("controller/target/{pool}", "controller_target_mix", "Target share of each pool in training"),
    _g("controller/trained_since_target/{pool}", "controller_trained_since_target", "Groups trained per pool since the mix was set"),
    _g("controller/trainer_version", "controller_trainer_version", "Trainer version the controller last saw"),
    _g("controller/live_generators", "controller_live_generators", "Generators heard from recently"),
    _g("controller/allowed_total", "controller_allowed_groups", "Cumulative groups the controller admits"),
    _g("controller/started_total", "controller_started_groups", "Cumulative groups the generators started"),
    _g("controller/trained_bound", "controller_trained_bound_groups", "Trained groups the admission bound rests on"),
    _g("controller/oversample", "controller_oversample", "Over-sampling factor (1/usable fraction)"),
    _g("controller/stall_s", "controller_stall_seconds", "Seconds without training progress (0: progressing)"),
    _g("controller/divergence", "controller_divergence",
       "1 while training reward rises and held-out accuracy falls over the window (divergence.py)"),
    _g("controller/divergence/reward_trend", "controller_divergence_reward_trend",
       "Change of the training reward's fitted line across the divergence window"),
    _g("controller/divergence/heldout_trend", "controller_divergence_heldout_trend",
       "Change of held-out accuracy's fitted line across the divergence window"),
    _g("controller/divergence/heldout_readings", "controller_divergence_heldout_readings",
       "Held-out rounds inside the divergence window"),
    _c("controller/heartbeat_values_skipped", "controller_heartbeat_values_skipped", "Heartbeat values it could not use"),
    _g("controller/queue/scored/pending", "queue_scored_pending", "Scored groups the trainer has not pulled yet"),
    _g("controller/queue/scored/ack_pending", "queue_scored_ack_pending", "Scored groups pulled by the trainer, not acked"),
    _g("controller/queue/rollouts/pending", "queue_rollouts_pending", "Rollout groups the reward service has not pulled"),
    _g("controller/queue/tasks/{pool}/pending", "queue_tasks_pending", "Tasks not yet delivered to a generator, by pool"),
    _g("controller/queue/tasks/{pool}/ack_pending", "queue_tasks_ack_pending", "Tasks delivered, not acked, by pool"),
    _g("controller/queue/tasks/{pool}/redelivered", "queue_tasks_redelivered", "Tasks delivered more than once, by pool"),
    _g("controller/queue/dead/messages", "dead_letters", "Messages on the run's DEAD stream (each with its reason)"),
    # reward, environment, weight-broadcast
    _c("reward/groups", "reward_groups", "Rollout groups scored"),
    _c("reward/rollouts", "reward_rollouts", "Rollouts scored"),
    _c("reward/verifier_errors", "reward_verifier_errors", "Verifier calls that raised"),
    _g("reward/mean", "reward_mean", "Mean reward of every rollout this process scored"),
    _c("environment/served", "environment_requests", "Environment requests answered"),
    _c("environment/errors", "environment_errors", "Environment requests that failed"),
    _g("broadcast/latest", "broadcast_latest_version", "Newest weight version published"),
    _g("broadcast/retained", "broadcast_retained_versions", "Weight versions kept in the object store"),
    _c("broadcast/refused", "broadcast_refused", "Weight uploads refused (failed verification)"),
    _c("broadcast/deleted", "broadcast_deleted", "Weight versions deleted"),
    _c("broadcast/verify_seconds", "broadcast_verify_seconds", "Seconds spent verifying uploads"),
    _g("broadcast/draft/{measure}", "broadcast_draft",
       "The draft model's versions (latest, retained, refused, deleted, verify_seconds)"),
    _c("broadcast/claims_collected", "claims_collected", "Claim-checked payloads deleted: no held message referenced them"),
    _c("broadcast/orphan_chunks_collected", "orphan_chunks_collected",
       "Object chunks no record named (a put or delete cut short) deleted"),
    _g("broadcast/claims_kept", "claims_kept", "Claim-checked payloads in the object store at the last collection"),
    _c("broadcast/claim_collection_failures", "claim_collection_failures", "Claim collections that failed (retried later)"),
)

# Of the heartbeat itself, not of its metrics.
HEARTBEAT_FAMILIES = {
    "heartbeat_seq": "Heartbeats sent by this process (the latest seq)",
    "heartbeat_timestamp_seconds": "Wall time of the latest heartbeat",
    "policy_version": "Policy version this service works with (heartbeat version; -1: none yet)",
    "service_state": "1 for the service's current state (starting, running, done, stopped …)",
    "heartbeat_value": "A heartbeat metric with no name of its own here, by its heartbeat key",
}


def exposed_names() -> frozenset[str]:
    """Every metric name a scrape of this module's collector can show."""
    return frozenset({m.exposed for m in MAPPED} | {PREFIX + n for n in HEARTBEAT_FAMILIES})


class HeartbeatCollector(Collector):
    """Keeps the latest heartbeat of each (service, instance) and renders it at each scrape.

    ``observe`` runs on the service's event loop, ``collect`` on the HTTP server's thread: a lock
    keeps the two apart (a heartbeat's metrics dict is its own copy, never changed after)."""

    def __init__(self, run: str) -> None:
        self.run = run
        self._latest: dict[tuple[str, str], Heartbeat] = {}
        self._lock = threading.Lock()
        self._exact = {m.key: m for m in MAPPED if not m.labels}
        self._patterns = [(m, m.pattern()) for m in MAPPED if m.labels]

    def observe(self, hb: Heartbeat) -> None:
        with self._lock:
            self._latest[(hb.service, hb.instance)] = hb

    def match(self, key: str) -> tuple[Mapped, dict[str, str]] | None:
        """The mapping of a heartbeat key and its labels from the key's path, None if unmapped."""
        mapped = self._exact.get(key)
        if mapped is not None:
            return mapped, {}
        for mapped, rx in self._patterns:
            hit = rx.match(key)
            if hit is not None:
                return mapped, hit.groupdict()
        return None

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            beats = list(self._latest.values())
        families: dict[str, Metric] = {}
        for hb in beats:
            self._render(hb, families)
        yield from families.values()

    def _render(self, hb: Heartbeat, families: dict[str, Metric]) -> None:
        base = [hb.service, hb.instance, self.run]
        own = [("heartbeat_seq", {}, float(hb.seq)), ("heartbeat_timestamp_seconds", {}, hb.ts),
               ("policy_version", {}, float(hb.version)), ("service_state", {"state": hb.state}, 1.0)]
        for name, labels, value in own:
            fam = _family(families, PREFIX + name, "gauge", HEARTBEAT_FAMILIES[name], tuple(labels))
            fam.add_metric(base + list(labels.values()), value)
        for key, value in hb.metrics.items():
            found = self.match(key)
            if found is None:
                fam = _family(families, PREFIX + "heartbeat_value", "gauge", HEARTBEAT_FAMILIES["heartbeat_value"],
                              ("key",))
                fam.add_metric(base + [key], float(value))
                continue
            mapped, labels = found
            fam = _family(families, PREFIX + mapped.name, mapped.kind, mapped.doc, mapped.labels)
            fam.add_metric(base + [labels[name] for name in mapped.labels], float(value))


def _family(families: dict[str, Metric], name: str, kind: Kind, doc: str, labels: tuple[str, ...]) -> Metric:
    fam = families.get(name)
    if fam is None:
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        fam = families[name] = cls(name, doc, labels=[*BASE_LABELS, *labels])
    return fam


class MetricsError(RuntimeError):
    """The metrics endpoint could not be served; the message says why and what to change."""


class MetricsEndpoint:
    """``/metrics`` over HTTP on ``port`` (all interfaces, so a scraper in another container or on
    another host reaches it): the heartbeat collector and the process's CPU and memory."""

    def __init__(self, port: int, *, run: str, addr: str = "0.0.0.0") -> None:
        self.port = port
        self.addr = addr
        self.registry = CollectorRegistry()
        self.heartbeats = HeartbeatCollector(run)
        self.registry.register(self.heartbeats)
        ProcessCollector(registry=self.registry)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            self._server, self._thread = start_http_server(self.port, addr=self.addr, registry=self.registry)
        except OSError as exc:
            raise MetricsError(
                f"cannot serve Prometheus metrics on {self.addr}:{self.port}: {exc.strerror or exc}; another "
                "process (another replica on this host?) may hold the port: give each instance its own "
                "[run] metrics_port (RLBUS_RUN__METRICS_PORT in its environment), or 0 to serve none") from exc

    def stop(self) -> None:
        """Stop serving and free the port; safe to call twice."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


# The endpoint of this process, if ``serve_metrics`` started one.  Process-wide like the tracer
# provider (observability/tracing.py): the heartbeat is built deep inside each service, and one
# process serves one endpoint whatever services it runs.
_ENDPOINT: MetricsEndpoint | None = None


def serve_metrics(port: int, *, run: str) -> MetricsEndpoint:
    """Start this process's ``/metrics`` endpoint; heartbeats from now on are exported."""
    global _ENDPOINT
    if _ENDPOINT is not None:
        raise MetricsError(f"this process already serves metrics on port {_ENDPOINT.port}; stop it first")
    endpoint = MetricsEndpoint(port, run=run)
    endpoint.start()
    _ENDPOINT = endpoint
    return endpoint


def stop_metrics() -> None:
    """Stop this process's endpoint, if any; safe to call twice."""
    global _ENDPOINT
    endpoint, _ENDPOINT = _ENDPOINT, None
    if endpoint is not None:
        endpoint.stop()


def observe(hb: Heartbeat) -> None:
    """Export this heartbeat's values (nothing when no endpoint is served)."""
    if _ENDPOINT is not None:
        _ENDPOINT.heartbeats.observe(hb)
