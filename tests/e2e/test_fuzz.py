"""Fuzz every consumed subject of one real run (tests/e2e/fuzz.py makes the cases).

The promise (DESIGN invariant 5): bad input never kills a service, and nothing is dropped
silently.  Each target gets ``RLBUS_FUZZ_N`` cases (default 10,000; ``RLBUS_FUZZ_ONLY`` = a comma
list of targets), published while valid tasks are in flight.  Afterwards:

- every service process is alive and heartbeating;
- a case the decoder refuses is in DEAD (same subject, same bytes) with a reason, for the work
  streams and for the watched subjects alike;
- a decodable hostile case is accounted for: tasks and rollouts reached SCORED or DEAD; scored
  groups are in DEAD, the trainer's ledger, or still held un-acked by it; uploads are in DEAD
  (refused by weight-broadcast with the reason) or no newer than the version it announces (a
  duplicate of a version it has, acked and dropped);
- every environment request got a decodable reply, with an error when the request was bad;
- the valid tasks published amid the fuzz are scored, not dead-lettered, and after the fuzz a
  fresh wave is scored and the trainer steps.

Violations are collected and reported together, with subject, case kind and the logs' tails.
Uploads have their own work queue (UPLOADS, ``rlbus.bus.streams``), which keeps every upload until
weight-broadcast acks it, so all N go in one go like the other work streams.  Published manifests
(``weights``) still go in small lots, each read before the next, within a time budget (the count
reached is reported): WEIGHTS is a limits stream keeping the last 1,024 per subject for its
readers, the generators' ordered watches, which skip what the stream discarded before they got
to it; a burst larger than that can drop a forged manifest before a generator has read it, and
it would then be neither processed nor in DEAD: this test could not tell it from a lost one.  In a real run only weight-broadcast publishes there, one manifest per version.
All N manifest cases go through the generator's weight follower in one process instead
(tests/unit/test_weight_follower_fuzz.py), each accounted for exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter, defaultdict
from typing import Any

import msgpack
import pytest

from rlbus.bus.subjects import Subjects
from rlbus.schemas import DeadLetter, EnvReply, EnvReplyBatch, SchemaError, ScoredGroup
from rlbus.services.catalog import SINGLETONS
from tests.e2e import fuzz
from tests.e2e.harness import Pipeline, checkpoint_state, wait_heartbeat

pytestmark = [pytest.mark.slow, pytest.mark.integration]

N = int(os.environ.get("RLBUS_FUZZ_N", "10000"))
ONLY = [t for t in os.environ.get("RLBUS_FUZZ_ONLY", "").split(",") if t] or list(fuzz.TARGETS)
WORK = ("tasks", "rollouts", "scored", "uploads")  # durable work queues and SCORED, published in one go
PACED = ("weights",)  # WEIGHTS keeps the last 1,024 per subject: small lots, each read first (see above)
WATCHED = ("control_gen", "control_ctl", "metrics")
LOT = 4
PACE_BUDGET_S = 60.0
ENV_IN_FLIGHT = 200
SETTLE_S = 300.0
STEP_TIMEOUT = 300.0


def _tables(model: str) -> dict:
    return {
        "run": {"run": fuzz.RUN, "model_path": model, "batch_groups": 8, "group_size": 8, "max_staleness": 1},
        "trainer": {"lr": 1e-4, "ack_wait": 4.0, "checkpoint_every": 2},
        "controller": {"eval_every": 0},
        "generator": {"max_batch_groups": 8},
        "broadcast": {}, "reward": {}, "environment": {},
    }


class DeadLog:
    """Every dead letter of the run as it arrives: (origin subject, bytes) counted, and the task ids
    the letters carry (from their raw bytes, which need not decode)."""

    def __init__(self, bus) -> None:
        self.by_bytes: Counter[tuple[str, bytes]] = Counter()
        self.task_ids: set[str] = set()
        self.no_reason: list[str] = []
        self.count = 0
        self._watch = bus.watch(bus.subjects.all_of("dead"), deliver="all")
        self.task = asyncio.create_task(self._follow())

    async def _follow(self) -> None:
        async for d in self._watch:
            letter = DeadLetter.decode(d.msg)
            self.count += 1
            self.by_bytes[(letter.origin_subject, letter.data)] += 1
            if not (letter.reason and letter.error):
                self.no_reason.append(f"{letter.origin_subject}: reason={letter.reason!r} error={letter.error!r}")
            tid = task_id_of(letter.data)
            if tid:
                self.task_ids.add(tid)

    def has(self, case: fuzz.Case) -> bool:
        return self.by_bytes[(case.subject, case.data)] > 0

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self._watch.aclose()


def task_id_of(data: bytes) -> str:
    with contextlib.suppress(Exception):
        m = msgpack.unpackb(data, raw=False)
        if "task" in m:
            return str(m["task"]["task_id"])
        if "tasks" in m:
            return str(m["tasks"][0]["task_id"])
        return str(m["task_id"])
    return ""


class Report:
    """Violations, collected so one run lists them all."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.counts: dict[str, Counter[str]] = defaultdict(Counter)

    def bad(self, what: str, case: fuzz.Case | None = None) -> None:
        where = f" [{case.subject} {case.msg_id} {case.kind}]" if case else ""
        self.problems.append(what + where)

    def summary(self, limit: int = 12) -> str:
        by_what: dict[str, list[str]] = defaultdict(list)
        for p in self.problems:
            by_what[p.split(" [")[0]].append(p)
        lines = [f"{len(v)} x {k}\n    e.g. " + "\n    e.g. ".join(v[:3]) for k, v in by_what.items()]
        return "\n".join(lines[:limit * 4])


