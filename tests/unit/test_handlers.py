"""Handlers of the reward and environment services, directly and on the in-memory bus.

What a user cares about: a right answer scores 1 and a wrong one 0; a verifier that crashes
excludes that rollout instead of scoring it 0; a group nobody can score is dead-lettered with a
reason that says what to do; an environment never dies on a bad request, it answers with an
error the generator can dead-letter.
"""

from __future__ import annotations

import asyncio
import math
import time

import msgpack
import numpy as np
import pytest

from rlbus.bus.memory import MemoryBus
from rlbus.bus.protocol import Poison, RequestFailed
from rlbus.schemas import (
    DeadLetter,
    EnvReply,
    EnvReplyBatch,
    EnvReset,
    EnvResetBatch,
    Rollout,
    RolloutGroup,
    ScoredGroup,
    Task,
    spans_from_versions,
)
from rlbus.services.environment import service as env_service
from rlbus.services.environment.service import EnvironmentServer
from rlbus.services.environment.settings import EnvironmentSettings
from rlbus.services.reward import service as reward_service
from rlbus.services.reward.service import Scorer
from rlbus.services.reward.settings import RewardSettings
from rlbus.services.reward.verifiers import VERIFIERS, Verdict
from rlbus.services.runtime.config import RunSettings
from rlbus.services.runtime.lifecycle import Lifecycle
from rlbus.services.runtime.tokens import TextCodec
from rlbus.services.trainer.batch import Assembler

