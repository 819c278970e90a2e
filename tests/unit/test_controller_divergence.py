"""The reward-hacking alarm: it fires when training reward rises while held-out accuracy falls over
the window, stays silent when they move together, on noise and on too few held-out rounds, clears
when they stop parting ways, and reaches CONTROL, the controller's heartbeat and ``rlbus status``
through the controller service on the in-memory bus."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable

import numpy as np
import pytest
from structlog.testing import capture_logs

from rlbus.bus.memory import MemoryBus
from rlbus.schemas import Control, Divergence, Heartbeat, Rollout, ScoredGroup, ScoredRollout, Task, spans_from_versions
from rlbus.schemas.metric_keys import TrainerKeys
from rlbus.services.commands.status import build_snapshot
from rlbus.services.controller.divergence import DivergenceConfig, DivergenceMonitor, HeldOutReading, HeldOutRounds
from rlbus.services.controller.service import Controller, EvalSchedule
from rlbus.services.controller.settings import ControllerSettings
from rlbus.services.runtime.config import ConfigError, RunSettings, load
from rlbus.services.runtime.lifecycle import Lifecycle
from tests.unit.test_controller_service import decisions, eventually, running

RUN = "r"
ROUND = 200  # held-out tasks per round (the default run's)


def binomial_reading(version: int, p: float, rng: random.Random | None = None) -> HeldOutReading:
    """A round of ROUND 0/1 rewards at accuracy ``p`` (exactly, or drawn when ``rng`` is given)."""
    correct = sum(rng.random() < p for _ in range(ROUND)) if rng else round(p * ROUND)
    acc = correct / ROUND
    return HeldOutReading(version, acc, math.sqrt(acc * (1 - acc) / (ROUND - 1)), ROUND)


def run_window(mon: DivergenceMonitor, reward: Callable[[int], float], heldout: Callable[[int], float],
               versions: range, *, every: int = 5, rng: random.Random | None = None) -> list[Divergence]:
    """Feed one reading per version (a held-out round every ``every``) and check after each, as the
    controller does; the records it issued."""
    records = []
    for v in versions:
        mon.observe_reward(v, reward(v))
        if v % every == 0:
            mon.observe_heldout(binomial_reading(v, heldout(v), rng))
        if (rec := mon.check()) is not None:
            records.append(rec)
    return records


def test_fires_when_training_reward_rises_while_held_out_accuracy_falls():
    mon = DivergenceMonitor(DivergenceConfig())
    records = run_window(mon, lambda v: 0.3 + 0.01 * v, lambda v: 0.8 - 0.005 * v, range(1, 51))
    assert len(records) == 1 and records[0].firing
    rec = records[0]
    # Straight lines fit exactly: the trends are each line's change across its readings in the window.
    assert (rec.from_version, rec.to_version, rec.heldout_readings) == (1, 30, 6)
    assert rec.reward_trend == pytest.approx(0.01 * 29) and rec.heldout_trend == pytest.approx(-0.005 * 25, abs=3e-3)
    assert "reward hacking" in rec.detail and "verifier bug" in rec.detail and "training reward +" in rec.detail
    m = mon.metrics()
    assert m["controller/divergence"] == 1.0 and m["controller/divergence/heldout_trend"] < 0
    assert m["controller/divergence/reward_trend"] > 0


@pytest.mark.parametrize(("name", "reward", "heldout"), [
    ("both rise", lambda v: 0.3 + 0.01 * v, lambda v: 0.2 + 0.006 * v),
    ("both fall", lambda v: 0.8 - 0.01 * v, lambda v: 0.8 - 0.008 * v),
    ("reward flat, held-out falls", lambda v: 0.5, lambda v: 0.8 - 0.008 * v),
    ("reward rises too little", lambda v: 0.5 + 0.0005 * v, lambda v: 0.8 - 0.008 * v),
    ("held-out falls too little", lambda v: 0.3 + 0.01 * v, lambda v: 0.6 - 0.0005 * v),
])
def test_silent_unless_reward_rises_and_held_out_falls(name, reward, heldout):
    mon = DivergenceMonitor(DivergenceConfig())
    assert run_window(mon, reward, heldout, range(1, 101)) == [], name
    assert mon.metrics()["controller/divergence"] == 0.0


def test_silent_on_held_out_noise_while_reward_rises():
    """A plateaued held-out accuracy, drawn as a real round of 200 tasks would be, while the training
    reward climbs (a run that overfits its training set): almost never an alarm (z=3: about 1 in 700
    windows per the normal tail; 300 windows here)."""
    fired = 0
    for seed in range(300):
        rng = random.Random(seed)
        mon = DivergenceMonitor(DivergenceConfig(window=30))
        fired += bool(run_window(mon, lambda v: 0.3 + 0.01 * v, lambda v: 0.6, range(1, 31), rng=rng))
    assert fired <= 3, f"{fired} false alarms in 300 noisy windows"
    # The same noise on a real fall is still caught: the margin is not bought by going deaf.
    caught = sum(bool(run_window(DivergenceMonitor(DivergenceConfig(window=30)), lambda v: 0.3 + 0.01 * v,
                                 lambda v: 0.75 - 0.008 * v, range(1, 31), rng=random.Random(seed)))
                 for seed in range(50))
    assert caught >= 45, f"caught only {caught} of 50 clear falls"


def test_too_few_held_out_rounds_never_fire_and_the_next_round_can():
    mon = DivergenceMonitor(DivergenceConfig(window=30))
    records = run_window(mon, lambda v: 0.3 + 0.02 * v, lambda v: 0.9 - 0.02 * v, range(1, 21), every=10)
    assert records == [] and len(mon.heldout) == 2  # a steep fall, but over two rounds only
    assert mon.metrics()["controller/divergence"] == 0.0
    assert "controller/divergence/heldout_trend" not in mon.metrics()  # no trend is claimed
    records = run_window(mon, lambda v: 0.3 + 0.02 * v, lambda v: 0.9 - 0.02 * v, range(21, 31), every=10)
    assert [r.firing for r in records] == [True]


def test_clears_once_held_out_accuracy_recovers_and_does_not_flap():
    mon = DivergenceMonitor(DivergenceConfig(window=30))
    fired = run_window(mon, lambda v: 0.3 + 0.01 * v, lambda v: 0.8 - 0.01 * v, range(1, 31))
    assert [r.firing for r in fired] == [True]
    # The verifier is fixed at version 30: held-out accuracy climbs back while reward keeps rising.
    after = run_window(mon, lambda v: 0.3 + 0.01 * v, lambda v: 0.5 + 0.01 * (v - 30), range(31, 61))
    assert [r.firing for r in after] == [False]
    assert after[0].heldout_trend > -0.025 and "no longer parting ways" in after[0].detail
    assert mon.metrics()["controller/divergence"] == 0.0


def test_a_trend_hovering_at_the_threshold_gives_one_alarm_not_one_per_step():
    mon = DivergenceMonitor(DivergenceConfig(window=30, heldout_drop=0.1, z=0))
    # Held-out falls by about the margin, wobbling a little around it from round to round.
    records = run_window(mon, lambda v: 0.3 + 0.01 * v, lambda v: 0.7 - 0.1 * v / 25 + 0.01 * (v // 5 % 2),
                         range(1, 121))
    assert [r.firing for r in records] == [True]


def test_the_trainers_repeated_heartbeat_is_one_reading_and_a_rewind_drops_the_abandoned_history():
    mon = DivergenceMonitor(DivergenceConfig())

    def beat(version: int, reward: float | None) -> Heartbeat:
        m = {TrainerKeys.VERSION: version} | ({TrainerKeys.REWARD_MEAN: reward} if reward is not None else {})
        return Heartbeat(service="trainer", instance="trainer-0", seq=version, ts=time.time(), metrics=m)

    for v in range(1, 11):
        for _ in range(3):  # the step's metrics ride on every heartbeat until the next step
            mon.observe_trainer(beat(v, 0.1 * v))
    mon.observe_trainer(beat(11, None))  # a heartbeat before the first step of a restarted trainer
    mon.observe_trainer(beat(12, math.nan))
    assert sorted(mon.rewards) == list(range(1, 11))
    mon.observe_heldout(binomial_reading(10, 0.5))
    mon.observe_trainer(beat(6, 0.9))  # restarted from the checkpoint at version 5
    assert sorted(mon.rewards) == [1, 2, 3, 4, 5, 6] and mon.rewards[6] == 0.9 and mon.heldout == {}


def test_a_restarted_controller_keeps_the_alarm_it_had_raised_until_the_readings_clear_it():
    mon = DivergenceMonitor(DivergenceConfig(window=30))
    mon.restore(Divergence(firing=True, reward_trend=0.3, heldout_trend=-0.2, from_version=1, to_version=30))
    assert mon.firing and mon.check() is None  # nothing to judge yet: the alarm stands
    records = run_window(mon, lambda v: 0.5, lambda v: 0.6 + 0.005 * v, range(31, 61))
    assert [r.firing for r in records] == [False]
    mon.restore(Divergence(firing=True))  # an old record read back late: this process already decided
    assert not mon.firing


def scored(version: int, task_id: str, rewards: list[float], *, verifier_error: str = "") -> ScoredGroup:
    task = Task(run=RUN, task_id=f"eval.v{version}.{task_id}", pool="eval", env="addition", prompt="1+1=",
                answer="2", eval=True, metadata={"eval_version": version})
    out = []
    for i, r in enumerate(rewards):
        ro = Rollout(rollout_id=f"{task.task_id}/{i}", task_id=task.task_id, index=i,
                     token_ids=np.array([1, 5, 6, 9], dtype="<i4"), prompt_len=3, loss_mask=np.ones(1, dtype="|u1"),
                     behaviour_logprobs=np.zeros(1, dtype="<f4"),
                     version_spans=spans_from_versions(np.array([version])), text="2")
        out.append(ScoredRollout(rollout=ro, reward=r, verifier_error=verifier_error))
    return ScoredGroup(task=task, scored=out)


def test_held_out_rounds_count_each_task_once_and_give_up_a_round_that_cannot_complete():
    rounds = HeldOutRounds(size=4, keep=2)
    assert rounds.add(scored(5, "t0", [1.0])) is None
    assert rounds.add(scored(5, "t0", [1.0])) is None  # redelivered: still one task
    assert rounds.add(scored(5, "t1", [0.0])) is None
    assert rounds.add(scored(5, "t2", [1.0], verifier_error="addition: ValueError")) is None  # counted, not scored
    reading = rounds.add(scored(5, "t3", [1.0]))
    assert reading is not None and (reading.version, reading.n) == (5, 3)
    assert reading.accuracy == pytest.approx(2 / 3) and reading.se == pytest.approx(math.sqrt(1 / 3 / 3))
    assert rounds.add(scored(5, "t3", [1.0])) is None  # a late duplicate opens no second round
    rounds.add(scored(10, "t0", [1.0]))  # round 10 loses three tasks on the way
    rounds.add(scored(15, "t0", [1.0]))
    rounds.add(scored(20, "t0", [1.0]))  # a third open round: the oldest is given up
    assert sorted(rounds.open) == [15, 20] and rounds.abandoned == 1


@pytest.mark.parametrize(("toml", "says"), [
    ("min_heldout = 60", "min_heldout = 60 readings cannot fit in window = 50"),
    ("heldout_drop = 1.5", "less than or equal to 1"),
    ("z = -1", "greater than or equal to 0"),
    ("reward_rise = nan", "finite"),
    ("window = 2", "greater than or equal to 4"),
])
def test_the_alarms_config_is_checked_when_read(tmp_path, toml, says):
    path = tmp_path / "run.toml"
    path.write_text(f"[controller.divergence]\n{toml}\n")
    with pytest.raises(ConfigError, match="divergence") as info:
        load(path, ControllerSettings, "controller")
    assert says in str(info.value)


async def test_the_controller_records_the_alarm_on_control_and_its_heartbeat_and_status_shows_it(tmp_path):
    bus, life = MemoryBus(RUN), Lifecycle(grace=1.0)
    held_out = [Task(run=RUN, task_id=f"add-{i}", pool="eval", env="addition", prompt=f"{i}+1=", answer=str(i + 1),
                     eval=True) for i in range(4)]
    run_cfg = RunSettings(run=RUN, run_dir=str(tmp_path), pools=["a"], batch_groups=4, max_staleness=1)
    cfg = ControllerSettings(divergence=DivergenceConfig(window=12, min_steps=4, min_heldout=3, z=2))
    c = Controller(run_cfg, cfg, bus=bus, life=life, evals=EvalSchedule(held_out, every=100))

    async def feed(versions: range, reward: Callable[[int], float], correct: Callable[[int], int]) -> None:
        for v in versions:
            hb = Heartbeat(service="trainer", instance="trainer-0", seq=v, ts=time.time(), version=v,
                           metrics={TrainerKeys.VERSION: v, TrainerKeys.STEP: v, TrainerKeys.REWARD_MEAN: reward(v)})
            await bus.publish(bus.subjects.metrics("trainer", "trainer-0"), hb.encode(), msg_id=hb.msg_id)
            if v % 2 == 0:  # a held-out round of 4 tasks, ``correct(v)`` of them right
                for i in range(4):
                    g = scored(v, f"add-{i}", [1.0 if i < correct(v) else 0.0])
                    await bus.publish(bus.subjects.scored("eval"), g.encode(), msg_id=g.task.task_id)
            await asyncio.sleep(0.01)

    def records() -> list[tuple[str, Control]]:
        return [(s, ctl) for s, ctl in decisions(bus) if isinstance(ctl.decision, Divergence)]

    with capture_logs() as logs:
        async with running(c.workers(), life):
            await feed(range(1, 13), lambda v: 0.1 * v, lambda v: 4 if v < 6 else (2 if v < 10 else 0))
            await eventually(lambda: len(records()) == 1)
            assert c.metrics()["controller/divergence"] == 1.0
            assert c.metrics()["controller/divergence/heldout_trend"] < 0
            snap = build_snapshot(RUN, [], [], [ctl for _, ctl in decisions(bus)], now=time.time())
            assert "training reward +" in snap["divergences"]["controller-0"]["detail"]
            # The verifier is fixed: held-out accuracy recovers over the next window.
            await feed(range(13, 25), lambda v: 0.1 * v, lambda v: 1 if v < 18 else 4)
            await eventually(lambda: len(records()) == 2)
    warned = [e for e in logs if e["event"] == "reward_heldout_divergence"]
    assert [e["log_level"] for e in warned] == ["warning"]
    assert warned[0]["reward_trend"] > 0 > warned[0]["heldout_trend"] and "reward hacking" in warned[0]["detail"]
    assert [e["log_level"] for e in logs if e["event"] == "divergence_cleared"] == ["info"]
    (subject, fired), (_, cleared) = records()
    assert subject == bus.subjects.control_action("controller", "controller-0", "divergence")
    assert fired.decision.firing and fired.issuer == "controller-0" and fired.inputs["window"] == 12
    assert fired.decision.reward_trend > 0 > fired.decision.heldout_trend
    assert not cleared.decision.firing and cleared.seq > fired.seq
    assert bus.dead_letters == []  # its own records, read back, are not refused as requests
    assert c.metrics()["controller/divergence"] == 0.0
    snap = build_snapshot(RUN, [], [], [ctl for _, ctl in decisions(bus)], now=time.time())
    assert snap["divergences"] == {}
