"""Chaos on one real run: bad inputs, a late generator, every service kind killed with -9 and
restarted, then two kinds at once (generator and environment, trainer and reward, controller and
weight-broadcast), the only nats-server stopped for 90 s and started again, and the environment
frozen until the controller reports the stall and its cause.

One scenario on one pipeline (each service a real process on a real nats-server with file
storage) because the promise is about the *same* run: it survives all of it, keeps training and,
at the end, every task is accounted for exactly once (trained, filtered or dropped with its reason
in the ledger, or dead-lettered with a reason), no group was trained twice, weight versions only
increase and each number names one set of weights, and a restarted generator rejoins at the latest
version.

Tasks are fed in waves: after each restart a new wave must be trained on (progress after the
fault), and the next fault strikes while the rest of it is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import Counter

import msgpack
import numpy as np
import pytest

from rlbus.schemas import Control, Rollout, RolloutGroup, Shard, Task, WeightManifest
from rlbus.schemas.control import Stall
from rlbus.services.tasks.addition import make_split
from tests.e2e.harness import Pipeline, checkpoint_state, last_words, wait_heartbeat, wait_message
from tests.integration.helpers import dead_letters

pytestmark = [pytest.mark.slow, pytest.mark.integration]

WAVE = 64  # tasks per wave: about 5 trainer steps of 8 groups once zero-variance groups are dropped
OUTAGE_S = 90.0
KILL_ORDER = ("controller", "environment", "reward", "broadcast", "gen-0", "trainer")
# Two kinds at once, each pair a consumer and what it depends on or feeds: the generator loses the
# environment it resets with, the trainer the reward that feeds it, the controller the
# weight-broadcast whose versions it watches.
KILL_PAIRS = (("gen-0", "environment"), ("trainer", "reward"), ("controller", "broadcast"))
STEP_TIMEOUT = 300.0  # generous: a loaded 2-core machine restarting a torch service


def _tables(model: str) -> dict:
    return {
        "run": {"run": "chaos", "model_path": model, "batch_groups": 8, "group_size": 8, "max_staleness": 1},
        "trainer": {"lr": 1e-4, "ack_wait": 4.0, "checkpoint_every": 2},
        # A short stall window, so the frozen environment below is reported within the test.
        "controller": {"eval_every": 0, "stall_after": 15.0},
        "generator": {"max_batch_groups": 8},
        "broadcast": {}, "reward": {}, "environment": {},
    }


class VersionLog:
    """Every weight version the run publishes, in stream order, and the digests each names."""

    def __init__(self, bus, subject: str) -> None:
        self.seen: list[tuple[int, tuple[str, ...]]] = []
        self._watch = bus.watch(subject, deliver="all")
        self.task = asyncio.create_task(self._follow())

    async def _follow(self) -> None:
        async for d in self._watch:
            m = WeightManifest.decode(d.msg)
            self.seen.append((m.version, tuple(s.sha256 for s in m.shards)))

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self._watch.aclose()

    def check(self) -> None:
        versions = [v for v, _ in self.seen]
        assert versions == sorted(set(versions)), f"versions not strictly increasing: {versions}"
        digests: dict[int, set[tuple[str, ...]]] = {}
        for v, d in self.seen:
            digests.setdefault(v, set()).add(d)
        assert all(len(d) == 1 for d in digests.values()), "a version number names two sets of weights"


class Feeder:
    def __init__(self, bus, subjects) -> None:
        self.bus, self.s = bus, subjects
        self.tasks = [Task(run="chaos", task_id=t.task_id, pool="train", env="addition", prompt=t.prompt,
                           answer=t.answer, group_size=8) for t in make_split("train", WAVE * 13, seed=3)]
        self.sent = 0

    async def wave(self) -> None:
        batch = self.tasks[self.sent:self.sent + WAVE]
        await self.bus.publish_many([(self.s.tasks("train"), t.encode(), t.msg_id) for t in batch])
        self.sent += len(batch)


async def publish_bad_inputs(bus, s) -> None:
    """Each must end in DEAD with its reason; the run must not notice."""
    unknown_env = Task(run="chaos", task_id="bad-env", pool="train", env="nope", prompt="1+1=", answer="2")
    await bus.publish(s.tasks("train"), unknown_env.encode(), msg_id="task.bad-env")
    empty = Task(run="chaos", task_id="bad-empty", pool="train", env="addition", prompt="x")._to_wire()
    empty["prompt"] = ""
    await bus.publish(s.tasks("train"), msgpack.packb(empty, use_bin_type=True), msg_id="task.bad-empty")
    r = Rollout(rollout_id="nan:0", task_id="nan", index=0, token_ids=np.arange(4, dtype="<i4"), prompt_len=2,
                loss_mask=np.ones(2, "u1"), behaviour_logprobs=np.array([-0.1, -0.2], "<f4"),
                version_spans=np.array([[0, 0]], "<i8"))
    wire = RolloutGroup(task=Task(run="chaos", task_id="nan", pool="train", env="addition", prompt="1+1="),
                        rollouts=[r])._to_wire()
    wire["rollouts"][0]["behaviour_logprobs"]["data"] = np.array([np.nan, -0.2], "<f4").tobytes()
    await bus.publish(s.rollouts("train"), msgpack.packb(wire, use_bin_type=True), msg_id="rollouts.nan")
    forged = WeightManifest(model="policy", version=10_000, transport="objstore", state="uploaded",
                            shards=[Shard(name="model.safetensors", sha256="0" * 64, size=4,
                                          location="weights/forged/model.safetensors")])
    await bus.objects.put("weights/forged/model.safetensors", b"evil")
    await bus.publish(s.weight_uploads("policy"), forged.encode(), msg_id="upload.forged")


async def kill_and_restart(p: Pipeline, bus, names: tuple[str, ...]) -> float:
    """Kill -9 every process in ``names`` together (work in flight), restart them and wait until
    each heartbeats again, a generator at the version that was latest at the kill; returns the
    time of the kill."""
    s = p.subjects
    latest = WeightManifest.decode(await bus.last(s.weights("policy"))).version
    t_kill = time.time()
    for name in names:
        p.kill9(name)
    for name in names:
        if name.startswith("gen-"):
            p.start_generator(name)
        else:
            p.start(name, name)
    for name in names:
        if name.startswith("gen-"):
            rejoined = await wait_heartbeat(
                bus, lambda h, n=name: h.instance == n and h.ts > t_kill and h.version >= latest,
                timeout=STEP_TIMEOUT)
            assert rejoined.version >= latest
        else:
            await back_after(bus, t_kill, name)
    return t_kill


async def back_after(bus, t_kill: float, service: str) -> None:
    """A heartbeat from the restarted process: sent after the kill, so not the dead one's last."""
    await wait_heartbeat(bus, lambda h: h.ts > t_kill and h.service == service, timeout=STEP_TIMEOUT)


