"""The controller survives every fault it can meet, and never stalls the run silently.

- Hostile heartbeats (NaN, inf, negative or astronomically large counters, ``info`` of the wrong
  shape): the schema refuses what no service sends, the controller skips each bad value it reads and
  keeps deciding; thousands of random ones never raise.
- Operator decisions and the seq order: controller decisions issued after an operator's stay in
  force; a seq absurdly far ahead (1e18, or one that would overflow the next seq) is refused with the
  reason instead of moving every later decision off wall time or crashing the controller.
- A pause or drain issued by an earlier controller incarnation (one killed with -9, or one of an
  earlier run under the same run name: CONTROL keeps the last decision per subject and a joining
  generator reads it) is lifted by the controller now running when it no longer applies.
- A stall (no progress while work waits) is reported on CONTROL, in ``rlbus status`` and in the log,
  with its likely cause, within a bounded time; and cleared when progress resumes.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from typing import Any

import msgpack
import pytest

from rlbus.schemas import Admit, Control, Heartbeat, RunState, SchemaError
from rlbus.schemas.control import MAX_INFO_STR, Stall
from rlbus.schemas.metric_keys import OUTCOMES, GeneratorKeys, TrainerKeys
from rlbus.services.commands.control import send_state
from rlbus.services.commands.status import build_snapshot, render
from rlbus.services.controller.planner import Planner
from rlbus.services.controller.settings import ControllerSettings
from rlbus.services.controller.stall import StallWatch
from tests.unit.test_controller_faults_loop import GEN, Loop, eventually

G, T = GeneratorKeys, TrainerKeys

# --- 1. hostile heartbeats -------------------------------------------------------------------------

METRIC_KEYS = [G.GROUPS_STARTED, G.GROUPS_PUBLISHED, G.GRANT_TOTAL, G.GROUPS_PER_S, G.CONCURRENCY,
               G.pool_published("a"), G.pool_published("b"), T.VERSION, T.STEP, T.GROUPS_TRAINED_TOTAL,
               T.GROUPS_DROPPED_TOTAL, T.PENDING_GROUPS, T.IDLE_FRACTION, T.IDLE_S,
               *(T.pool_groups(p, o) for p in ("a", "b") for o in (*OUTCOMES, "stale_held")),
               *(T.generator_groups(g, o) for g in ("gen-0", "gen-1") for o in OUTCOMES), "x/y"]
NUMBERS = [math.nan, math.inf, -math.inf, -1.0, -1e300, 1e300, 2.0 ** 63, 2.0 ** 64, 1e19, 0.0, 0.5, 1.0, 3.0,
           7.0, 40.0, float(1 << 40), float((1 << 40) + 1)]


def hostile_number(rng: random.Random) -> float:
    return rng.choice(NUMBERS) if rng.random() < 0.6 else rng.uniform(-1e6, 1e6)


def junk(rng: random.Random, depth: int = 0) -> Any:
    """Any plain value msgpack carries, nested a little: what a broken or hostile emitter might send."""
    kind = rng.randrange(10 if depth < 3 else 7)
    if kind == 0:
        return rng.choice([0, -1, 1, 2 ** 63 - 1, -2 ** 63, 2 ** 64 - 1, rng.randrange(-10 ** 6, 10 ** 6)])
    if kind == 1:
        return hostile_number(rng)
    if kind == 2:
        return "x" * rng.choice([0, 1, 8, 64, 65, 500, MAX_INFO_STR, MAX_INFO_STR + 1])
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return rng.choice(["a", "b", "gen-0", "", "pool with spaces", "rl.>.*"])
    if kind in (5, 6):
        return b"\x00\xff" * rng.randrange(4)
    if kind == 7:
        return [junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["a", "b", "boot", "", "x" * 70]): junk(rng, depth + 1) for _ in range(rng.randrange(4))}


def hostile_info(rng: random.Random) -> dict[str, Any]:
    good = {G.INFO_BOOT: rng.choice(["b1", "b2"]), G.INFO_POOLS: rng.choice([["a"], ["b", "a"]]),
            G.INFO_SHARES: {"a": 0.5, "b": 0.5}, G.INFO_MAX_BATCH_GROUPS: 8}
    return {k: (junk(rng) if rng.random() < 0.3 else v) for k, v in good.items() if rng.random() < 0.9}


def hostile_heartbeat(rng: random.Random, now: float) -> Heartbeat:
    service = rng.choice(["generator", "generator", "trainer", "environment", "reward"])
    return Heartbeat(
        service=service, instance=rng.choice(["gen-0", "gen-1", "trainer-0", "environment-0"]),
        seq=rng.choice([0, 1, rng.randrange(1, 10 ** 6), 2 ** 63 - 1]),
        ts=rng.choice([now, now - rng.uniform(0, 30), 0.0, 1e9, 1e15]),
        state=rng.choice(["running", "paused", "draining", "drained", "stopped", "done", "", "weird"]),
        version=rng.choice([-1, 0, 3, 2 ** 63 - 1, -2 ** 63, rng.randrange(100)]),
        metrics={k: hostile_number(rng) for k in rng.sample(METRIC_KEYS, rng.randrange(len(METRIC_KEYS)))},
        info=hostile_info(rng) if service == "generator" else {})


def test_thousands_of_hostile_heartbeats_never_raise_in_the_controller() -> None:
    rng = random.Random(20261204)
    cfg = ControllerSettings(route_period=0.01, refresh=0.5, silent_after=5.0)
    p = Planner(cfg, ["a", "b"], batch_groups=4, max_staleness=1)
    stalls = StallWatch(window=0.0, silent_after=5.0)
    now, decided, refused = time.time(), 0, 0
    for i in range(3000):
        now += 0.05
        try:
            hb = Heartbeat.decode(hostile_heartbeat(rng, now).encode())  # what reaches the controller
        except SchemaError:
            refused += 1  # refused on decode (or on build): dead-lettered by the controller's watch
            continue
        p.state.observe(hb, now=now)
        if i % 5 == 0:
            for ctl in p.step(now):
                assert Control.decode(ctl.encode()) == ctl  # every decision encodes and decodes
                decided += 1
            metrics = p.metrics() | stalls.metrics(now)
            assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in metrics.values()), metrics
            Heartbeat(service="controller", instance="controller-0", seq=i, ts=now, metrics=metrics).encode()
            record = stalls.check(p, now)
            if record is not None:
                Control.decode(p.record(record, record.detail, {}, now).encode())
    assert decided > 100 and refused > 0  # it kept deciding; some shapes never got in
    assert p.state.readings.skipped > 100  # and the bad values were skipped, not used


def test_the_heartbeat_schema_refuses_what_no_service_sends_and_keeps_nan_metrics() -> None:
    ok = Heartbeat(service="trainer", instance="trainer-0", seq=1, ts=time.time(), metrics={"trainer/loss": math.nan})
    assert math.isnan(Heartbeat.decode(ok.encode()).metrics["trainer/loss"])  # a NaN loss is worth seeing
    wire = msgpack.unpackb(ok.encode())
    for field, value, why in [("ts", math.nan, "finite wall time"), ("seq", -1, ">= 0"),
                              ("info", {"boot": "x" * (MAX_INFO_STR + 1)}, "characters"),
                              ("info", {"a": {"b": {"c": {"d": {"e": 1}}}}}, "nested deeper"),
                              ("info", {"pools": list(range(5000))}, "more than"),
                              ("metrics", {"m" * 300: 1.0}, "longer than")]:
        with pytest.raises(SchemaError, match=why):
            Heartbeat.decode(msgpack.packb({**wire, field: value}))


async def test_a_hostile_heartbeat_on_the_bus_costs_a_metric_never_the_controller(tmp_path) -> None:
    async with Loop(tmp_path) as loop:
        loop.start_generator()
        loop.start_controller()
        await loop.publish_tasks(20)
        await eventually(lambda: loop.published() >= 4, what="groups published")
        s = loop.s
        nan = Heartbeat(service="generator", instance="gen-9", seq=1, ts=time.time(),
                        metrics={G.GROUPS_STARTED: math.nan, G.GROUPS_PUBLISHED: math.inf, G.GRANT_TOTAL: -5.0,
                                 G.CONCURRENCY: 1e300},
                        info={G.INFO_BOOT: ["not", "a", "boot"], G.INFO_POOLS: "train", G.INFO_SHARES: [1, 2],
                              G.INFO_MAX_BATCH_GROUPS: "eight"})
        trainer = Heartbeat(service="trainer", instance="trainer-0", seq=10 ** 6, ts=time.time(),
                            metrics={T.VERSION: math.nan, T.GROUPS_DROPPED_TOTAL: 1e300, T.PENDING_GROUPS: -3.0,
                                     T.pool_groups("train", "train"): math.inf})
        for hb in (nan, trainer):
            await loop.bus.publish(s.metrics(hb.service, hb.instance), hb.encode(), msg_id=hb.msg_id)
        wire = msgpack.unpackb(nan.encode())
        await loop.bus.publish(s.metrics("generator", "gen-9"), msgpack.packb({**wire, "ts": math.nan}),
                               msg_id="nan-ts")
        await eventually(lambda: any(d.reason == "schema_error" for d in loop.bus.dead_letters), what="dead letter")
        before = loop.published()
        loop.trainer.dropped = 16  # the window grows: the controller must admit more
        await eventually(lambda: loop.published() >= before + 4, what="the loop goes on")
        assert loop.controller_task is not None and not loop.controller_task.done()
        assert loop.controller.planner.state.readings.skipped >= 8


# --- 2. operator decisions and the seq order ----------------------------------------------------------

def admits(loop: Loop) -> list[Control]:
    return [c for _, c in loop.decisions() if isinstance(c.decision, Admit) and c.issuer == "controller-0"]


async def test_controller_decisions_after_an_operator_pause_and_resume_stay_in_force(tmp_path) -> None:
    async with Loop(tmp_path) as loop:
        loop.start_generator()
        loop.start_controller()
        await loop.publish_tasks(40)
        await eventually(lambda: loop.published() >= 4, what="groups published")
        await send_state(loop.bus, "pause", GEN)
        await eventually(lambda: loop.gen_state() == "paused", what="paused by the operator")
        resume = await send_state(loop.bus, "resume", GEN)
        await eventually(lambda: loop.gen_state() == "running", what="resumed by the operator")
        loop.trainer.dropped = 16  # the trainer dropped 16 groups: the window grew by as many
        await eventually(lambda: any(c.seq > resume.seq and c.decision.grant_total >= (0 + 1 + 1) * 4 + 12
                                     for c in admits(loop)), what="a larger admission")
        later = max(admits(loop), key=lambda c: c.seq)
        assert later.seq > resume.seq
        # The generator holds the controller's later grant: it was not voided by the operator's decisions.
        await eventually(lambda: loop.gen_metric(G.GRANT_TOTAL) >= later.decision.grant_total, what="grant applied")
        await eventually(lambda: loop.published() >= 20, what="sampling goes on under the new grant")


def forged(ctl: Control, seq: int) -> bytes:
    """``ctl`` on the wire with another seq (one the schema would not let anyone build)."""
    return msgpack.packb({**msgpack.unpackb(ctl.encode()), "seq": seq})


@pytest.mark.parametrize("seq", [10 ** 18, 2 ** 64 - 1], ids=["1e18", "2^64-1"])
async def test_an_absurd_future_seq_is_refused_with_the_reason_and_voids_nothing(tmp_path, seq: int) -> None:
    async with Loop(tmp_path) as loop:
        loop.start_generator()
        c = loop.start_controller()
        await loop.publish_tasks(40)
        await eventually(lambda: loop.published() >= 4, what="groups published")
        pause = Control(seq=1, decision=RunState(state="pause"), target_service="generator", target_instance=GEN,
                        reason="fat finger", issuer="operator", issued_at=time.time())
        subject = loop.s.control_action("generator", GEN, "pause")
        await loop.bus.publish(subject, forged(pause, seq), msg_id="forged")
        await eventually(lambda: len([d for d in loop.bus.dead_letters if d.origin_subject == subject]) >= 1,
                         what="the forged decision dead-lettered")
        letter = next(d for d in loop.bus.dead_letters if d.origin_subject == subject)
        assert "ahead of this machine's clock" in letter.error and "fix the clock" in letter.error
        before = loop.published()
        loop.trainer.dropped = 16  # the window grows: the controller must admit more
        n = len(admits(loop))
        await eventually(lambda: len(admits(loop)) > n + 2 and loop.published() >= before + 8,
                         what="the controller keeps deciding and the generator keeps sampling")
        assert loop.gen_state() == "running"
        assert c.planner.clock.last < (time.time() + 3600) * 1e6  # its seqs stayed on wall time
        assert loop.controller_task is not None and not loop.controller_task.done()
    with pytest.raises(SchemaError, match="ahead of this machine's clock"):
        Control.decode(forged(pause, seq))


# --- 3 and 5a. holds left by an earlier controller incarnation -----------------------------------------

def old_decision(loop: Loop, state: str, *, boot: str = "", reason: str, age_s: float = 3600.0) -> tuple[str, Control]:
    at = time.time() - age_s
    ctl = Control(seq=int(at * 1e6), decision=RunState(state=state, boot=boot), target_service="generator",  # type: ignore[arg-type]
                  target_instance=GEN, reason=reason, issued_at=at, issuer="controller-0")
    return loop.s.control_action("generator", GEN, ctl.action), ctl


async def test_a_pause_left_on_control_by_an_earlier_run_does_not_hold_a_new_runs_generator(tmp_path) -> None:
    async with Loop(tmp_path) as loop:
        # The previous run under this name ended: its controller paused gen-0 (trainer done).
        subject, pause = old_decision(loop, "pause", reason="trainer done at version 9: new groups would never be trained")
        await loop.bus.publish(subject, pause.encode(), msg_id=pause.msg_id)
        loop.start_generator()  # joins, reads the last pause, starts paused
        loop.start_controller()
        await loop.publish_tasks(20)
        await eventually(lambda: loop.published() >= 8, what="the new run's generator samples")
        resume = [c for _, c in loop.decisions() if c.action == "resume" and c.issuer == "controller-0"
                  and c.seq > pause.seq]
        assert resume and "held by controller-0's pause" in resume[0].reason


async def test_a_drain_left_by_a_controller_killed_before_it_lifted_it_is_lifted_by_the_next(tmp_path) -> None:
    async with Loop(tmp_path) as loop:
        loop.start_generator()
        loop.start_controller()
        await loop.publish_tasks(60)
        await eventually(lambda: loop.published() >= 4 and loop.boot(), what="groups published")
        await loop.stop_controller()  # killed; just before, it had found gen-0 silent and drained it
        subject, drain = old_decision(loop, "drain", boot=loop.boot(), age_s=0.0,
                                      reason="silent for more than 5.0s: its unstarted grant ... re-planned")
        await loop.bus.publish(subject, drain.encode(), msg_id=drain.msg_id)
        await eventually(lambda: loop.gen_state() == "drained", what="drained")
        before = loop.published()
        loop.trainer.dropped = 16  # the window grows
        loop.start_controller()  # the restarted controller
        await eventually(lambda: loop.gen_state() == "running", what="resumed by the restarted controller")
        await eventually(lambda: loop.published() >= before + 8, what="sampling again")


async def test_an_operators_pause_is_left_to_the_operator(tmp_path) -> None:
    async with Loop(tmp_path) as loop:
        loop.start_generator()
        loop.start_controller()
        await loop.publish_tasks(20)
        await eventually(lambda: loop.published() >= 4, what="groups published")
        pause = await send_state(loop.bus, "pause", GEN)
        await eventually(lambda: loop.gen_state() == "paused", what="paused")
        await loop.stop_controller()
        loop.start_controller()  # a restarted controller does not lift it either
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            assert loop.gen_state() == "paused"
            await asyncio.sleep(0.1)
        assert not [c for _, c in loop.decisions() if c.action == "resume" and c.seq > pause.seq]


# --- 5b. stalls are reported with their cause ----------------------------------------------------------

def stalls(loop: Loop) -> list[Control]:
    return [c for s, c in loop.decisions() if isinstance(c.decision, Stall)
            and s == loop.s.control_action("controller", "controller-0", "stall")]


def snapshot(loop: Loop) -> dict[str, Any]:
    hbs = [Heartbeat.decode(d) for _, d in loop.bus.messages("METRICS")]
    return build_snapshot("faults", {(h.service, h.instance): h for h in hbs}.values(), [],
                          [c for _, c in loop.decisions()], time.time())


async def test_all_generators_paused_is_reported_as_a_stall_and_cleared_when_work_resumes(tmp_path) -> None:
    async with Loop(tmp_path, stall_after=1.0, silent_after=2.0) as loop:
        loop.start_generator()
        loop.start_controller()
        await loop.publish_tasks(40)
        await eventually(lambda: loop.published() >= 4, what="groups published")
        await send_state(loop.bus, "pause", GEN, reason="investigating")
        await eventually(lambda: any(c.decision.cause == "all_generators_paused" for c in stalls(loop)), timeout=30.0,
                         what="a stall record")
        record = next(c for c in stalls(loop) if c.decision.cause)
        assert record.decision.cause == "all_generators_paused"  # the first one named it
        assert "gen-0 paused by operator" in record.decision.detail and "investigating" in record.decision.detail
        assert record.decision.stalled_s >= 1.0 and record.inputs["tasks_waiting"] > 0
        snap = snapshot(loop)
        assert snap["stalls"]["controller-0"]["cause"] == "all_generators_paused"
        assert any("STALLED" in str(r) and "all_generators_paused" in str(r) for r in render(snap))
        assert loop.controller.metrics()["controller/stall_s"] >= 1.0
        await send_state(loop.bus, "resume", GEN)
        loop.trainer.dropped = 16  # work flows again
        await eventually(lambda: stalls(loop)[-1].decision.cause == "", what="the stall cleared")
        assert "controller-0" not in snapshot(loop)["stalls"]


async def test_an_environment_that_stops_answering_is_reported_as_the_stalls_cause(tmp_path) -> None:
    async with Loop(tmp_path, stall_after=1.0, silent_after=2.0) as loop:
        loop.start_generator()
        loop.start_controller()
        await loop.publish_tasks(200)
        await eventually(lambda: loop.published() >= 4, what="groups published")
        loop.env.stop()
        # Until no environment has been heard from for silent_after, the generators look stuck instead.
        await eventually(lambda: any(c.decision.cause == "environment_not_answering" for c in stalls(loop)),
                         timeout=30.0, what="a stall record naming the environment")
        record = next(c for c in stalls(loop) if c.decision.cause == "environment_not_answering")
        assert record.decision.cause in {c.decision.cause for c in stalls(loop)}
        assert "start or restart the environment service" in record.decision.detail


# --- 5a. a restarted controller's first decisions sort after its predecessor's ------------------------

class SlowControlWatch:
    """A CONTROL watch whose server takes ``delay`` seconds to deliver the first stored decision."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.delay, self.first = inner, delay, True

    def __aiter__(self) -> SlowControlWatch:
        return self

    async def __anext__(self) -> Any:
        if self.first:
            self.first = False
            await asyncio.sleep(self.delay)
        return await self.inner.__anext__()