async def publish_work(bus, cases: list[fuzz.Case]) -> None:
    for i in range(0, len(cases), 500):
        await bus.publish_many([(c.subject, c.data, c.msg_id) for c in cases[i:i + 500]])


async def publish_paced(bus, dead: DeadLog, cases: list[fuzz.Case]) -> int:
    """Lots of ``LOT``; the next lot only once this one is read (its undecodable cases are in
    DEAD).  Returns how many were published."""
    deadline = time.monotonic() + PACE_BUDGET_S
    sent = 0
    while sent < len(cases) and time.monotonic() < deadline:
        lot = cases[sent:sent + LOT]
        await bus.publish_many([(c.subject, c.data, c.msg_id) for c in lot])
        sent += len(lot)
        lot_deadline = min(deadline, time.monotonic() + 5.0)
        while time.monotonic() < lot_deadline:
            if all(c.decodes or dead.has(c) for c in lot):
                break
            await asyncio.sleep(0.02)
    return sent


async def env_requests(bus, cases: list[fuzz.Case], report: Report) -> None:
    gate = asyncio.Semaphore(ENV_IN_FLIGHT)
    await asyncio.gather(*(env_one(bus, c, gate, report) for c in cases))


async def env_one(bus, case: fuzz.Case, gate: asyncio.Semaphore, report: Report) -> None:
    async with gate:
        try:
            raw = await bus.request(case.subject, case.data, timeout=60.0)
        except Exception as exc:  # any bus failure is a finding here, reported with the case
            report.bad(f"env request failed: {type(exc).__name__}: {str(exc)[:120]}", case)
            return
    try:
        if case.target == "env_reset_batch":
            batch = EnvReplyBatch.decode(raw)
            errored = bool(batch.error) or (bool(batch.replies) and all(r.error for r in batch.replies))
        else:
            errored = bool(EnvReply.decode(raw).error)
    except SchemaError as exc:
        report.bad(f"env reply does not decode: {str(exc)[:120]}", case)
        return
    if not case.decodes and not errored:
        report.bad("env answered a bad request without an error", case)


