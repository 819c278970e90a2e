"""The PyTorch episode engine: continuous batching over episode rows, KV kept across turns.

The core claim checked throughout: whatever the engine did with a row's cache (kept across a
turn, rebuilt after a swap, batched with rows of other lengths that joined at other times), the
behaviour logprob of every sampled token equals a full teacher-forced recompute of the row's
sequence under the weights that produced it."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from rlbus.services.policy.episodes import EpisodeEngine, EpisodeEngineError, EpisodeInputError, Turn
from rlbus.services.policy.logprobs import completion_logprobs
from rlbus.services.policy.sampler import GroupSampler, StaticSlot
from rlbus.services.policy.sampling import SamplingParams
from rlbus.services.policy.tokenizer import encode_prompt
from tests.unit.conftest import fresh_model

torch.set_num_threads(1)
TOL = 1e-4
HOT = SamplingParams(temperature=1.0)
NUCLEUS = SamplingParams(temperature=0.7, top_p=0.9)


def _enc(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return list(tokenizer.encode(text, add_special_tokens=False))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _run_all(engine: EpisodeEngine, gen: torch.Generator, max_steps: int = 16) -> dict[str, Turn]:
    out: dict[str, Turn] = {}
    for _ in range(100):
        done = engine.run(gen, max_steps)
        out.update(done)
        if not done and not any(r.turn is not None for r in engine._rows.values()):
            return out
    raise AssertionError("turns did not finish in 100 runs")


def _assert_matches_recompute(model, prefix: list[int], turn: Turn, params: SamplingParams,  # type: ignore[no-untyped-def]
                              tol: float = TOL) -> None:
    (lp,) = completion_logprobs(model, [(prefix, turn.ids)], params)
    assert turn.logprobs.dtype == np.float32 and turn.versions.dtype == np.int64
    assert len(turn.ids) == len(turn.logprobs) == len(turn.versions)
    assert np.isfinite(turn.logprobs).all()
    assert np.abs(turn.logprobs - lp.numpy()).max() < tol


def test_one_turn_matches_the_recompute_and_a_prompts_rows_share_one_prefill(model, tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = EpisodeEngine(StaticSlot(model, 3))
    prompts = {"a": encode_prompt(tokenizer, "123+456="), "b": encode_prompt(tokenizer, "7+8=")}
    params = {}
    for name, prompt in prompts.items():
        keys = [f"{name}{i}" for i in range(3)]
        engine.open(keys, prompt)
        for i, key in enumerate(keys):  # rows of one batch with different sampling parameters
            params[key] = HOT if i % 2 else NUCLEUS
            engine.start_turn(key, params[key], [], 8)
    turns = _run_all(engine, _gen(0))
    assert sorted(turns) == sorted(params)
    for key, turn in turns.items():
        prompt = prompts[key[0]]
        assert engine.tokens(key) == prompt + turn.ids
        assert (turn.versions == 3).all()
        stop = turn.finish_reason == "stop"
        assert stop == (turn.ids[-1] == tokenizer.eos_token_id) and (stop or len(turn.ids) == 8)
        _assert_matches_recompute(model, prompt, turn, params[key])
    # Each prompt was prefilled once (all but its last token, which each row feeds itself).
    assert engine.stats["prefill_tokens"] == sum(len(p) - 1 for p in prompts.values())
    assert engine.stats["rows"] == 6 and engine.stats["reused_tokens"] == 0


@pytest.mark.slow  # the warm-started tiny model: a 90-second build on a fresh checkout
def test_greedy_turns_equal_the_group_samplers(tiny_model: Path) -> None:
    from rlbus.services.policy.load import load_policy
    from rlbus.services.tasks.addition import make_split

    trained, tok = load_policy(tiny_model)
    prompts = [encode_prompt(tok, t.prompt) for t in make_split("heldout", 8, seed=5)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    expected = [g[0].completion_ids for g in GroupSampler(StaticSlot(trained)).sample_groups(prompts, 1, greedy, _gen(0))]
    engine = EpisodeEngine(StaticSlot(trained))
    for i, p in enumerate(prompts):
        engine.open([str(i)], p)
        engine.start_turn(str(i), greedy, [], 6)
    turns = _run_all(engine, _gen(0), max_steps=4)  # turns span two runs
    assert [turns[str(i)].ids for i in range(len(prompts))] == expected
    assert all((t.logprobs == 0).all() for t in turns.values())  # greedy: a point mass


@pytest.mark.parametrize("keep_kv", [True, False])
def test_second_turn_on_the_kept_cache_equals_a_full_recompute(model, tokenizer, keep_kv: bool) -> None:  # type: ignore[no-untyped-def]
    engine = EpisodeEngine(StaticSlot(model), keep_kv=keep_kv)
    prompt = encode_prompt(tokenizer, "(12*3)+4=")
    keys = ["x", "y", "z", "u", "v", "w"]
    engine.open(keys, prompt)
    for key in keys:  # frequent stop ids: rows leave the batch at different steps
        engine.start_turn(key, HOT, _enc(tokenizer, "0123456"), 6)
    first = _run_all(engine, _gen(1))
    assert len({len(t.ids) for t in first.values()}) > 2, "turns of one length; change the seed"
    before = dict(engine.stats)
    observations = {"x": _enc(tokenizer, "=40;"), "y": _enc(tokenizer, "?"), "z": _enc(tokenizer, "9-1=8 ok"),
                    "u": _enc(tokenizer, "1"), "v": _enc(tokenizer, "(2)"), "w": _enc(tokenizer, "+++")}
    for key in keys:
        engine.append(key, observations[key])
        assert engine.tokens(key) == prompt + first[key].ids + observations[key]
        engine.start_turn(key, NUCLEUS, [], 7)
    prefixes = {key: engine.tokens(key) for key in keys}
    second = _run_all(engine, _gen(2), max_steps=3)
    for key in keys:
        _assert_matches_recompute(model, prefixes[key], second[key], NUCLEUS)
        assert engine.tokens(key) == prefixes[key] + second[key].ids
    reused = engine.stats["reused_tokens"] - before["reused_tokens"]
    prefilled = engine.stats["prefill_tokens"] - before["prefill_tokens"]
    if keep_kv:
        # The cache held everything but turn 1's last token; only that and the observation are new.
        assert reused == sum(len(prefixes[k]) - len(observations[k]) - 1 for k in keys)
        assert prefilled == sum(len(o) for o in observations.values())
    else:
        assert reused == 0 and prefilled == sum(len(p) - 1 for p in prefixes.values())


def test_rows_that_join_between_runs_decode_as_if_alone(model, tokenizer) -> None:  # type: ignore[no-untyped-def]
    greedy = SamplingParams(temperature=0.0)
    prompts = {"early": encode_prompt(tokenizer, "1+2="), "late": encode_prompt(tokenizer, "(99-8)*7="),
               "later": encode_prompt(tokenizer, "5=")}
    alone: dict[str, list[int]] = {}
    for key, prompt in prompts.items():
        solo = EpisodeEngine(StaticSlot(model))
        solo.open([key], prompt)
        solo.start_turn(key, greedy, [], 10)
        alone[key] = _run_all(solo, _gen(0))[key].ids

    engine = EpisodeEngine(StaticSlot(model))
    engine.open(["early", "early-hot"], prompts["early"])
    engine.start_turn("early", greedy, [], 10)
    engine.start_turn("early-hot", HOT, [], 10)
    turns: dict[str, Turn] = dict(engine.run(_gen(3), max_steps=2))
    engine.open(["late"], prompts["late"])  # joins while "early" is mid-turn
    engine.start_turn("late", greedy, [], 10)
    turns.update(engine.run(_gen(4), max_steps=3))
    engine.open(["later"], prompts["later"])
    engine.start_turn("later", greedy, [], 10)
    hot_prefix = prompts["early"]
    if "early-hot" in turns:  # a row that finished starts its next turn beside the others
        engine.append("early-hot", _enc(tokenizer, "+1="))
        engine.start_turn("early-hot", HOT, [], 5)
        hot_prefix = engine.tokens("early-hot")
        del turns["early-hot"]
    turns.update(_run_all(engine, _gen(5), max_steps=2))
    for key in prompts:
        assert turns[key].ids == alone[key], key
        _assert_matches_recompute(model, prompts[key], turns[key], greedy)
    _assert_matches_recompute(model, hot_prefix, turns["early-hot"], HOT)


def test_a_final_turn_keeps_no_cache_and_a_later_turn_rebuilds_it(model, tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = EpisodeEngine(StaticSlot(model))
    prompt = encode_prompt(tokenizer, "8*8=")
    engine.open(["f"], prompt)
    engine.start_turn("f", HOT, [], 5, final=True)
    first = _run_all(engine, _gen(15))["f"]
    _assert_matches_recompute(model, prompt, first, HOT)
    assert engine._rows["f"].kv is None  # nothing copied out for a turn said to be the last
    engine.append("f", _enc(tokenizer, "=64"))
    engine.start_turn("f", HOT, [], 5)
    prefix = engine.tokens("f")
    second = _run_all(engine, _gen(16))["f"]
    _assert_matches_recompute(model, prefix, second, HOT)
    assert engine.stats["reused_tokens"] == 0 and engine.stats["prefill_tokens"] == len(prompt) - 1 + len(prefix) - 1


def test_rows_survive_a_failed_run(model, tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from rlbus.services.policy import episodes

    engine = EpisodeEngine(StaticSlot(model))
    prompt = encode_prompt(tokenizer, "6+7=")
    engine.open(["a", "b"], prompt)
    for key in ("a", "b"):
        engine.start_turn(key, HOT, [], 8)
    turns = dict(engine.run(_gen(17), max_steps=2))
    feed = episodes._Batch.feed
    calls = []

    def failing(self, chunks):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:  # mid-run, after the rows' caches moved on
            raise RuntimeError("out of memory")
        return feed(self, chunks)

    monkeypatch.setattr(episodes._Batch, "feed", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.run(_gen(18), max_steps=4)
    monkeypatch.setattr(episodes._Batch, "feed", feed)
    turns.update(_run_all(engine, _gen(19)))
    for key in ("a", "b"):
        assert engine.tokens(key) == prompt + turns[key].ids
        _assert_matches_recompute(model, prompt, turns[key], HOT)


class _StagedSlot:
    """A slot whose next version is staged by the test and installed at the engine's next
    `maybe_swap`, as the generator's WeightSlot does."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.version = 0
        self._pending = False

    def stage(self) -> None:
        self._pending = True

    def maybe_swap(self) -> bool:
        if not self._pending:
            return False
        self._pending = False
        with torch.no_grad():
            gen = _gen(99 + self.version)
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        self.version += 1
        return True