async def test_a_controller_whose_control_watch_starts_slowly_still_sorts_after_the_stored_decisions(tmp_path) -> None:
    async with Loop(tmp_path) as loop:
        real_watch = loop.bus.watch

        def slow_watch(subject: str, **kw: Any) -> Any:
            watch = real_watch(subject, **kw)
            return SlowControlWatch(watch, 1.5) if subject == loop.s.all_of("control") else watch

        loop.bus.watch = slow_watch  # type: ignore[method-assign]
        # The predecessor's last admission, issued after it had followed an operator whose clock ran an
        # hour ahead: the generator applies only admissions with a larger seq.
        at = time.time() + 3600
        ahead = Control(seq=int(at * 1e6), decision=Admit(boot="old", grant_total=8), target_service="generator",
                        target_instance=GEN, issued_at=at, issuer="controller-0")
        await loop.bus.publish(loop.s.control_action("generator", GEN, "admit"), ahead.encode(), msg_id=ahead.msg_id)
        loop.start_generator()
        loop.start_controller()
        await eventually(lambda: admits(loop) and any(c.decision.boot == loop.boot() for c in admits(loop)),
                         what="an admission of the running boot")
        first = min((c for c in admits(loop) if c.decision.boot == loop.boot()), key=lambda c: c.seq)
        assert first.seq > ahead.seq
