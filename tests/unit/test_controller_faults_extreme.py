"""Heartbeats with huge but finite values, or thousands of names, never freeze the controller.

A fuzz run of the real pipeline once left the controller's event loop without a heartbeat, a log
line or an answer to SIGTERM after such heartbeats.  Two things could do that: a loop whose length
follows a value read from a heartbeat (an admission handed out one group per iteration up to
``int(1e308)``), or state that grows with every new name a heartbeat carries (a pool or generator
name in a breakdown key), so that each decision step, and the controller's own heartbeat, grows
without end.  These tests feed both kinds through the controller's state, planner and stall watch,
and through the running service on the in-memory bus.  The per-step deadline is a hang detector
(generous, for a loaded machine), not a performance assertion.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from pydantic import ValidationError

from rlbus.schemas import Admit, Control, Heartbeat, SchemaError
from rlbus.schemas.control import MAX_METRICS
from rlbus.schemas.metric_keys import OUTCOMES, STALE_HELD, GeneratorKeys, TrainerKeys
from rlbus.services.controller import planner as planner_module
from rlbus.services.controller import state as state_module
from rlbus.services.controller.planner import Planner
from rlbus.services.controller.settings import ControllerSettings
from rlbus.services.controller.stall import StallWatch
from tests.unit.test_controller_faults_loop import Loop, eventually

G, T = GeneratorKeys, TrainerKeys
STEP_DEADLINE_S = 5.0  # one observe + decide + report; far above the milliseconds it takes
SERVICES = ("trainer", "generator", "reward", "broadcast", "environment")
HUGE = (1e308, -1e308, 2.0 ** 63, -2.0 ** 63, 2.0 ** 64, float(1 << 40), float((1 << 40) - 1), 1e19, math.inf,
        -math.inf, math.nan, 0.0)
VERSIONS = (2 ** 63 - 1, -2 ** 63, 1 << 40, 0)
# Every metric the controller reads (schemas/metric_keys.py), breakdowns included.
READ_KEYS = (G.GROUPS_STARTED, G.GROUPS_PUBLISHED, G.GRANT_TOTAL, G.GROUPS_PER_S, G.CONCURRENCY,
             G.pool_published("a"), G.pool_published("b"), T.VERSION, T.STEP, T.GROUPS_TRAINED_TOTAL,
             T.GROUPS_DROPPED_TOTAL, T.PENDING_GROUPS, T.IDLE_FRACTION, T.IDLE_S,
             *(T.groups(o) for o in (*OUTCOMES, STALE_HELD)),
             *(T.pool_groups(p, o) for p in ("a", "b") for o in (*OUTCOMES, STALE_HELD)),
             *(T.generator_groups(g, o) for g in ("generator-0", "generator-1") for o in (*OUTCOMES, STALE_HELD)))


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``'s result, or a failure when it has not returned within ``seconds`` (a hang is a
    failure, not a test run that never ends: the thread is a daemon and is left behind)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test below
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise AssertionError(f"did not return within {seconds}s: the controller's loop would be frozen")
    if "error" in box:
        raise box["error"]
    return box.get("result")


class Harness:
    """The controller's pure parts as the service wires them: state -> planner -> decisions, its
    heartbeat, the stall watch."""

    def __init__(self) -> None:
        self.planner = Planner(ControllerSettings(route_period=0.01, refresh=0.5), ["a", "b"], batch_groups=4,
                               max_staleness=1)
        self.stalls = StallWatch(window=0.0, silent_after=5.0)
        self.decided = 0
        self.slowest = 0.0

    def step(self, hb: Heartbeat, now: float) -> None:
        """What the service does with one heartbeat and one decision period; timed as a whole."""
        start = time.perf_counter()
        self.planner.state.observe(hb, now=now)
        for ctl in self.planner.step(now):
            assert Control.decode(ctl.encode()) == ctl
            self.decided += 1
        metrics = self.planner.metrics() | self.stalls.metrics(now) | {"controller/heartbeat_values_skipped": 0}
        # Its own heartbeat must stay one that the schema accepts (else the heartbeat loop dies).
        Heartbeat(service="controller", instance="controller-0", seq=1, ts=now, metrics=metrics).encode()
        record = self.stalls.check(self.planner, now)
        if record is not None:
            Control.decode(self.planner.record(record, record.detail, {}, now).encode())
        elapsed = time.perf_counter() - start
        self.slowest = max(self.slowest, elapsed)
        assert elapsed < STEP_DEADLINE_S, f"one step took {elapsed:.1f}s after {hb.service} {hb.metrics}"[:300]


def huge_heartbeats(now: float) -> list[Heartbeat]:
    """One heartbeat per (service, value, version, ts): every key the controller reads set to the value."""
    out = []
    combos = itertools.product(SERVICES, HUGE, VERSIONS, ("now", "far_future", "zero"))
    for n, (service, value, version, stamp) in enumerate(combos):
        ts = {"now": now, "far_future": 1e308, "zero": 0.0}[stamp]
        info = {G.INFO_BOOT: f"boot-{n % 3}", G.INFO_POOLS: ["a", "b"], G.INFO_SHARES: {"a": 0.5, "b": 0.5},
                G.INFO_MAX_BATCH_GROUPS: value if math.isfinite(value) and abs(value) < 2 ** 63 else 8} \
            if service == "generator" else {}
        out.append(Heartbeat(service=service, instance=f"{service}-{n % 2}", seq=n, ts=ts, version=version,
                             state="running", metrics=dict.fromkeys(READ_KEYS, value), info=info))
    return out


def test_huge_values_from_every_service_keep_each_decision_step_bounded() -> None:
    h = Harness()
    now = time.time()

    def feed() -> None:
        for n, hb in enumerate(huge_heartbeats(now)):
            h.step(Heartbeat.decode(hb.encode()), now + 0.05 * n)

    within(600.0, feed)
    assert h.decided > 0 and h.planner.state.readings.skipped > 1000  # it kept deciding; bad values skipped
    # A window read from a trainer with version 2**40 is still handed out a bounded number of groups.
    assert all(g.outstanding <= h.planner.cfg.max_outstanding for g in h.planner.state.views())


def test_the_timestamps_no_clock_shows_are_refused_on_decode() -> None:
    wire = msgpack.unpackb(Heartbeat(service="trainer", instance="trainer-0", seq=1, ts=time.time()).encode())
    for ts in (math.nan, -1e308, math.inf):
        with pytest.raises(SchemaError, match="finite wall time"):
            Heartbeat.decode(msgpack.packb({**wire, "ts": ts}))


def wide_heartbeat(service: str, n: int, now: float, width: int = 5000) -> Heartbeat:
    """A heartbeat with ``width`` names no earlier heartbeat used (pools, generators)."""
    if service == "trainer":
        metrics = {T.pool_groups(f"p{n}x{i}", "train"): float(i) for i in range(width // 2)}
        metrics |= {T.generator_groups(f"g{n}x{i}", "stale"): 1.0 for i in range(width // 2)}
        metrics |= {T.GROUPS_TRAINED_TOTAL: float(n), T.VERSION: 1e308}
        return Heartbeat(service="trainer", instance="trainer-0", seq=n, ts=now, metrics=metrics)
    metrics = {G.pool_published(f"p{n}x{i}"): 1e308 if i % 2 else float(i) for i in range(width)}
    return Heartbeat(service=service, instance=f"{service}-{n % 3}", seq=n, ts=now,
                     metrics=metrics | {G.GROUPS_STARTED: 1e12, G.GROUPS_PUBLISHED: 2.0 ** 63},
                     info={G.INFO_BOOT: f"b{n}", G.INFO_POOLS: ["a"]} if service == "generator" else {})


def test_thousands_of_new_names_per_heartbeat_do_not_grow_the_controllers_work_or_heartbeat() -> None:
    h = Harness()
    now = time.time()
    sizes = []

    def feed() -> None:
        for n in range(60):
            for service in SERVICES:
                h.step(Heartbeat.decode(wide_heartbeat(service, n, now + n).encode()), now + n)
            sizes.append(len(h.planner.metrics()))

    within(600.0, feed)
    # What the controller keeps and reports is bounded by the run's pools and the generators it heard
    # from, not by the names a heartbeat makes up: the last report is no larger than the tenth.
    assert sizes[-1] <= sizes[9] and sizes[-1] < MAX_METRICS // 4, sizes[::10]
    assert set(h.planner.state.balance.trained_by_pool) <= {"a", "b"}


async def test_a_flood_of_wide_heartbeats_on_the_bus_leaves_the_controller_beating_and_deciding(tmp_path) -> None:
    async with Loop(tmp_path) as loop:
        loop.start_generator()
        controller = loop.start_controller()
        await loop.publish_tasks(40)
        await eventually(lambda: loop.published() >= 4, what="groups published")
        s = loop.s
        now = time.time()
        for n in range(16):
            for service in ("trainer", "reward"):
                hb = wide_heartbeat(service, n, now)
                await loop.bus.publish(s.metrics(hb.service, hb.instance), hb.encode(), msg_id=hb.msg_id)
        beats = loop.heartbeat("controller", "controller-0")
        seq = beats.seq if beats else 0
        await eventually(lambda: (b := loop.heartbeat("controller", "controller-0")) is not None and b.seq >= seq + 2,
                         timeout=30.0, what="the controller's heartbeat goes on")
        before = loop.published()
        loop.trainer.dropped = 16  # the window grows: the controller must admit more
        await eventually(lambda: loop.published() >= before + 4, timeout=30.0, what="the loop goes on")
        assert loop.controller_task is not None and not loop.controller_task.done()
        assert len(loop.heartbeat("controller", "controller-0").metrics) < MAX_METRICS // 4
        await loop.stop_controller()  # and it stops when told (within the harness's 10 s)
        assert controller.planner.state.readings.skipped > 0


def test_a_flood_of_new_boots_and_instances_keeps_the_generators_the_controller_tracks_bounded(monkeypatch) -> None:
    monkeypatch.setattr(state_module, "MAX_GENERATOR_VIEWS", 40)
    h = Harness()
    st = h.planner.state
    start, boots = time.time(), 600
    kept: list[tuple[int, int]] = []  # (views kept, live ones) after each decision step

    def feed() -> None:
        for n in range(boots):
            t = start + 0.1 * n  # a boot not heard from for silent_after (5 s, 50 heartbeats) is gone
            # A new boot in every heartbeat; every third one a new instance too.  Each published 5 groups.
            hb = Heartbeat(service="generator", instance=f"gen-{n // 3}" if n % 3 == 0 else f"gen-{n % 5}", seq=n,
                           ts=t, metrics={G.GROUPS_STARTED: 5.0, G.GROUPS_PUBLISHED: 5.0, G.pool_published("a"): 5.0},
                           info={G.INFO_BOOT: f"boot-{n}", G.INFO_POOLS: ["a"], G.INFO_MAX_BATCH_GROUPS: 4})
            st.observe(hb, now=t)
            if n % 10 == 9:
                h.step(Heartbeat(service="reward", instance="reward-0", seq=n, ts=t), t)
                kept.append((len(st.generators), sum(g.alive for g in st.generators.values())))

    within(600.0, feed)
    # Past the limit only live boots (and the one account of the folded ones) are kept one by one.
    assert all(views <= max(40, live + 1) for views, live in kept), kept
    assert max(views for views, _ in kept) < 80, kept
    # Every boot's published groups still occupy the window: nothing was forgotten from the sums.
    assert h.planner.last_plan is not None and h.planner.last_plan.started_total == 5 * boots
    assert sum(st.balance.trained_by_pool.values()) == 5 * boots  # the published mix, every boot counted
    assert len(st.info) <= len({inst for inst, _ in st.generators})  # instances with no boot left are forgotten
    # A new boot still replaces the earlier ones of its instance: one boot per instance looks alive.
    heard = [inst for (inst, _), g in st.generators.items() if g.last_seen > 0]
    assert len(heard) == len(set(heard))


def test_a_window_of_2_to_the_40_groups_is_handed_out_in_bounded_work_at_the_largest_max_outstanding() -> None:
    with pytest.raises(ValidationError, match="max_outstanding"):
        ControllerSettings(max_outstanding=1 << 40)  # one group per iteration up to this: refused
    cfg = ControllerSettings(route_period=0.01, refresh=0.5, max_outstanding=4096)
    p = Planner(cfg, ["a"], batch_groups=4, max_staleness=1)
    now = time.time()
    for i in range(4):
        p.state.observe(Heartbeat(service="generator", instance=f"gen-{i}", seq=1, ts=now,
                                  info={G.INFO_BOOT: "b", G.INFO_POOLS: ["a"], G.INFO_MAX_BATCH_GROUPS: 8}), now=now)
    p.state.observe(Heartbeat(service="trainer", instance="trainer-0", seq=1, ts=now,
                              metrics={T.VERSION: float(1 << 40), T.GROUPS_DROPPED_TOTAL: float(1 << 40)}), now=now)
    ctls = within(STEP_DEADLINE_S * 4, lambda: p.step(now))
    grants = [c.decision.grant_total for c in ctls if isinstance(c.decision, Admit)]
    assert grants == [4096] * 4  # each generator got the most it may hold, and the rest of the window waits


def test_the_controllers_heartbeat_stays_within_its_metric_budget_with_many_live_generators(monkeypatch) -> None:
    monkeypatch.setattr(planner_module, "MAX_REPORTED_METRICS", 40)
    p = Planner(ControllerSettings(route_period=0.01, refresh=0.5), ["a"], batch_groups=4, max_staleness=1)
    now = time.time()
    for t in (now, now + 1.0):
        for i in range(30):  # 30 live generators with measured rates: two metrics each
            p.state.observe(Heartbeat(service="generator", instance=f"gen-{i}", seq=1, ts=t,
                                      metrics={G.GROUPS_STARTED: t - now + 2, G.GROUPS_PUBLISHED: t - now + 1},
                                      info={G.INFO_BOOT: "b", G.INFO_POOLS: ["a"]}), now=t)
    p.step(now + 1.0)
    m = p.metrics()
    assert len(m) <= 41 and m["controller/metrics_left_out"] > 0
    assert "controller/allowed_total" in m and "controller/balance/consumption" in m  # the run's own measures stay


def test_a_generator_the_trainer_names_before_the_controller_hears_it_is_counted_from_that_baseline() -> None:
    """Reading only bounded names must not turn a restarted controller's first view of a generator's
    history into one burst of recent outcomes."""
    p = Planner(ControllerSettings(route_period=0.01, refresh=0.5), ["a"], batch_groups=4, max_staleness=1)
    st, now = p.state, time.time()

    def trainer(t: float, stale: float, train: float) -> Heartbeat:
        return Heartbeat(service="trainer", instance="trainer-0", seq=int(t - now) + 1, ts=t, metrics={
            T.GROUPS_TRAINED_TOTAL: train, T.generator_groups("gen-0", "stale"): stale,
            T.generator_groups("gen-0", "train"): train, T.pool_groups("a", "train"): train,
            T.pool_groups("a", "stale"): stale})

    st.observe(trainer(now, 1000.0, 0.0), now=now)  # hours of history, before gen-0 is heard from
    for i, t in enumerate((now + 1, now + 2)):
        st.observe(Heartbeat(service="generator", instance="gen-0", seq=i, ts=t, info={G.INFO_BOOT: "b"},
                             metrics={G.GROUPS_STARTED: 20.0 + 10 * i, G.GROUPS_PUBLISHED: 10.0 + 10 * i}), now=t)
    st.observe(trainer(now + 3, 1000.0, 10.0), now=now + 3)  # since then: 10 trained, none stale
    speed = st.balance.signals(["gen-0"]).generator_speeds["gen-0"]
    assert speed.fresh == 1.0


def test_a_flood_of_instance_names_from_other_services_keeps_bounded_memory(monkeypatch) -> None:
    monkeypatch.setattr(state_module, "MAX_SEEN_INSTANCES", 100)
    p = Planner(ControllerSettings(route_period=0.01, refresh=0.5), ["a"], batch_groups=4, max_staleness=1)
    now = time.time()
    for n in range(1000):
        service = ("reward", "broadcast", "environment")[n % 3]
        p.state.observe(Heartbeat(service=service, instance=f"{service}-{n}", seq=1, ts=now + n * 0.01,
                                  metrics=dict.fromkeys(READ_KEYS, 1e308)), now=now + n * 0.01)
    assert len(p.state.seen_at) <= 100
    assert p.state.heard_from("environment", now + 10.0, within=5.0) > 0  # the ones heard lately still count
