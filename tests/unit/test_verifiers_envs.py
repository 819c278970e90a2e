"""Verifiers score what a user would call right or wrong; environments render the prompt the
policy sees; both registries name what exists when asked for something that does not."""

from __future__ import annotations

import numpy as np
import pytest

from rlbus.schemas import Rollout, Task, spans_from_versions
from rlbus.services.environment.envs import ENVIRONMENTS, AdditionEnv, EnvError, SingleTurnEnv
from rlbus.services.reward.verifiers import VERIFIERS, AdditionVerifier, FormatVerifier, MathVerifier, verifier_for
from rlbus.services.runtime.registry import UnknownExtension
from rlbus.services.runtime.tokens import TextCodec, TokenizerError


@pytest.fixture(scope="module")
def codec(tmp_path_factory) -> TextCodec:
    from rlbus.services.policy.tokenizer import build_char_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    build_char_tokenizer().save_pretrained(folder)
    return TextCodec.from_folder(folder)


def task(**kw) -> Task:
    base = dict(run="demo", task_id="add-123-456", pool="train", env="addition", prompt="123+456=", answer="579")
    base.update(kw)
    return Task(**base)


def completion(text: str, finish_reason: str = "stop") -> Rollout:
    n = max(len(text), 1)
    return Rollout(rollout_id="r/0", task_id="add-123-456", index=0, token_ids=np.ones(3 + n, dtype="<i4"),
                   prompt_len=3, loss_mask=np.ones(n, dtype="|u1"), behaviour_logprobs=np.zeros(n, dtype="<f4"),
                   version_spans=spans_from_versions(np.zeros(n)), text=text, finish_reason=finish_reason)


# ---------------------------------------------------------------------------------------
# verifiers


@pytest.mark.parametrize(
    ("text", "reward"),
    [("579", 1.0), (" 579\n", 1.0), ("579<eos>12", 1.0), ("5790", 0.0), ("57", 0.0), ("579.", 0.0),
     ("the answer is 579", 0.0), ("", 0.0), ("-579", 0.0)],
)
def test_addition_is_exact_match(text, reward):
    v = AdditionVerifier()(task(), completion(text))
    assert v.reward == reward
    assert v.components["correct"] == reward
    assert "'579'" in v.detail  # the detail tells a human what was expected


def test_addition_without_a_reference_answer_raises_rather_than_scoring_zero():
    with pytest.raises(ValueError, match="no reference answer"):
        AdditionVerifier()(task(answer=""), completion("579"))


def test_format_wants_a_bare_number_that_ended_on_its_own():
    assert FormatVerifier()(task(), completion("579")).reward == 1.0
    assert FormatVerifier()(task(), completion("579", finish_reason="length")).reward == 0.0
    assert FormatVerifier()(task(), completion("579 apples")).reward == 0.0
    # An exact answer cut at max tokens is still correct, just badly formatted.
    v = AdditionVerifier()(task(), completion("579", finish_reason="length"))
    assert v.components == {"correct": 1.0, "format": 0.0}


@pytest.mark.parametrize(
    ("answer", "text", "reward"),
    [
        ("0.5", "so the answer is \\boxed{1/2}", 1.0),
        ("\\boxed{1/2}", "0.5", 1.0),
        ("\\frac{1}{2}", "$\\frac{2}{4}$", 1.0),
        ("0.5", "\\boxed{1/3}", 0.0),
        ("0.5", "I do not know", 0.0),
    ],
)
def test_math_checks_equivalence_not_spelling(answer, text, reward):
    v = MathVerifier()(task(env="math", answer=answer), completion(text))
    assert v.reward == reward and v.components == {"correct": reward}


def test_math_with_an_unparseable_reference_raises():
    with pytest.raises(ValueError, match="does not parse"):
        MathVerifier()(task(env="math", answer="banana"), completion("0.5"))


