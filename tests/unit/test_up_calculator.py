"""`rlbus up --task calculator` without running it: the task files it writes, the model it picks and
refuses, and the warm start's transcripts (the episode format, token for token, within the context)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlbus.services.policy.calc_init import TOOL_STOP, TURN_TOKENS, tool_call, training_batch, transcript_rows
from rlbus.services.policy.model_init import TINY_CONFIG
from rlbus.services.policy.tokenizer import build_char_tokenizer
from rlbus.services.runtime.config import ConfigError
from rlbus.services.runtime.taskfile import read_task_file
from rlbus.services.tasks.calculator import CalculatorTask, find_call, make_split, score, split_of
from rlbus.services.up import main as up_main
from rlbus.services.up.settings import UpSettings


def test_calculator_task_files_carry_the_episode_settings(tmp_path: Path) -> None:
    cfg = UpSettings(task="calculator", train_tasks=50, eval_tasks=20, temperature=0.8)
    train, heldout = up_main.write_tasks(tmp_path, cfg)
    for path, split, temperature in ((train, "train", 0.8), (heldout, "heldout", 0.0)):
        tasks, errors = read_task_file(path, run="r", pool="p", group_size=8)
        assert errors == [] and len(tasks) == (50 if split == "train" else 20)
        for t in tasks:
            assert t.env == "calculator" and split_of(tuple(t.env_config["terms"])) == split
            assert t.answer == str(sum(t.env_config["terms"])) and t.prompt.endswith("=")
            assert (t.sampling.stop, t.sampling.max_new_tokens, t.sampling.temperature) == ([TOOL_STOP], 24, temperature)


def test_addition_task_files_are_unchanged_by_default(tmp_path: Path) -> None:
    train, _ = up_main.write_tasks(tmp_path, UpSettings(train_tasks=5, eval_tasks=5))
    line = json.loads(train.read_text().splitlines()[0])
    assert line["sampling"] == {"max_new_tokens": 6, "temperature": 1.0}


def test_up_builds_the_calculator_model_in_its_own_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[tuple[Path, str]] = []

    def ensure(path: Path, up_cfg: UpSettings) -> None:
        seen.append((path, up_cfg.task))
        raise ConfigError("stop here")

    monkeypatch.setattr(up_main, "ensure_model", ensure)
    assert up_main.up(None, backend=None, steps=None, run_dir=str(tmp_path / "run"), view=False, task="calculator") == 2
    assert seen == [(Path("models/tiny-calculator"), "calculator")]


def test_a_model_built_for_another_task_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "rlbus_model.json").write_text(json.dumps({"seed": 0}))  # an addition model (no task key)
    up_main.ensure_model(model, UpSettings(task="addition"))
    with pytest.raises(ConfigError, match="warm-started on 'addition'.*model_path"):
        up_main.ensure_model(model, UpSettings(task="calculator"))


def test_transcripts_are_episodes_the_verifier_scores_right_and_fit_the_context() -> None:
    tok = build_char_tokenizer()
    widest = CalculatorTask("calc-max", (999, 999, 998, 997))
    tasks = [*make_split("train", 20, 0), widest]
    rows = transcript_rows(tok, tasks)
    for task, (ids, mask) in zip(tasks, rows, strict=True):
        assert len(ids) == len(mask) <= TINY_CONFIG["max_position_embeddings"]
        text = tok.decode(ids, skip_special_tokens=True)
        call, obs = tool_call(task)
        assert text == task.prompt + call + obs + task.answer
        # The policy's tokens are the call and the answer with <eos>; the prompt and observation are not.
        policy = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
        assert policy == call + task.answer + "<eos>"
        # The tool turn ends at the stop string the task files set, and the environment reads that call.
        assert call.endswith(TOOL_STOP) and call.count(TOOL_STOP) == 1 and len(call) <= TURN_TOKENS
        assert find_call(call) is not None and score(task.answer, call + obs + task.answer) == 1.0
    ids, targets = training_batch(rows, int(tok.pad_token_id))
    assert int((targets != -100).sum()) == sum(sum(m) for _, m in rows)


def test_the_deploy_config_is_a_valid_calculator_run() -> None:
    from rlbus.services.controller.settings import ControllerSettings
    from rlbus.services.runtime.config import RunSettings, load_section, read_toml

    data = read_toml(str(Path(__file__).resolve().parents[2] / "deploy" / "configs" / "calculator.toml"))
    run, up = load_section(RunSettings, data, "run"), load_section(UpSettings, data, "up")
    assert (up.task, up.turn_tokens, run.model_path) == ("calculator", 24, "models/tiny-calculator")
    assert load_section(ControllerSettings, data, "controller").eval_every > 0