def test_a_weight_swap_mid_turn_and_between_turns_rebuilds_the_cache(tokenizer) -> None:  # type: ignore[no-untyped-def]
    slot = _StagedSlot(fresh_model(tokenizer, seed=1))
    engine = EpisodeEngine(slot)
    prompt = encode_prompt(tokenizer, "321+654=")
    keys = [f"r{i}" for i in range(6)]
    engine.open(keys, prompt)
    for key in keys:
        engine.start_turn(key, HOT, [], 8)
    v0 = copy.deepcopy(slot.model)
    turns = dict(engine.run(_gen(6), max_steps=2))
    slot.stage()  # arrives while the turns are mid-way
    turns.update(_run_all(engine, _gen(7)))
    v1 = copy.deepcopy(slot.model)
    long = [k for k in keys if len(turns[k].ids) > 2]
    assert long, "no turn outlived the swap; change the seed"
    assert engine.stats["rebuilds"] == len(keys)  # every row held a v0 cache when v1 arrived
    for key in keys:
        turn = turns[key]
        assert turn.versions.tolist() == [0, 0, 1, 1, 1, 1, 1, 1][: len(turn.ids)]
        (old,) = completion_logprobs(v0, [(prompt, turn.ids)], HOT)
        (new,) = completion_logprobs(v1, [(prompt, turn.ids)], HOT)
        assert np.abs(turn.logprobs[:2] - old[:2].numpy()).max() < TOL
        if key in long:
            assert np.abs(turn.logprobs[2:] - new[2:].numpy()).max() < TOL
    # Between turns: the caches kept while the rows waited are dropped and rebuilt under v2.
    rebuilds = engine.stats["rebuilds"]
    for key in keys:
        engine.append(key, _enc(tokenizer, "=1"))
        engine.start_turn(key, HOT, [], 4)
    prefixes = {key: engine.tokens(key) for key in keys}
    slot.stage()
    reused = engine.stats["reused_tokens"]
    second = _run_all(engine, _gen(8))
    assert engine.stats["rebuilds"] == rebuilds + len(keys)
    assert engine.stats["reused_tokens"] == reused  # nothing was kept from v1
    for key in keys:
        assert (second[key].versions == 2).all()
        _assert_matches_recompute(slot.model, prefixes[key], second[key], HOT)