async def trains_again(bus, feeder: Feeder, since: float) -> None:
    """The run makes progress on work published after a fault: a wave of new tasks, then a trainer
    step beyond the one it reported first after ``since``."""
    first = await wait_heartbeat(bus, lambda h: h.service == "trainer" and h.ts > since, timeout=STEP_TIMEOUT)
    step = first.metrics.get("trainer/step", 0)
    await feeder.wave()
    await wait_heartbeat(bus, lambda h: h.service == "trainer" and h.metrics.get("trainer/step", 0) > step,
                         timeout=STEP_TIMEOUT)


def assert_all_alive(p: Pipeline) -> None:
    dead = [f"{c.name} (exit {c.proc.returncode})" for c in p.children.children if c.proc.poll() is not None]
    assert not dead, f"services died: {dead}\n{p.logs()}"


async def test_a_run_survives_every_service_killed_and_a_90_s_server_outage(tiny_model, tmp_path):
    with Pipeline(tmp_path, _tables(str(tiny_model))) as p:
        p.start_all(1)
        bus = await p.bus()
        s = p.subjects
        versions = VersionLog(bus, s.weights("policy"))
        feeder = Feeder(bus, s)
        await publish_bad_inputs(bus, s)
        await feeder.wave()
        await wait_heartbeat(bus, lambda h: h.service == "broadcast" and h.version >= 3, timeout=STEP_TIMEOUT)

        # --- a second generator joins mid-run and serves the latest version -------------------
        latest = WeightManifest.decode(await bus.last(s.weights("policy"))).version
        p.start_generator("gen-1")
        joined = await wait_heartbeat(bus, lambda h: h.instance == "gen-1" and h.version >= latest, timeout=STEP_TIMEOUT)
        assert joined.version >= latest >= 3

        # --- each service kind killed with -9 (work in flight) and restarted, then two at once --
        for names in [(name,) for name in KILL_ORDER] + list(KILL_PAIRS):
            t_kill = await kill_and_restart(p, bus, names)
            await trains_again(bus, feeder, t_kill)
            assert_all_alive(p)
            print(f"chaos: {'+'.join(names)} killed, back and training on a new wave after "
                  f"{time.time() - t_kill:.0f} s")

        # --- the only server away for 90 s (work in flight), then back on the same port and store
        p.server.stop()
        await asyncio.sleep(OUTAGE_S)
        assert_all_alive(p)
        t_back = time.time()
        p.server.start()
        await trains_again(bus, feeder, t_back)
        assert_all_alive(p)

        # --- the environment frozen (SIGSTOP: up, silent, answering nothing) while work waits: the
        # controller reports the stall with its cause, and its end once the environment is back
        t_freeze = time.time()
        env_pid = p.by_name["environment"].proc.pid
        os.kill(env_pid, signal.SIGSTOP)
        try:
            await feeder.wave()
            stall = await next_stall(bus, s, lambda st: st.cause == "environment_not_answering", since=t_freeze)
            assert "environment" in stall.detail, stall
        finally:
            os.kill(env_pid, signal.SIGCONT)
        await next_stall(bus, s, lambda st: st.cause == "", since=t_freeze)
        await trains_again(bus, feeder, time.time())
        assert_all_alive(p)

        # --- account for every task -----------------------------------------------------------
        n_total = feeder.sent + 3  # + the bad task, the empty prompt and the NaN rollout group
        seen = await settle(p, bus, n_total)
        assert_all_alive(p)
        versions.check()

        dead = await dead_letters(bus, None, timeout=2.0)
        why = [f"{d.reason}: {d.error}" for d in dead]
        assert any("unknown environment 'nope'" in w for w in why), why
        assert any("empty prompt" in w for w in why), why
        assert any("non-finite" in w and d.origin_subject == s.rollouts("train") for w, d in zip(why, dead, strict=True)), why
        assert any("sha256" in w for w in why), why
        assert all(d.data and d.reason for d in dead), "dead letters keep the original bytes and a reason"
        assert max(v for v, _ in versions.seen) < 10_000, "the forged version was never published"
        # Trained at most once: the trainer's own count equals the distinct ids it recorded.
        state = checkpoint_state(tmp_path)
        ledger = Counter(state["consumed"].values())
        assert state["counters"]["groups_trained_total"] == ledger["train"], (ledger, state["counters"], seen)
        await versions.close()
        await bus.close()


