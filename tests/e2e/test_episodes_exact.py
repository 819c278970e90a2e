"""Token-exactness of multi-turn episodes through the real generator process on a real nats-server.

A generator process (the PyTorch backend and its episode engine, the real tiny policy) plays two-turn
episodes against an environment service that runs in this process (the service's own code, with a
scripted episodic environment registered here: the tiny policy does not call tools by itself).  The
published group is checked token by token: the prompt, each policy turn followed by exactly the
observation ids the environment encoded (appended, never re-tokenised), the loss mask, the versions,
and the behaviour logprobs of every policy token against a teacher-forced recompute of the whole
sequence with the trainer's own function; environment tokens carry logprob 0.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from rlbus.bus.jetstream import JetStreamBus
from rlbus.bus.protocol import ConsumerSpec
from rlbus.schemas import EpisodeLimits, RolloutGroup, SamplingParams, Task
from rlbus.services.environment import service as env_service
from rlbus.services.environment.envs import ENVIRONMENTS, PromptEnv, Turn
from rlbus.services.environment.settings import EnvironmentSettings
from rlbus.services.policy.load import load_policy
from rlbus.services.policy.logprobs import completion_logprobs
from rlbus.services.policy.sampling import SamplingParams as PolicySampling
from rlbus.services.runtime.config import RunSettings
from rlbus.services.runtime.lifecycle import Lifecycle
from rlbus.services.runtime.tokens import TextCodec
from tests.e2e.harness import Pipeline

pytestmark = [pytest.mark.slow, pytest.mark.integration]

OBSERVATION = " is 7 "  # what the scripted tool answers after the first turn
RUN = "episodes"
TEMPERATURE = 0.9


@ENVIRONMENTS.register("scripted_two_turns")
class ScriptedTwoTurns(PromptEnv):
    """Episodic: the first turn gets ``OBSERVATION`` back, the second ends the episode."""

    episodic: ClassVar[bool] = True

    def open(self, task: Task, episode_id: str) -> dict[str, int]:
        return {"turns": 0}

    async def step(self, state: dict[str, int], action_text: str, budget_s: float) -> Turn:
        state["turns"] += 1
        if state["turns"] == 1:
            return Turn(observation=OBSERVATION, tool_s=0.01)
        return Turn(done=True, finish_reason="done")

    def close(self, state: Any) -> None:
        pass


def tables(model: Path, deterministic: bool = False) -> dict[str, dict[str, Any]]:
    return {"run": {"run": RUN, "model_path": str(model), "group_size": 3, "pools": ["train"], "eval_pool": "eval"},
            "generator": {"admission": False, "min_batch_groups": 1, "batch_wait_s": 0.0,
                          "deterministic": deterministic}}


async def play(p: Pipeline, model: Path, n_tasks: int) -> list[RolloutGroup]:
    run_cfg = RunSettings(run=RUN, model_path=str(model), nats_url=p.server.url, run_dir=str(p.root))
    life = Lifecycle(grace=2.0)
    env_bus = await JetStreamBus.connect(p.server.url, RUN, name="e2e-env")
    env = asyncio.create_task(env_service.run(run_cfg, EnvironmentSettings(instance="env-a"), bus=env_bus, life=life))
    bus = await p.bus()
    try:
        for i in range(n_tasks):
            t = Task(run=RUN, task_id=f"ep-{i}", pool="train", env="scripted_two_turns", prompt=f"{100 + i}+{200 + i}=",
                     group_size=3, sampling=SamplingParams(temperature=TEMPERATURE, max_new_tokens=6),
                     limits=EpisodeLimits(max_turns=4))
            await bus.publish(p.subjects.tasks("train"), t.encode(), msg_id=t.msg_id)
        p.start_generator("gen-0")
        groups: dict[str, RolloutGroup] = {}
        # ROLLOUTS is a work queue and no reward service runs here: this test is its consumer.
        puller = bus.puller(ConsumerSpec(stream="ROLLOUTS", durable="e2e_reader",
                                         filter_subjects=(p.subjects.rollouts("train"),)), RolloutGroup.decode)
        async with asyncio.timeout(240):
            while len(groups) < n_tasks:
                for d in await puller.fetch(8, timeout=1.0):
                    groups[d.msg.task.task_id] = d.msg
                    await d.ack()
        return list(groups.values())
    finally:
        await bus.close()
        life.shutdown()
        await asyncio.wait_for(env, 10)
        await env_bus.close()


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_two_turn_episodes_are_token_exact(tiny_model: Path, tmp_path: Path, deterministic: bool) -> None:
    """Deterministic mode: each episode is recomputed whole at its end, so its policy tokens carry
    exactly the trainer's batch-invariant logprobs of the whole sequence (bit for bit), claimed
    by ``exact_logprobs`` (no trainer here: no swap can come between an episode's end and that)."""
    with Pipeline(tmp_path, tables(tiny_model, deterministic)) as p:
        groups = asyncio.run(play(p, tiny_model, n_tasks=4))
    codec = TextCodec.from_folder(str(tiny_model))
    observation = codec.encode(OBSERVATION)
    model, _ = load_policy(str(tiny_model), attn="eager")
    assert len(groups) == 4
    for g in groups:
        assert len(g.rollouts) == 3
        for r in g.rollouts:
            ids = r.token_ids.tolist()
            completion, mask = ids[r.prompt_len:], r.loss_mask.tolist()
            assert ids[: r.prompt_len] == [codec.bos_id, *codec.encode(g.task.prompt)]
            assert (r.turns, r.finish_reason, r.env_error) == (2, "done", "")
            # Policy turn, then exactly the environment's ids (mask 0), then the second policy turn.
            first = mask.index(0)
            assert completion[first:first + len(observation)] == observation
            assert mask == [1] * first + [0] * len(observation) + [1] * (len(mask) - first - len(observation))
            assert len(mask) - first - len(observation) >= 1, "a second policy turn"
            lp = r.behaviour_logprobs
            assert np.all(lp[np.asarray(mask) == 0] == 0.0)
            assert set(r.token_versions().tolist()) == {0}  # no trainer: the initial weights throughout
            # The trainer's teacher-forced recompute of the whole sequence, at the policy tokens.
            params = PolicySampling(temperature=TEMPERATURE, top_p=1.0, max_new_tokens=len(completion))
            with torch.no_grad():
                (recomputed,) = completion_logprobs(model, [(ids[: r.prompt_len], completion)], params,
                                                    deterministic=deterministic)
            policy = np.asarray(mask) == 1
            assert r.exact_logprobs == deterministic
            if deterministic:
                assert np.array_equal(lp[policy], recomputed.numpy()[policy]), "not the trainer's bits"
            else:
                np.testing.assert_allclose(lp[policy], recomputed.numpy()[policy], atol=2e-4)