def test_deterministic_turns_are_bit_identical_to_the_trainer(model, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A final turn is recomputed in the run (the trainer's (prefix, turn)); an earlier turn is not,
    since the trainer sees it inside the whole episode: `episode_logprobs` recomputes that at the
    episode's end, bit-identical to the trainer's whole-sequence values, and only at the slot's version."""
    engine = EpisodeEngine(StaticSlot(model, 5), deterministic=True)
    prompt = encode_prompt(tokenizer, "44+55=")
    engine.open(["a", "b"], prompt)
    for key in ("a", "b"):
        engine.start_turn(key, NUCLEUS, [], 6)
    first = _run_all(engine, _gen(9))
    assert not any(turn.recomputed for turn in first.values())  # not final: left to the episode's end
    for key in ("a", "b"):
        engine.append(key, _enc(tokenizer, "=99"))
        engine.start_turn(key, NUCLEUS, [], 6, final=True)
    prefixes = {key: engine.tokens(key) for key in ("a", "b")}
    second = _run_all(engine, _gen(10), max_steps=2)
    for key, turn in second.items():
        assert turn.recomputed
        (trainer,) = completion_logprobs(model, [(prefixes[key], turn.ids)], NUCLEUS, deterministic=True, grad=True)
        assert torch.equal(torch.from_numpy(turn.logprobs), trainer.detach())
    whole = [(prompt, engine.tokens(key)[len(prompt):], NUCLEUS, 5) for key in ("a", "b")]
    values = engine.episode_logprobs([*whole, (prompt, whole[0][1], NUCLEUS, 4)])
    assert values[2] is None  # sampled under version 4, the slot holds 5: those weights are gone
    for (_, completion, _, _), got in zip(whole, values[:2], strict=True):
        (trainer,) = completion_logprobs(model, [(prompt, completion)], NUCLEUS, deterministic=True, grad=True)
        assert got is not None and torch.equal(torch.from_numpy(got), trainer.detach())
    assert model.config._attn_implementation == "sdpa"  # eager attention was only borrowed
    with pytest.raises(EpisodeEngineError, match="deterministic=True"):
        EpisodeEngine(StaticSlot(model)).episode_logprobs(whole)


def test_context_limits_bad_input_and_closing(model, tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = EpisodeEngine(StaticSlot(model))
    limit = model.config.max_position_embeddings
    prompt = encode_prompt(tokenizer, "1+1=")
    engine.open(["a", "b"], prompt)
    assert engine.room("a") == limit - len(prompt)
    with pytest.raises(ValueError, match=rf"holds {len(prompt)} tokens; {limit} more would exceed .* context of {limit}"):
        engine.append("a", [5] * limit)
    assert engine.tokens("a") == prompt  # refused whole
    with pytest.raises(EpisodeInputError, match="outside the vocabulary"):
        engine.append("a", [10_000])
    with pytest.raises(EpisodeInputError, match="already open"):
        engine.open(["a"], prompt)
    with pytest.raises(EpisodeInputError, match="no open episode row 'nope'"):
        engine.start_turn("nope", HOT, [], 4)
    # A turn stops at the end of the context, whatever max_new_tokens says.
    engine.append("a", [5] * (limit - len(prompt) - 3))
    engine.start_turn("a", SamplingParams(temperature=1.0), [], 50)
    with pytest.raises(EpisodeInputError, match="turn in progress"):
        engine.append("a", [5])
    turn = _run_all(engine, _gen(11))["a"]
    assert len(engine.tokens("a")) <= limit
    assert turn.finish_reason == "stop" or (len(turn.ids) == 3 and engine.room("a") == 0)
    # Closing frees the row: it is gone from the stats, its calls fail, a run skips it.
    engine.start_turn("b", HOT, [], 4)
    engine.close("b")
    engine.close("b")
    assert engine.stats["rows"] == 1
    assert engine.run(_gen(12)) == []
    with pytest.raises(EpisodeInputError, match="no open episode row 'b'"):
        engine.tokens("b")


@pytest.mark.slow  # the warm-started tiny model: a 90-second build on a fresh checkout
def test_the_torch_backend_engine_follows_staged_weights_and_reports_its_prefill(tiny_model: Path) -> None:
    from safetensors.torch import save as save_safetensors

    from rlbus.services.generator.torch_backend import TorchBackend

    backend = TorchBackend(str(tiny_model))
    engine = backend.episodes()
    assert backend.episodes() is engine
    prompt = encode_prompt(backend.tokenizer, "12+34=")
    engine.open(["e"], prompt)
    engine.start_turn("e", HOT, [], 4)
    first = _run_all(engine, _gen(13))["e"]
    engine.append("e", _enc(backend.tokenizer, "=46"))
    engine.start_turn("e", HOT, [], 4)
    state = backend.slot.model.state_dict()
    backend.stage(7, save_safetensors({k: (v + 0.01).contiguous() for k, v in state.items()}))
    second = _run_all(engine, _gen(14))["e"]
    assert (first.versions == 0).all() and (second.versions == 7).all()
    metrics = backend.metrics()
    assert metrics["generator/kv_rebuilds"] == 1
    assert metrics["generator/prefill_tokens"] == (len(prompt) - 1) + (len(engine.tokens("e")) - len(second.ids) - 1)
    assert metrics["generator/prefill_reused_tokens"] == 0


def test_a_turn_cut_back_at_a_stop_string_continues_from_the_cut(model, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The driver cuts a turn at a stop string after it ended; the row (and its kept cache) is cut
    with it, and the next turn's logprobs match a recompute of the cut sequence."""
    engine = EpisodeEngine(StaticSlot(model))
    prompt = encode_prompt(tokenizer, "12+3=")
    engine.open(["r"], prompt)
    engine.start_turn("r", HOT, [], 8)
    (first,) = _run_all(engine, _gen(3)).values()
    assert len(first.ids) >= 3, "a turn too short to cut; change the seed"
    keep = len(prompt) + 2
    engine.truncate("r", keep)
    assert engine.tokens("r") == prompt + first.ids[:2]
    obs = _enc(tokenizer, "=15 ")
    engine.append("r", obs)
    engine.start_turn("r", NUCLEUS, [], 6)
    prefix = engine.tokens("r")
    (second,) = _run_all(engine, _gen(4)).values()
    _assert_matches_recompute(model, prefix, second, NUCLEUS)
    with pytest.raises(EpisodeInputError, match="cannot keep"):
        engine.truncate("r", 0)