async def settle(p: Pipeline, bus, n_total: int) -> dict:
    """Wait until every task is in the trainer's ledger, dead-lettered from the task or rollout
    stage, or held un-acked by the trainer; return what was counted.

    The trainer acks a group only once the checkpoint after the one that records it is saved
    (a damaged newest checkpoint must lose nothing), so the newest checkpoint's groups are both
    in the ledger and still ack-pending: its heartbeat says how many, and they count once.  Its
    heartbeat, the ledger and the stream are read at different moments: poll for a settled state.
    A group really lost or really counted twice never settles, and the assertion names the counts."""
    s = p.subjects
    deadline = time.monotonic() + 600
    while True:
        state = checkpoint_state(p.root)
        streams = {x.name: x for x in await bus.streams()}
        trainer_c = next(c for c in streams[s.stream("SCORED")].consumers if c.name == s.durable("trainer"))
        dead = await dead_letters(bus, None, timeout=1.0)
        trainer_hb = await wait_heartbeat(bus, lambda h: h.service == "trainer", timeout=STEP_TIMEOUT)
        dead_tasks = {dead_task_id(d) for d in dead if d.origin_subject in (s.tasks("train"), s.rollouts("train"))}
        seen = dict(ledger=len(state["consumed"]), dead=len(dead_tasks),
                    tasks=streams[s.stream("TASKS")].messages, rollouts=streams[s.stream("ROLLOUTS")].messages,
                    scored_pending=trainer_c.pending, ack_pending=trainer_c.ack_pending,
                    held_in_ledger=int(trainer_hb.metrics.get("trainer/held_checkpointed_groups", -1)))
        # Drained: every task became a scored group the trainer took; what it still holds un-acked
        # (a batch that has not filled, or a step its next checkpoint will cover) counts as held,
        # once: less what the ledger already has.
        drained = seen["tasks"] == seen["rollouts"] == seen["scored_pending"] == 0
        held = seen["ack_pending"] - seen["held_in_ledger"]
        if drained and seen["held_in_ledger"] >= 0 and seen["ledger"] + seen["dead"] + held == n_total:
            assert not set(state["consumed"]) & dead_tasks, "a task both trained and dead-lettered"
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"the run did not settle: {seen} of {n_total} tasks\n{await last_words(bus)}")
        await asyncio.sleep(1.0)


async def next_stall(bus, s, pred, *, since: float, timeout: float = STEP_TIMEOUT) -> Stall:
    """The first stall record (or its clearing) the controller publishes after ``since`` that
    satisfies ``pred``: read from CONTROL, where ``rlbus status`` reads it."""
    ctl = await wait_message(
        bus, s.control_action("controller", "controller-0", "stall"), Control.decode,
        lambda c: c.issued_at > since and isinstance(c.decision, Stall) and pred(c.decision), timeout, "stall record")
    return ctl.decision


def dead_task_id(d) -> str:
    """The task a dead letter from the task or rollout stage was for (read from its raw bytes,
    which need not decode as the schema)."""
    with contextlib.suppress(Exception):
        m = msgpack.unpackb(d.data, raw=False)
        return str(m["task"]["task_id"] if "task" in m else m["task_id"])
    return f"undecodable:{d.stream_seq}"
