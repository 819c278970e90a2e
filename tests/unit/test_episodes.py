"""Episodic environments without a bus: the calculator's parser and format, the episode store
(TTL, bound, unknown vs expired), the episode host's limits and failure kinds, and the
verifiers that score what a policy answered (never what a tool printed)."""

from __future__ import annotations

import builtins
import dataclasses
from fractions import Fraction

import numpy as np
import pytest

from rlbus.schemas import EnvReply, EnvReset, EnvStep, EpisodeLimits, Rollout, ScoredGroup, Task, spans_from_versions
from rlbus.services.environment.envs import ENVIRONMENTS, CalculatorEnv, EnvError, Turn
from rlbus.services.environment.episodes import EpisodeError, EpisodeHost, Episodes
from rlbus.services.reward.service import Scorer
from rlbus.services.reward.settings import RewardSettings
from rlbus.services.reward.verifiers import CalculatorVerifier, hidden_tests
from rlbus.services.runtime.tokens import TextCodec
from rlbus.services.tasks.calculator import CalcError, evaluate, final_answer, find_call, observation, render_prompt
from rlbus.services.tasks.code import CodeFormatError, code_blocks, submission
from rlbus.services.trainer.batch import Assembler

TERMS = [123, 456, 789, 101]  # sum 1469


@pytest.fixture(scope="module")
def codec(tmp_path_factory) -> TextCodec:
    from rlbus.services.policy.tokenizer import build_char_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    build_char_tokenizer().save_pretrained(folder)
    return TextCodec.from_folder(folder)


def calc_task(task_id: str = "calc-1", **kw) -> Task:
    base = dict(run="demo", task_id=task_id, pool="train", env="calculator", prompt="123+456+789+101=",
                env_config={"terms": TERMS}, answer="1469")
    base.update(kw)
    return Task(**base)


# ---------------------------------------------------------------------------------------
# the calculator's arithmetic


@pytest.mark.parametrize(("expr", "value"), [
    ("123+456+789+101", 1469), ("2+3*4", 14), ("(2+3)*4", 20), ("-3--4", 1), ("7/2", Fraction(7, 2)),
    (" 10 - 2 - 3 ", 5), ("2*(3+(4-1))/3", 4), ("-(5)", -5), ("0", 0)])