async def scored_ids(bus, p: Pipeline) -> set[str]:
    """Task ids of every decodable group on SCORED (the stream keeps them)."""
    total = next(x.messages for x in await bus.streams() if x.name == p.subjects.stream("SCORED"))
    out: set[str] = set()
    seen = 0
    w = bus.watch(p.subjects.scored(fuzz.POOL), deliver="all")
    try:
        async with asyncio.timeout(120):
            async for d in w:
                seen += 1
                with contextlib.suppress(SchemaError):
                    out.add(ScoredGroup.decode(d.msg).task.task_id)
                if seen >= total:
                    break
    finally:
        await w.aclose()
    return out


async def settle(bus, p: Pipeline) -> dict[str, Any]:
    """Wait until the work queues are empty and the trainer and broadcast hold nothing pending."""
    s = p.subjects
    deadline = time.monotonic() + SETTLE_S
    while True:
        streams = {x.name: x for x in await bus.streams()}
        cons = {c.name: c for x in streams.values() for c in x.consumers}
        trainer, broadcast = cons.get(s.durable("trainer")), cons.get(s.durable("broadcast"))
        seen = dict(tasks=streams[s.stream("TASKS")].messages, rollouts=streams[s.stream("ROLLOUTS")].messages,
                    scored_pending=trainer.pending if trainer else -1,
                    trainer_ack_pending=trainer.ack_pending if trainer else -1,
                    uploads_pending=(broadcast.pending + broadcast.ack_pending) if broadcast else -1)
        if seen["tasks"] == seen["rollouts"] == seen["scored_pending"] == seen["uploads_pending"] == 0:
            return seen
        if any(c.proc.poll() is not None for c in p.children.children):
            seen["service_died"] = 1  # the queues cannot drain without it: report instead of waiting
            return seen
        if time.monotonic() > deadline:
            seen["timed_out"] = 1
            return seen
        await asyncio.sleep(1.0)


def alive(p: Pipeline, report: Report) -> None:
    for c in p.children.children:
        if c.proc.poll() is not None:
            report.bad(f"service {c.name} died (exit {c.proc.returncode}): {c.tail(15)[-1500:]}")


async def heartbeating(bus, p: Pipeline, since: float, report: Report) -> None:
    for name in [*SINGLETONS, "gen-0"]:
        service = "generator" if name.startswith("gen-") else name
        try:
            await wait_heartbeat(bus, lambda h, sv=service: h.service == sv and h.ts > since, timeout=60)
        except AssertionError as exc:  # wait_heartbeat's timeout, with every service's last words
            report.bad(f"no heartbeat from {name} after the fuzz: {exc}")


def account(cases: dict[str, list[fuzz.Case]], dead: DeadLog, scored: set[str], ledger: set[str],
            held: int, announced: int, report: Report) -> None:
    """Each published case: in DEAD if it does not decode; accounted downstream if it does."""
    unaccounted_scored = []
    for target, cs in cases.items():
        if fuzz.TARGETS[target].request:
            continue
        for c in cs:
            report.counts[target]["decodes" if c.decodes else "refused_by_decoder"] += 1
            if not c.decodes:
                if not dead.has(c):
                    report.bad(f"{target}: undecodable case not in DEAD", c)
                continue
            tid = task_id_of(c.data)  # the uid, unless a leaf mutation replaced the task id itself
            if target in ("tasks", "rollouts") and tid not in scored and tid not in dead.task_ids \
                    and not dead.has(c):
                report.bad(f"{target}: decodable case neither scored nor dead-lettered", c)
            elif target == "scored" and not (dead.has(c) or tid in ledger or tid in dead.task_ids):
                unaccounted_scored.append(c)
            elif target == "uploads" and not dead.has(c):
                version = msgpack.unpackb(c.data, raw=False).get("version", 0)
                if version > announced:
                    report.bad(f"uploads: forged version {version} above the announced {announced} and not in DEAD", c)
    if len(unaccounted_scored) > held:
        for c in unaccounted_scored:
            report.bad(f"scored: decodable group neither in DEAD nor the trainer's ledger ({held} held un-acked)", c)


