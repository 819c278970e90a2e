"""reasoning-gym as rlbus tasks: disjoint deterministic splits, the policy's chat template, the
dataset's own checker, and refusals that name what to do."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed: pip install -e '.[reasoning-gym]'")

from rlbus.schemas import Rollout, spans_from_versions  # noqa: E402
from rlbus.services.environment.envs import ENVIRONMENTS, EnvError, check_task  # noqa: E402
from rlbus.services.reward.verifiers import VERIFIERS  # noqa: E402
from rlbus.services.runtime.taskfile import parse_task, read_task_file  # noqa: E402
from rlbus.services.runtime.tokens import TextCodec  # noqa: E402
from rlbus.services.tasks.reasoning_gym import (  # noqa: E402
    ReasoningGymEnv,
    ReasoningGymSettings,
    ReasoningGymVerifier,
    TaskError,
    extract_answer,
    make_split,
    resolve,
)
from rlbus.services.up.settings import UpSettings, with_recipe  # noqa: E402

# A ChatML template written for these tests: a default system turn when none is given, one turn per
# message, the assistant header on request.
CHATML = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}{{ '<s>system\\nBe brief.</s>\\n' }}"
          "{% endif %}{{ '<s>' + m['role'] + '\\n' + m['content'] + '</s>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlbus.services.policy.tokenizer import build_char_tokenizer

    folder = tmp_path_factory.mktemp("chat-tokenizer")
    tok = build_char_tokenizer()
    tok.chat_template = CHATML
    tok.save_pretrained(folder, save_jinja_files=False)
    return folder


@pytest.fixture(scope="module")
def recipe():
    return resolve("chain_sum", ReasoningGymSettings())


def rollout(text: str) -> Rollout:
    n = max(len(text), 1)
    return Rollout(rollout_id="r/0", task_id="t", index=0, token_ids=np.ones(3 + n, dtype="<i4"), prompt_len=3,
                   loss_mask=np.ones(n, dtype="|u1"), behaviour_logprobs=np.zeros(n, dtype="<f4"),
                   version_spans=spans_from_versions(np.zeros(n)), text=text, finish_reason="stop")


def test_splits_are_deterministic_disjoint_and_named_by_their_source(recipe) -> None:
    held = make_split("chain_sum", "heldout", 40, 3, recipe)
    train = make_split("chain_sum", "train", 300, 3, recipe, exclude_questions={r["prompt"] for r in held})
    assert make_split("chain_sum", "heldout", 40, 3, recipe) == held
    assert not {r["prompt"] for r in held} & {r["prompt"] for r in train}
    assert len({r["task_id"] for r in train + held}) == 340
    assert held[0]["env_config"]["seed"] != train[0]["env_config"]["seed"]
    assert make_split("chain_sum", "heldout", 40, 4, recipe) != held  # another run seed, other tasks
    assert all(r["task_id"].startswith("rg-chain_sum-") for r in train)


def test_an_unknown_dataset_is_refused_with_the_list(recipe) -> None:
    with pytest.raises(TaskError, match="chain_sum.*countdown|countdown.*chain_sum"):
        make_split("no_such_dataset", "train", 4, 0, recipe)
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset 'nope'"):
        UpSettings(task="reasoning-gym:nope")
    with pytest.raises(ValueError, match="reasoning-gym:<dataset>"):
        UpSettings(task="chain_sum")


def test_settings_a_dataset_refuses_are_named(recipe) -> None:
    bad = resolve("chain_sum", ReasoningGymSettings(config={"no_such_knob": 3}))
    with pytest.raises(TaskError, match="no_such_knob"):
        make_split("chain_sum", "train", 4, 0, bad)


def test_every_dataset_name_works_in_a_task_set() -> None:
    from rlbus.services.tasks.reasoning_gym import dataset_names

    names = dataset_names()
    assert len(names) >= 100
    for name in ("basic_arithmetic", "countdown", "gsm_symbolic"):
        (one,) = make_split(name, "train", 1, 0, resolve(name, ReasoningGymSettings()))
        assert one["prompt"] and one["env_config"]["dataset"] == name and one["env_config"]["extract"] == "tag"


@pytest.mark.parametrize(("how", "text", "want"), [
    ("last_number", "7 + 8 = 15", "15"), ("first_number", "7 + 8 = 15", "7"), ("last_number", "no digits", None),
    ("tag", "think <answer> 12 </answer> more", "12"), ("tag", "<answer>1</answer><answer>2</answer>", "2"),
    ("tag", "12", None), ("full", "  -3 \n", "-3"), ("last_number", "is -4.", "-4"),
])
def test_answers_are_read_as_the_task_says(how: str, text: str, want: str | None) -> None:
    assert extract_answer(text, how) == want  # type: ignore[arg-type]


def test_the_datasets_checker_scores_and_a_changed_task_is_refused(recipe) -> None:
    (record,) = make_split("chain_sum", "train", 1, 0, recipe)
    task = parse_task(record, run="r", pool="train")
    verify = VERIFIERS.get("reasoning_gym")()
    assert verify is not None and isinstance(verify, ReasoningGymVerifier)
    right = verify(task, rollout(f"The sum is {record['answer']}"))
    assert right.reward == 1.0 and right.components["correct"] == 1.0
    assert verify(task, rollout("The sum is 1000")).reward == 0.0
    assert verify(task, rollout("no number")).components["answered"] == 0.0
    for tampered in ({"answer": "1000"}, {"prompt": "What is 1 + 1?"}):
        with pytest.raises(ValueError, match="republish|answer is not"):
            verify(parse_task({**record, **tampered}, run="r", pool="train"), rollout(record["answer"]))


def test_partial_credit_only_when_asked() -> None:
    binary = resolve("countdown", ReasoningGymSettings())
    partial = resolve("countdown", ReasoningGymSettings(reward="partial"))
    (b,) = make_split("countdown", "train", 1, 0, binary)
    (p,) = make_split("countdown", "train", 1, 0, partial)
    wrong = rollout("<answer>1 + 1</answer>")  # well-formed, wrong: countdown gives it a little credit
    verify = ReasoningGymVerifier()
    got_b = verify(parse_task(b, run="r", pool="train"), wrong)
    got_p = verify(parse_task(p, run="r", pool="train"), wrong)
    assert got_b.reward == 0.0 and 0.0 < got_p.reward < 1.0 and got_p.components["score"] == got_b.components["score"]


def test_the_prompt_is_the_policys_chat_template_applied_once(chat_folder: Path, recipe) -> None:
    from transformers import AutoTokenizer

    (record,) = make_split("chain_sum", "train", 1, 0, recipe)
    task = parse_task(record, run="r", pool="train")
    env = ENVIRONMENTS.get("reasoning_gym")(codec=TextCodec.from_folder(chat_folder))
    text = env.render(task)
    reference = AutoTokenizer.from_pretrained(chat_folder).apply_chat_template(
        [{"role": "system", "content": recipe.system}, {"role": "user", "content": record["prompt"]}],
        add_generation_prompt=True, tokenize=False)
    assert text == reference
    assert text.count("<s>assistant") == 1 and text.count(record["prompt"]) == 1
    reply = env.reset(task, "e")
    assert reply.observation_text == text


def test_a_model_without_a_chat_template_is_refused_with_the_fix(tmp_path: Path, recipe) -> None:
    from rlbus.services.policy.tokenizer import build_char_tokenizer

    build_char_tokenizer().save_pretrained(tmp_path)
    (record,) = make_split("chain_sum", "train", 1, 0, recipe)
    env = ReasoningGymEnv(codec=TextCodec.from_folder(tmp_path))
    with pytest.raises(EnvError, match="no chat template.*instruct model"):
        env.render(parse_task(record, run="r", pool="train"))


def test_publish_refuses_an_unknown_dataset_line_by_line(tmp_path: Path, recipe) -> None:
    (good,) = make_split("chain_sum", "train", 1, 0, recipe)
    bad = {**good, "task_id": "x", "env_config": {**good["env_config"], "dataset": "nope"}}
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    tasks, errors = read_task_file(path, run="r", pool="train", check=check_task)
    assert [t.task_id for t in tasks] == [good["task_id"]]
    assert len(errors) == 1 and errors[0].line == 2 and "unknown reasoning-gym dataset 'nope'" in errors[0].reason


def test_the_recipe_fills_only_what_the_config_leaves_unset() -> None:
    data = {"trainer": {"lr": 3e-6}, "run": {"group_size": 4}}
    out = with_recipe(data, "reasoning-gym:chain_sum")
    assert out["trainer"]["lr"] == 3e-6 and out["trainer"]["autocast"] == "bfloat16"
    assert out["run"] == {"group_size": 4, "batch_groups": 8}
    assert with_recipe(data, "addition") is data
    assert UpSettings(task="reasoning-gym:chain_sum").turn_tokens == 12