def test_calculator_evaluates_exactly(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize(("expr", "says"), [
    ("", "empty"), ("1+", "ends too early"), ("(1+2", "not closed"), ("1+2)", "unexpected ')'"),
    ("2**10", "expected a number"), ("1/0", "division by zero"), ("1/(2-2)", "division by zero"),
    ("__import__('os').system('true')", "not part of an expression"), ("1.5+1", "'.'"), ("1e3", "'e'"),
    ("9" * 19, "exceeds"), ("999999999*999999999*999999999", "exceeds"), ("1" + "+1" * 150, "characters"),
    ("(" * 40 + "1" + ")" * 40, "nests deeper"), ("-" * 40 + "1", "nests deeper"), ("٣+1", "not part of")])
def test_calculator_refuses_what_is_not_arithmetic(expr, says):
    with pytest.raises(CalcError, match=says.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        evaluate(expr)


def test_calculator_never_calls_eval(monkeypatch):
    def no(*a, **k):
        raise AssertionError("eval/exec must not be used on a policy's text")

    monkeypatch.setattr(builtins, "eval", no)
    monkeypatch.setattr(builtins, "exec", no)
    assert evaluate("(1+2)*3") == 9


def test_a_turn_ends_with_its_call_or_is_the_answer():
    assert find_call("1469") is None
    call = find_call("sum it calc(123+(456-1))  ")
    assert call is not None and (call.expression, call.before) == ("123+(456-1)", "sum it ")
    with pytest.raises(CalcError, match="not closed"):
        find_call("calc(1+(2")
    with pytest.raises(CalcError, match="text after the call"):
        find_call("calc(1+2) and more")


def test_observation_and_final_answer_format():
    assert observation(Fraction(1469)) == "=1469 " and observation(Fraction(-7, 2)) == "=-7/2 "
    assert render_prompt(TERMS) == "123+456+789+101="
    assert final_answer("calc(123+456)=579 calc(579+890)=1469 1469") == "1469"
    assert final_answer("1469") == "1469"  # no tool: the whole text is the answer


def test_calculator_tasks_split_by_their_terms_and_repeat_under_a_seed():
    from rlbus.services.tasks.calculator import make_split, split_of

    train, held = make_split("train", 200, seed=1), make_split("heldout", 50, seed=1)
    assert train == make_split("train", 200, seed=1) and train != make_split("train", 200, seed=2)
    assert not {tuple(sorted(t.terms)) for t in train} & {tuple(sorted(t.terms)) for t in held}
    assert all(split_of(t.terms[::-1]) == "heldout" for t in held)  # a reordering stays held out
    rec = held[0].record({"max_new_tokens": 24})
    assert rec["env"] == "calculator" and rec["answer"] == str(sum(held[0].terms))
    assert rec["prompt"] == "+".join(map(str, held[0].terms)) + "=" and rec["env_config"] == {"terms": list(held[0].terms)}
    Task(run="t", pool="train", **rec)  # a valid task as it stands


# ---------------------------------------------------------------------------------------
# the calculator verifier: the final answer, never the tool's output


def episode_rollout(segments: list[tuple[str, int]], turns: int, env_error: str = "") -> Rollout:
    """A completion of (text, mask) segments, one token per character (the char tokenizer's shape)."""
    text = "".join(t for t, _ in segments)
    mask = np.array([m for t, m in segments for _ in t], dtype="|u1")
    n = len(mask)
    return Rollout(rollout_id="calc-1/0", task_id="calc-1", index=0, token_ids=np.ones(1 + n, dtype="<i4"),
                   prompt_len=1, loss_mask=mask, behaviour_logprobs=np.zeros(n, dtype="<f4"),
                   version_spans=spans_from_versions(np.zeros(n)), text=text, turns=turns,
                   finish_reason="done", env_error=env_error)


CALL = ("calc(123+456+789+101)", 1)
OBS = ("=1469 ", 0)


@pytest.mark.parametrize(("segments", "turns", "reward"), [
    ([CALL, OBS, ("1469", 1)], 2, 1.0),  # used the tool, then answered
    ([("1469", 1)], 1, 1.0),  # answered without the tool: right is right
    ([CALL, OBS, ("1470", 1)], 2, 0.0),
    ([CALL, OBS], 1, 0.0),  # ended on the tool's output (max_turns): no answer was given
    ([CALL, OBS, ("", 1)], 2, 0.0),  # an empty final turn
    ([CALL, OBS, ("calc(1469)", 1), ("=1469 ", 0)], 2, 0.0),  # echoed the value through the tool again
    ([CALL, OBS, ("calc(1469)=1469 ", 1)], 2, 0.0),  # wrote a tool round itself instead of answering
    ([("the sum is 1469", 1)], 1, 0.0),  # not a bare number
])
def test_calculator_scores_the_final_answer_not_a_tool_output(segments, turns, reward):
    v = CalculatorVerifier()(calc_task(), episode_rollout(segments, turns))
    assert v.reward == reward and v.components["correct"] == reward, v.detail
    assert "'1469'" in v.detail


async def test_an_environment_failure_is_excluded_never_scored_zero():
    from rlbus.schemas import RolloutGroup

    ok = episode_rollout([CALL, OBS, ("1469", 1)], 2)
    broken = episode_rollout([CALL], 1, env_error="the environment failed: OSError: sandbox gone")
    group = RolloutGroup(task=calc_task(group_size=2),
                         rollouts=[ok, dataclasses.replace(broken, index=1, rollout_id="calc-1/1")])
    scorer = Scorer(RewardSettings())
    out = await scorer.score(group)
    assert [s.valid for s in out.scored] == [True, False] and out.scored[1].env_failure
    assert "sandbox gone" in out.scored[1].verifier_detail
    m = scorer.metrics()
    assert m["reward/env_failures"] == 1 and m["reward/mean"] == 1.0  # the failure is not a 0 in the mean
    d = Assembler(batch_groups=1, max_staleness=0).offer(ScoredGroup.decode(out.encode()), None, version=0,
                                                          consumed=set())
    assert d.train_mask == [True, False]  # the trainer does not train on it


# ---------------------------------------------------------------------------------------
# code text format and hidden tests


def test_code_blocks_and_submission():
    assert code_blocks("the answer is 4") == []
    assert code_blocks("a\n```python\nprint(1)\n```\nb\n```\nprint(2)\n```") == ["print(1)\n", "print(2)\n"]
    with pytest.raises(CodeFormatError, match="not closed"):
        code_blocks("```python\nprint(1)\n")
    with pytest.raises(CodeFormatError, match="unknown tool 'bash'"):
        code_blocks("```bash\nrm -rf /\n```")
    with pytest.raises(CodeFormatError, match="malformed"):
        code_blocks("```print(1)```")
    assert submission("try\n```python\ndef f(): return 1\n```\nthen\n```py\ndef f(): return 2\n```") == \
        "def f(): return 2\n"
    assert submission("def f():\n    return 3\n") == "def f():\n    return 3\n"


def test_hidden_tests_are_read_strictly_from_the_answer():
    t = calc_task(env="code-tests", answer='[{"fn": "add", "args": [1, 2], "expect": 3}]')
    assert [(h.fn, h.args, h.expect) for h in hidden_tests(t)] == [("add", (1, 2), 3)]
    for bad, says in [("nope", "not JSON"), ("[]", "non-empty JSON list"), ('[{"fn": "f", "cmd": 1}]', "cmd")]:
        with pytest.raises(ValueError, match=says):
            hidden_tests(calc_task(env="code-tests", answer=bad))


# ---------------------------------------------------------------------------------------
# the episode store


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Tracked(CalculatorEnv):
    """The calculator, counting what it opened and closed."""

    def __init__(self, codec) -> None:
        super().__init__(codec)
        self.closed: list[str] = []

    def open(self, task, episode_id):
        state = super().open(task, episode_id)
        state.episode_id = episode_id
        return state

    def close(self, state) -> None:
        self.closed.append(state.episode_id)


def test_store_expires_idle_episodes_and_says_so(codec):
    clock, env = Clock(), Tracked(codec)
    store = Episodes(ttl_s=10, max_episodes=8, clock=clock)
    store.open("a", calc_task(), env)
    store.open("b", calc_task(), env)
    clock.now = 8
    store.get("a", 2)  # touched: its TTL starts again
    clock.now = 12
    assert store.sweep() == 1 and env.closed == ["b"] and len(store) == 1
    with pytest.raises(EpisodeError, match=r"'b' expired.*episode_ttl_s=10"):
        store.get("b", 3)
    with pytest.raises(EpisodeError, match=r"'zzz' is not open on this replica.*EnvReply.replica"):
        store.get("zzz", 2)
    clock.now = 30
    with pytest.raises(EpisodeError, match="'a' expired"):  # expired on access, before any sweep
        store.get("a", 3)
    assert env.closed == ["b", "a"] and store.expired == 2 and len(store) == 0


def test_store_refuses_new_episodes_past_its_bound(codec):
    clock, env = Clock(), Tracked(codec)
    store = Episodes(ttl_s=10, max_episodes=2, clock=clock)
    store.open("a", calc_task(), env)
    store.open("b", calc_task(), env)
    with pytest.raises(EpisodeError, match=r"max_episodes=2.*'c' was not opened"):
        store.open("c", calc_task(), env)
    assert len(store) == 2 and env.closed == []  # nothing open was dropped to make room
    clock.now = 11  # both idle past the TTL: a new episode sweeps them and fits
    store.open("c", calc_task(), env)
    assert len(store) == 1 and sorted(env.closed) == ["a", "b"]
    store.close("c")
    assert env.closed[-1] == "c" and len(store) == 0


# ---------------------------------------------------------------------------------------
# the episode host: turns, limits, failure kinds


def step(turn: int, text: str, episode: str = "ep-1", **task_kw) -> EnvStep:
    return EnvStep(task=calc_task(**task_kw), episode_id=episode, action_text=text, turn=turn)


def host(codec) -> EpisodeHost:
    return EpisodeHost(codec, "env-7", Episodes(ttl_s=60, max_episodes=16))


async def test_a_two_turn_calculator_episode(codec):
    h, env = host(codec), CalculatorEnv(codec)
    reset = env.reset(calc_task(), "ep-1")
    assert reset.episodic and codec.decode(reset.observation_ids.tolist()) == "123+456+789+101="
    first = await h.step(env, step(1, "calc(123+456+789+101)"))
    assert (first.done, first.replica, first.episodic, first.failure) == (False, "env-7", True, "")
    assert codec.decode(first.observation_ids.tolist()) == "=1469 " and codec.bos_id not in first.observation_ids
    last = await h.step(env, step(2, "1469"))
    assert (last.done, last.finish_reason, len(last.observation_ids)) == (True, "done", 0)
    assert "ep-1" not in h.episodes  # closed when it ended
    m = h.metrics()
    assert (m["environment/steps"], m["environment/episodes_opened"], m["environment/episodes_open"]) == (2, 1, 0)


async def test_a_malformed_call_is_the_policys_failure(codec):
    h, env = host(codec), CalculatorEnv(codec)
    reply = await h.step(env, step(1, "calc(1/0)"))
    assert (reply.done, reply.failure, reply.finish_reason) == (True, "policy", "policy_error")
    assert "division by zero" in reply.observation_text and h.metrics()["environment/policy_failures"] == 1


async def test_a_crashing_tool_is_an_environment_failure(codec):
    class Crashing(CalculatorEnv):
        async def step(self, state, action_text, budget_s):
            raise OSError("the tool's disk is gone")

    h = host(codec)
    reply = await h.step(Crashing(codec), step(1, "calc(1+1)"))
    assert (reply.done, reply.failure, reply.finish_reason) == (True, "environment", "env_error")
    assert "the tool's disk is gone" in reply.observation_text and h.metrics()["environment/env_failures"] == 1
    assert not reply.error  # the request was served: the episode ended, the task is not dead-lettered


async def test_tool_time_is_summed_and_capped(codec):
    class Slow(CalculatorEnv):
        async def step(self, state, action_text, budget_s):
            return Turn(observation="=1 ", tool_s=0.6)

    h, env = host(codec), Slow(codec)
    limits = EpisodeLimits(max_turns=8, max_tool_s=1.0)
    first = await h.step(env, step(1, "calc(1)", limits=limits))
    assert not first.done and first.tool_s == 0.6
    second = await h.step(env, step(2, "calc(1)", limits=limits))
    assert (second.done, second.finish_reason, second.failure) == (True, "max_tool_time", "")
    assert "exceeds the task's max_tool_s=1" in second.observation_text
    assert h.metrics()["environment/tool_s"] == pytest.approx(1.2)


async def test_the_last_turn_ends_the_episode_at_max_turns(codec):
    h, env = host(codec), CalculatorEnv(codec)
    limits = EpisodeLimits(max_turns=2)
    assert not (await h.step(env, step(1, "calc(1+1)", limits=limits))).done
    last = await h.step(env, step(2, "calc(2+2)", limits=limits))
    assert (last.done, last.finish_reason, len(last.observation_ids)) == (True, "max_turns", 0)


async def test_steps_go_in_order_and_a_repeat_gets_the_same_reply(codec):
    h, env = host(codec), CalculatorEnv(codec)
    first = await h.step(env, step(1, "calc(2+2)"))
    again = await h.step(env, step(1, "calc(2+2)"))  # the reply was lost and the request retried
    assert again is first and h.metrics()["environment/steps"] == 1
    with pytest.raises(EpisodeError, match="at turn 1; a step of turn 3 cannot follow"):
        await h.step(env, step(3, "4"))
    with pytest.raises(EpisodeError, match="not open on this replica"):
        await h.step(env, step(2, "4", episode="never-opened"))


async def test_server_answers_unknown_episodes_and_full_replicas_with_errors(codec):
    from rlbus.services.environment.service import EnvironmentServer
    from rlbus.services.environment.settings import EnvironmentSettings

    server = EnvironmentServer(codec, EnvironmentSettings(instance="env-3", max_episodes=1))
    ok = EnvReply.decode(await server.handle_step(step(1, "calc(1+2)", episode="a").encode()))
    assert ok.replica == "env-3" and codec.decode(ok.observation_ids.tolist()) == "=3 "
    full = EnvReply.decode(await server.handle_step(step(1, "calc(1+2)", episode="b").encode()))
    assert "max_episodes=1" in full.error and full.episode_id == "b"
    unknown = EnvReply.decode(await server.handle_step(step(2, "3", episode="ghost").encode()))
    assert "'ghost' is not open on this replica" in unknown.error
    bad = EnvReply.decode(await server.handle_reset(
        EnvReset(task=calc_task(prompt="", prompt_ids=np.array([1, 5], dtype="<i4"), env_config={"terms": [1, 2]})).encode()))
    assert "env_config {terms: [4 integers]}" in bad.error
    assert (server.served, server.errors) == (1, 3)
    server.close()


def test_episodic_environments_are_registered(codec):
    assert {"calculator", "python", "code-tests"} <= set(ENVIRONMENTS.names())
    assert not ENVIRONMENTS.create("addition", codec=codec).reset(
        calc_task(env="addition", prompt="1+2=", prompt_ids=np.zeros(0, dtype="<i4")), "e").episodic
    with pytest.raises(EnvError, match="terms"):
        CalculatorEnv(codec).reset(calc_task(prompt="", prompt_ids=np.array([1, 5], dtype="<i4"),
                                             env_config={"terms": ["1", 2, 3, 4]}), "e")
    reply = CalculatorEnv(codec).reset(calc_task(prompt="", prompt_ids=np.array([1, 5], dtype="<i4")), "e")
    assert reply.observation_text == "123+456+789+101=" and reply.episodic


async def test_the_service_routes_an_episode_on_the_in_memory_bus(tmp_path, codec):
    """The service's wiring, as the generator's unit tests see it: turn 1 on the queue subject,
    turn 2 on the replica's own subject."""
    import asyncio

    from rlbus.bus.memory import MemoryBus
    from rlbus.bus.protocol import RequestFailed
    from rlbus.services.environment import service as env_service
    from rlbus.services.environment.settings import EnvironmentSettings
    from rlbus.services.policy.tokenizer import build_char_tokenizer
    from rlbus.services.runtime.config import RunSettings
    from rlbus.services.runtime.lifecycle import Lifecycle

    build_char_tokenizer().save_pretrained(tmp_path / "policy")
    bus, life = MemoryBus("demo"), Lifecycle(grace=1.0)
    run_cfg = RunSettings(run="demo", model_path=str(tmp_path / "policy"), run_dir=str(tmp_path))
    service = asyncio.create_task(env_service.run(run_cfg, EnvironmentSettings(instance="env-m"), bus=bus, life=life))
    try:
        for _ in range(500):  # until it serves
            try:
                first = EnvReply.decode(await bus.request(bus.subjects.env("calculator", "step"),
                                                          step(1, "calc(120+3)").encode(), timeout=2.0))
                break
            except RequestFailed:
                await asyncio.sleep(0.01)
        assert (first.replica, first.observation_text) == ("env-m", "=123 ")
        last = EnvReply.decode(await bus.request(bus.subjects.env_step("calculator", "env-m"),
                                                 step(2, "1469").encode(), timeout=2.0))
        assert (last.done, last.finish_reason) == (True, "done")
    finally:
        life.shutdown()
        await asyncio.wait_for(service, 5)
        await bus.close()