def test_verifier_registry():
    assert {"addition", "math", "format"} <= set(VERIFIERS.names())
    assert isinstance(VERIFIERS.create("math"), MathVerifier)
    assert verifier_for(task()) == "addition"  # the environment's own verifier by default
    assert verifier_for(task(verifier="format")) == "format"
    with pytest.raises(UnknownExtension) as info:
        VERIFIERS.create("regex")
    msg = str(info.value)
    assert "unknown verifier 'regex'" in msg and "addition, calculator, code-tests, format, math" in msg and "rlbus.verifiers" in msg


# ---------------------------------------------------------------------------------------
# environments


def test_environment_registry_names_what_exists(codec):
    assert {"addition", "single_turn", "math"} <= set(ENVIRONMENTS.names())
    assert isinstance(ENVIRONMENTS.create("addition", codec=codec), AdditionEnv)
    with pytest.raises(UnknownExtension) as info:
        ENVIRONMENTS.create("chess", codec=codec)
    assert info.value.name == "chess"
    assert {"addition", "math", "single_turn"} <= set(info.value.known)
    assert "addition" in str(info.value) and "rlbus.environments" in str(info.value)


def test_addition_prompt_is_bos_then_the_characters(codec):
    reply = AdditionEnv(codec).reset(task(), "ep-1")
    assert reply.episode_id == "ep-1" and not reply.done and not reply.error
    ids = reply.observation_ids.tolist()
    assert ids[0] == codec.bos_id
    assert codec.decode(ids) == "123+456=" == reply.observation_text
    assert ids.count(codec.bos_id) == 1


def test_addition_renders_its_text_from_env_config(codec):
    """Given only token ids, the human-readable prompt comes from env_config {a, b}."""
    ids = [codec.bos_id, *codec.encode("12+34=")]
    reply = AdditionEnv(codec).reset(task(prompt="", prompt_ids=np.array(ids, dtype="<i4"),
                                          env_config={"a": 12, "b": "34"}), "ep")
    assert reply.observation_text == "12+34="
    assert reply.observation_ids.tolist() == ids  # the ids as given, <bos> not doubled


def test_prompt_text_wins_over_env_config(codec):
    reply = AdditionEnv(codec).reset(task(prompt="7+8=", env_config={"a": 1, "b": 2}), "ep")
    assert codec.decode(reply.observation_ids.tolist()) == reply.observation_text == "7+8="


@pytest.mark.parametrize("env_config", [{}, {"a": 12}, {"a": "twelve", "b": 3}])
def test_addition_without_text_or_usable_env_config_is_an_env_error(codec, env_config):
    t = task(prompt="", prompt_ids=np.array([codec.bos_id, 5], dtype="<i4"), env_config=env_config)
    with pytest.raises(EnvError, match="add-123-456.*env_config"):
        AdditionEnv(codec).reset(t, "ep")


def test_prompt_ids_get_a_bos_when_missing(codec):
    reply = SingleTurnEnv(codec).reset(task(env="single_turn", prompt="", prompt_ids=np.array([5, 6], dtype="<i4")),
                                       "ep")
    assert reply.observation_ids.tolist() == [codec.bos_id, 5, 6]


def test_a_prompt_that_is_only_bos_is_empty(codec):
    t = task(env="single_turn", prompt="", prompt_ids=np.array([codec.bos_id], dtype="<i4"))
    with pytest.raises(EnvError, match="empty prompt"):
        SingleTurnEnv(codec).reset(t, "ep")


def test_single_turn_ends_after_one_action(codec):
    reply = SingleTurnEnv(codec).step(task(), "ep-9", np.array([9, 11, 13], dtype="<i4"), "579")
    assert reply.done and reply.episode_id == "ep-9" and len(reply.observation_ids) == 0


def test_codec_needs_a_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        TextCodec.from_folder(tmp_path)


def test_codec_round_trips_text_and_knows_its_special_ids(codec):
    assert (codec.pad_id, codec.bos_id, codec.eos_id) == (0, 1, 2)
    text = "What is 12*(3+4)? Answer: 84."
    assert codec.decode(codec.encode(text)) == text
    assert codec.bos_id not in codec.encode(text)
