"""A vLLM generator joins a running pipeline (real processes, real nats-server) and serves the
latest policy version, then follows the next one in place.
"""

from __future__ import annotations

import pytest

from rlbus.schemas import WeightManifest
from rlbus.services.tasks.addition import make_split
from tests.e2e.harness import Pipeline, wait_heartbeat

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.integration]

N_TASKS = 2000
JOIN_SLOWDOWN = 20.0


async def test_vllm_generator_joins_mid_run_and_serves_the_latest_version(tiny_model, tmp_path):
    from rlbus.schemas import Task

    tables = {
        "run": {"run": "vllmjoin", "model_path": str(tiny_model), "batch_groups": 8, "group_size": 8,
                "max_staleness": 1},
        "trainer": {"lr": 1e-4, "checkpoint_every": 50},
        "controller": {"eval_every": 0},
        "generator": {"max_batch_groups": 8},
        "broadcast": {}, "reward": {}, "environment": {},
    }
    with Pipeline(tmp_path, tables) as p:
        p.start_all(1, slowdown=1.0)
        # The vLLM engine start (two spawned processes that import vLLM: about a minute on a small
        # CPU) overlaps the pipeline's own start: gen-vllm's process starts now, and it joins the run
        # (first heartbeat, weights watch, task consumer) only once its engine is up, long after the
        # run has reached version 2 (checked below).
        p.start_generator("gen-vllm", env={"RLBUS_GENERATOR__BACKEND": '"vllm"'})
        bus = await p.bus()
        s = p.subjects
        tasks = [Task(run="vllmjoin", task_id=t.task_id, pool="train", env="addition", prompt=t.prompt,
                      answer=t.answer, group_size=8) for t in make_split("train", N_TASKS, seed=4)]
        await bus.publish_many([(s.tasks("train"), t.encode(), t.msg_id) for t in tasks])
        await wait_heartbeat(bus, lambda h: h.service == "broadcast" and h.version >= 2, timeout=240)

        latest = WeightManifest.decode(await bus.last(s.weights("policy"))).version
        assert await bus.last(s.metrics("generator", "gen-vllm")) is None, (
            "gen-vllm joined before the run reached version 2: nothing here tests a late join")
        # The rest of the engine start competes with the running pipeline for cores: gen-0 keeps the
        # run going, slowed, until gen-vllm joins, and then runs at full speed again.
        p.set_slowdown("gen-0", JOIN_SLOWDOWN)
        joined = await wait_heartbeat(bus, lambda h: h.instance == "gen-vllm" and h.version >= latest, timeout=300)
        p.set_slowdown("gen-0", 1.0)
        assert joined.info.get("backend") == "vllm"
        assert joined.version >= latest >= 2
        # It serves (publishes groups that the trainer consumes) and follows a newer version in place.
        served = await wait_heartbeat(
            bus, lambda h: h.instance == "gen-vllm" and h.version > joined.version
            and h.metrics.get("generator/groups_published", 0) > 0, timeout=300)
        print({k: v for k, v in served.metrics.items() if k.startswith("generator/")})
        assert served.metrics["generator/swaps"] >= 2
        assert served.metrics["generator/swap_pause_max_s"] > 0
        await bus.close()