RUN = "test"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A policy folder as far as the environment is concerned: just the tokenizer."""
    from rlbus.services.policy.tokenizer import build_char_tokenizer

    folder = tmp_path_factory.mktemp("policy")
    build_char_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def codec(model_dir) -> TextCodec:
    return TextCodec.from_folder(model_dir)


def task(task_id: str = "add-123-456", **kw) -> Task:
    base = dict(run=RUN, task_id=task_id, pool="train", env="addition", prompt="123+456=", answer="579",
                group_size=3)
    base.update(kw)
    return Task(**base)


def rollout_group(texts: list[str], t: Task | None = None) -> RolloutGroup:
    t = t or task()
    rollouts = []
    for i, text in enumerate(texts):
        n = len(text) + 1
        rollouts.append(Rollout(
            rollout_id=f"{t.task_id}/{i}", task_id=t.task_id, index=i, token_ids=np.ones(9 + n, dtype="<i4"),
            prompt_len=9, loss_mask=np.ones(n, dtype="|u1"), behaviour_logprobs=np.full(n, -0.3, dtype="<f4"),
            version_spans=spans_from_versions(np.zeros(n)), text=text, generator_id="gen-0"))
    return RolloutGroup(task=t, rollouts=rollouts, generator_id="gen-0", created_at=time.time())


async def eventually(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met within the deadline")
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------------------------------
# reward: the Scorer itself


async def test_right_answers_score_one_and_wrong_answers_zero():
    scorer = Scorer(RewardSettings())
    out = await scorer.score(rollout_group(["579", "578", " 579 "]))
    assert [s.reward for s in out.scored] == [1.0, 0.0, 1.0]
    assert all(s.valid for s in out.scored)
    assert "expected '579', got '578'" in out.scored[1].verifier_detail
    assert out.task.task_id == "add-123-456" and out.generator_id == "gen-0"
    assert scorer.metrics() == {"reward/groups": 1, "reward/rollouts": 3, "reward/verifier_errors": 0,
                                "reward/env_failures": 0, "reward/tampering": 0, "reward/mean": pytest.approx(2 / 3)}


async def test_format_weight_adds_to_the_reward():
    out = await Scorer(RewardSettings(format_weight=0.5)).score(rollout_group(["579", "578", "579 apples"]))
    assert [s.reward for s in out.scored] == [1.5, 0.5, 0.0]


async def test_a_crashing_verifier_excludes_that_rollout_instead_of_scoring_it_zero(monkeypatch):
    class Flaky:
        def __call__(self, task, rollout):
            if rollout.index == 1:
                raise TimeoutError("sandbox did not answer")
            if rollout.index == 2:
                return Verdict(math.nan)  # a bug in a verifier: not a score either
            return Verdict(float(rollout.text == task.answer))

    monkeypatch.setitem(VERIFIERS._factories, "flaky", Flaky)
    scorer = Scorer(RewardSettings())
    out = await scorer.score(rollout_group(["579", "579", "579", "0"], task(verifier="flaky", group_size=4)))
    assert [s.valid for s in out.scored] == [True, False, False, True]
    assert out.scored[1].verifier_error == "flaky: TimeoutError('sandbox did not answer')"
    assert out.scored[2].verifier_error.startswith("flaky: SchemaError")
    assert scorer.metrics()["reward/verifier_errors"] == 2
    # The trainer neither trains on nor baselines the errored rollouts.
    d = Assembler(batch_groups=1, max_staleness=0).offer(ScoredGroup.decode(out.encode()), None, version=0,
                                                          consumed=set())
    assert d.train_mask == [True, False, False, True] and d.reason == "train"


async def test_a_group_nobody_can_score_is_invalid_for_the_trainer():
    out = await Scorer(RewardSettings()).score(rollout_group(["579", "1"], task(answer="", group_size=2)))
    assert all("no reference answer" in s.verifier_error for s in out.scored)
    d = Assembler(batch_groups=1, max_staleness=0).offer(out, None, version=0, consumed=set())
    assert d.reason == "invalid"


async def test_an_unknown_verifier_poisons_the_group_with_the_registered_names():
    with pytest.raises(Poison) as info:
        await Scorer(RewardSettings()).score(rollout_group(["579"], task(verifier="regex", group_size=1)))
    assert "unknown verifier 'regex'" in info.value.reason and "addition" in info.value.reason


# ---------------------------------------------------------------------------------------
# reward: the service on the in-memory bus


async def test_reward_service_scores_dedupes_and_dead_letters(tmp_path):
    bus = MemoryBus(RUN)
    life = Lifecycle(grace=1.0)
    run_cfg = RunSettings(run=RUN, run_dir=str(tmp_path))
    service = asyncio.create_task(reward_service.run(run_cfg, RewardSettings(batch=4), bus=bus, life=life))
    try:
        subject = bus.subjects.rollouts("train")
        good = rollout_group(["579", "578", "579"])
        await bus.publish(subject, good.encode(), msg_id="rollouts.add-123-456")
        # A redelivery after a generator crash, republished under another id: scored once.
        await bus.publish(subject, good.encode(), msg_id="rollouts.add-123-456.retry")
        lost = rollout_group(["1"], task("add-1-0", verifier="regex", group_size=1))
        await bus.publish(subject, lost.encode(), msg_id="rollouts.add-1-0")
        await bus.publish(subject, b"\x93not a group", msg_id="rollouts.garbage")
        await eventually(lambda: len(bus.dead_letters) == 2 and not [
            s for s in bus.messages("ROLLOUTS")])
        scored = bus.messages("SCORED")
        assert [s for s, _ in scored] == [bus.subjects.scored("train")]
        group = ScoredGroup.decode(scored[0][1])
        assert [s.reward for s in group.scored] == [1.0, 0.0, 1.0]
        poisoned = next(d for d in bus.dead_letters if "regex" in d.reason)
        assert "registered" in poisoned.reason and RolloutGroup.decode(poisoned.data).task.task_id == "add-1-0"
        garbage = next(d for d in bus.dead_letters if d is not poisoned)
        assert garbage.reason == "schema_error" and "not valid msgpack" in garbage.error
        assert garbage.data == b"\x93not a group"  # kept byte for byte
        # Dead letters are on the bus too, decodable by `rlbus status`.
        assert len(bus.messages("DEAD")) == 2
        assert all(DeadLetter.decode(data).origin_subject == subject for _, data in bus.messages("DEAD"))
    finally:
        life.shutdown()
        await asyncio.wait_for(service, 5)
        await bus.close()


# ---------------------------------------------------------------------------------------
# environment


def reset_bytes(t: Task) -> bytes:
    return EnvReset(task=t).encode()


async def test_reset_renders_the_prompt(codec):
    server = EnvironmentServer(codec)
    reply = EnvReply.decode(await server.handle_reset(reset_bytes(task())))
    assert reply.error == "" and reply.episode_id == "add-123-456"
    assert reply.observation_ids[0] == codec.bos_id
    assert codec.decode(reply.observation_ids.tolist()) == "123+456="
    assert (server.served, server.errors) == (1, 0)


async def test_reset_of_an_unknown_environment_is_an_error_reply(codec):
    server = EnvironmentServer(codec)
    reply = EnvReply.decode(await server.handle_reset(reset_bytes(task(env="chess"))))
    assert "unknown environment 'chess'" in reply.error
    assert "addition" in reply.error and "single_turn" in reply.error  # what exists instead
    assert len(reply.observation_ids) == 0 and not reply.done
    assert (server.served, server.errors) == (0, 1)
    # The server is still fine for the next request.
    assert EnvReply.decode(await server.handle_reset(reset_bytes(task()))).error == ""


async def test_reset_of_an_empty_prompt_task_is_an_error_reply(codec):
    """A task with no prompt cannot even be built here; one from a foreign producer is refused."""
    w = msgpack.unpackb(reset_bytes(task()), raw=False)
    w["task"]["prompt"] = ""
    reply = EnvReply.decode(await EnvironmentServer(codec).handle_reset(msgpack.packb(w, use_bin_type=True)))
    assert "empty prompt" in reply.error


async def test_reset_of_a_prompt_that_tokenises_to_nothing_is_an_error_reply(codec):
    t = task(env="single_turn", prompt="", prompt_ids=np.array([codec.bos_id], dtype="<i4"))
    reply = EnvReply.decode(await EnvironmentServer(codec).handle_reset(reset_bytes(t)))
    assert "empty prompt after tokenisation" in reply.error


async def test_batch_reset_answers_each_task_on_its_own(codec):
    server = EnvironmentServer(codec)
    req = EnvResetBatch(tasks=[task(), task(env="chess"), task("add-1-2", prompt="1+2=", answer="3")]).encode()
    replies = EnvReplyBatch.decode(await server.handle_reset_batch(req)).replies
    assert [r.error == "" for r in replies] == [True, False, True]
    assert "unknown environment 'chess'" in replies[1].error  # refuses that task only
    assert codec.decode(replies[2].observation_ids.tolist()) == "1+2="
    assert (server.served, server.errors) == (2, 1)
    garbage = EnvReplyBatch.decode(await server.handle_reset_batch(b"\x00\x01"))
    assert garbage.replies == [] and "env_reset_batch" in garbage.error and "msgpack" in garbage.error


async def test_reset_of_garbage_is_an_error_reply(codec):
    reply = EnvReply.decode(await EnvironmentServer(codec).handle_reset(b"\x00\x01"))
    assert "env_reset" in reply.error and "msgpack" in reply.error


async def test_environment_service_answers_generators_over_the_bus(tmp_path, model_dir, codec):
    bus = MemoryBus(RUN)
    life = Lifecycle(grace=1.0)
    run_cfg = RunSettings(run=RUN, model_path=str(model_dir), run_dir=str(tmp_path))
    service = asyncio.create_task(env_service.run(run_cfg, EnvironmentSettings(), bus=bus, life=life))
    try:
        async def reset(t: Task) -> EnvReply:
            deadline = time.monotonic() + 5.0
            while True:  # the service may still be starting: no responders yet
                try:
                    raw = await bus.request(bus.subjects.env(t.env, "reset"), reset_bytes(t), timeout=2.0)
                    return EnvReply.decode(raw)
                except RequestFailed:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.01)

        ok = await reset(task())
        assert ok.error == "" and codec.decode(ok.observation_ids.tolist()) == "123+456="
        unknown = await reset(task(env="chess"))
        assert "unknown environment 'chess'" in unknown.error
        bad = await reset(task(env="addition", prompt="", prompt_ids=np.array([5], dtype="<i4")))
        assert "env_config" in bad.error  # the reason reaches the generator, which dead-letters the task
    finally:
        life.shutdown()
        await asyncio.wait_for(service, 5)
        await bus.close()
