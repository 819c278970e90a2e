"""The shipped warm start: its weights are the recorded ones, score what their record says, and
`rlbus up` copies them instead of building (services/policy/shipped.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.policy.shipped import MODEL_INFO_FILE, ShippedModelError, copy_shipped, find_shipped, weights_digest
from services.runtime.config import ConfigError
from services.up import main as up_main
from services.up.settings import UpSettings


def shipped_addition() -> Path:
    folder = find_shipped("addition", seed=0, target=0.30)
    assert folder is not None
    return folder


def test_the_shipped_policy_is_the_recorded_one_and_scores_its_recorded_accuracy() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.policy.model_init import HELDOUT_EVAL_SEED, HELDOUT_EVAL_SIZE, greedy_accuracy
    from services.tasks.addition import make_split

    folder = shipped_addition()
    info = json.loads((folder / MODEL_INFO_FILE).read_text())
    assert weights_digest(folder) == info["sha256"]
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert sum(p.numel() for p in model.parameters()) == info["parameters"]
    # Greedy decoding of the fixed held-out set: the same reading the warm start stopped on.
    heldout = make_split("heldout", HELDOUT_EVAL_SIZE, HELDOUT_EVAL_SEED)
    assert greedy_accuracy(model, tokenizer, heldout) == pytest.approx(info["heldout_accuracy"], abs=0.011)


def test_no_shipped_policy_for_another_seed_target_or_task() -> None:
    assert find_shipped("addition", seed=1, target=0.30) is None
    assert find_shipped("addition", seed=0, target=0.5) is None
    assert find_shipped("calculator", seed=0, target=0.30) is None


def test_up_copies_the_shipped_policy_instead_of_building(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up_main.subprocess, "run", lambda *a, **k: pytest.fail("built instead of copying"))
    out = tmp_path / "models" / "tiny-addition"
    up_main.ensure_model(out, UpSettings())
    assert weights_digest(out) == json.loads((out / MODEL_INFO_FILE).read_text())["sha256"]
    assert up_main.model_task(out) == "addition" and not out.with_name(out.name + ".partial").exists()


def test_up_builds_when_no_shipped_policy_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[list[str]] = []
    monkeypatch.setattr(up_main.subprocess, "run", lambda cmd, **k: built.append(cmd))
    up_main.ensure_model(tmp_path / "m", UpSettings(seed=3))
    assert built and built[0][built[0].index("--seed") + 1] == "3"


def test_damaged_shipped_weights_are_refused_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "shipped"
    shutil.copytree(shipped_addition(), root / "tiny-addition-seed0")
    weights = root / "tiny-addition-seed0" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-16])  # a truncated fetch
    source = find_shipped("addition", seed=0, target=0.30, root=root)
    assert source is not None
    with pytest.raises(ShippedModelError) as info:
        copy_shipped(source, tmp_path / "out")
    assert "not the recorded" in str(info.value) and "rlbus init-model" in str(info.value)
    assert not (tmp_path / "out").exists()
    # Through `rlbus up`: a config error (exit 2 with the message), not a traceback.
    monkeypatch.setattr(up_main, "find_shipped", lambda *a: source)
    with pytest.raises(ConfigError, match="git checkout"):
        up_main.ensure_model(tmp_path / "out", UpSettings())


def test_init_model_shipped_copies_the_build_and_says_why_when_it_cannot(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from services.commands.init_model import init_model_cmd

    out = tmp_path / "m"
    assert init_model_cmd(str(out), seed=0, target=0.30, shipped=True) == 0
    assert weights_digest(out) == json.loads(capsys.readouterr().out)["sha256"]
    assert init_model_cmd(str(out), seed=0, target=0.30, shipped=True) == 2  # not over a folder without --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert init_model_cmd(str(out), seed=0, target=0.30, shipped=True, overwrite=True) == 0
    assert init_model_cmd(str(tmp_path / "n"), seed=5, target=0.30, shipped=True) == 2
    assert "drop --shipped" in capsys.readouterr().err and not (tmp_path / "n").exists()