async def test_every_consumed_subject_survives_10k_hostile_messages(tiny_model, tmp_path):
    t0 = time.monotonic()
    cases = {t: list(fuzz.cases(t, N, Subjects(fuzz.RUN))) for t in ONLY}
    report = Report()
    with Pipeline(tmp_path, _tables(str(tiny_model))) as p:
        p.start_all(1)
        bus = await p.bus()
        dead = DeadLog(bus)
        for name in ("trainer", "generator", "environment", "reward", "broadcast", "controller"):
            await wait_heartbeat(bus, lambda h, n=name: h.service == n, timeout=STEP_TIMEOUT)
        t_start = time.time()
        amid = fuzz.valid_tasks(32, seed=21)
        await bus.publish_many([(p.subjects.tasks(fuzz.POOL), t.encode(), t.msg_id) for t in amid])

        jobs = [publish_work(bus, [c for t in WORK if t in cases for c in cases[t]])]
        jobs += [publish_work(bus, [c for t in WATCHED if t in cases for c in cases[t]])]
        jobs += [env_requests(bus, [c for t, cs in cases.items() if fuzz.TARGETS[t].request for c in cs], report)]
        paced = {t: publish_paced(bus, dead, cases[t]) for t in PACED if t in cases}
        results = await asyncio.gather(*jobs, *paced.values())
        for t, sent in zip(paced, results[len(jobs):], strict=True):
            report.counts[t]["published_in_budget"] = sent
            cases[t] = cases[t][:sent]
        print(f"fuzz: published and answered in {time.monotonic() - t0:.0f}s")

        seen = await settle(bus, p)
        if seen.get("timed_out") or seen.get("service_died"):
            report.bad(f"the run did not drain (within {SETTLE_S}s, or a service died): {seen}")
        alive(p, report)
        await heartbeating(bus, p, t_start, report)
        if report.problems:  # a dead service: the checks below would only wait out their deadlines
            await finish(p, bus, dead, report, cases, t0)
            return

        # --- a fresh wave after the fuzz: scored, and the trainer steps ----------------------
        before = await wait_heartbeat(bus, lambda h: h.service == "trainer", timeout=60)
        after = fuzz.valid_tasks(64, seed=22)
        await bus.publish_many([(p.subjects.tasks(fuzz.POOL), t.encode(), t.msg_id) for t in after])
        try:
            await wait_heartbeat(bus, lambda h: h.service == "trainer"
                                 and h.metrics.get("trainer/step", 0) > before.metrics.get("trainer/step", 0),
                                 timeout=STEP_TIMEOUT)
        except AssertionError as exc:
            report.bad(f"the trainer did not step on valid tasks published after the fuzz: {exc}")
        seen = await settle(bus, p)
        scored = await scored_ids(bus, p)
        for t in amid + after:
            if t.task_id in dead.task_ids:
                report.bad(f"valid task {t.task_id} was dead-lettered")
            elif t.task_id not in scored:
                report.bad(f"valid task {t.task_id} was not scored")
        state = checkpoint_state(tmp_path) if (tmp_path / "checkpoints").exists() else {"consumed": {}}
        announced = (await wait_heartbeat(bus, lambda h: h.service == "broadcast", timeout=60)).version
        account(cases, dead, scored, set(state["consumed"]), seen["trainer_ack_pending"], announced, report)
        report.problems += [f"dead letter without a reason: {x}" for x in dead.no_reason[:20]]
        alive(p, report)
        await finish(p, bus, dead, report, cases, t0)


async def finish(p: Pipeline, bus, dead: DeadLog, report: Report, cases: dict[str, list[fuzz.Case]], t0: float) -> None:
    elapsed = time.monotonic() - t0
    for target, cs in cases.items():
        report.counts[target]["published"] = len(cs)
    print(f"fuzz: {N} per target, total {elapsed:.0f}s, {dead.count} dead letters; counts {dict(report.counts)}")
    await dead.close()
    await bus.close()
    assert not report.problems, (f"{len(report.problems)} fuzz violations ({elapsed:.0f}s):\n{report.summary()}"
                                 f"\n{p.logs()}")
