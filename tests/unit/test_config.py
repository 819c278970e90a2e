"""Configuration: strict keys, environment overrides, errors that name the key and the fix.

The frozen-keys test lists every public key of every settings class: adding, renaming or
removing a knob must be a deliberate edit here too (and in the docs).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import Field, ValidationError

from services.broadcast.settings import BroadcastSettings
from services.controller.settings import ControllerSettings
from services.environment.settings import EnvironmentSettings
from services.generator.settings import GeneratorSettings
from services.reward.settings import RewardSettings
from services.runtime.config import ConfigError, RunSettings, Settings, load, load_section, read_toml
from services.trainer.settings import TrainerSettings
from services.up.settings import UpSettings

FROZEN_KEYS: dict[type[Settings], list[str]] = {
    RunSettings: ["run", "nats_url", "model_name", "model_path", "pools", "eval_pool", "group_size", "batch_groups",
                  "max_staleness", "run_dir"],
    GeneratorSettings: ["instance", "backend", "pools", "max_batch_groups", "min_batch_groups", "batch_wait_s", "threads", "dtype", "deterministic",
                        "admission", "mid_sequence_swap", "eval_weights", "seed", "env_timeout", "slowdown", "slowdown_file", "vllm"],
    TrainerSettings: ["instance", "lr", "weight_decay", "betas", "grad_clip", "threads", "dtype", "deterministic",
                      "clip_low", "clip_high", "correction", "is_cap", "is_low", "is_high", "seq_low", "seq_high",
                      "kl_coef", "aggregation", "normalize_std", "baseline", "micro_batch_seqs", "checkpoint_every", "checkpoint_keep",
                      "transport", "max_steps", "ack_wait", "fetch_timeout", "distributed"],
    RewardSettings: ["instance", "batch", "concurrency", "format_weight"],
    EnvironmentSettings: ["instance"],
    BroadcastSettings: ["instance", "transport", "keep_versions", "keep_eval_versions", "in_use_ttl"],
    ControllerSettings: ["instance", "period", "silent_after", "max_outstanding", "eval_tasks", "eval_every",
                         "refresh", "pool_mix", "route_period", "tau"],
    UpSettings: ["train_tasks", "epochs", "eval_tasks", "max_steps", "stop_at_accuracy", "stop_rounds", "seed", "backend", "generators",
                 "max_new_tokens", "temperature", "init_target", "shutdown_grace"],
}


@pytest.fixture(autouse=True)
def _no_ambient_overrides(monkeypatch):
    """A developer's shell must not change what these tests see."""
    for key in list(os.environ):
        if key.startswith("RLBUS_"):
            monkeypatch.delenv(key)


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("cls", list(FROZEN_KEYS), ids=lambda c: c.__name__)
def test_public_keys_are_frozen(cls):
    assert list(cls.model_fields) == FROZEN_KEYS[cls], (
        f"{cls.__name__} keys changed: update FROZEN_KEYS deliberately (and the docs)"
    )


@pytest.mark.parametrize("cls", list(FROZEN_KEYS), ids=lambda c: c.__name__)
def test_every_key_is_documented_and_every_default_is_valid(cls):
    for name, field in cls.model_fields.items():
        assert field.description and len(field.description) > 10, f"{cls.__name__}.{name} has no description"
    cls()  # the defaults alone make a valid config


def test_unknown_key_names_it_and_lists_the_valid_ones(tmp_path):
    path = write(tmp_path, "[run]\nmax_staleness = 2\n\n[trainer]\nlrr = 1e-4\n")
    with pytest.raises(ConfigError) as info:
        load(path, TrainerSettings, "trainer")
    msg = str(info.value)
    assert "[trainer] unknown key 'lrr'" in msg
    valid = msg.split("valid keys:")[1]
    assert all(k in valid for k in ("lr", "clip_high", "max_steps"))


def test_a_typo_in_an_environment_variable_is_an_error_too(monkeypatch):
    monkeypatch.setenv("RLBUS_RUN__MAX_STALENES", "3")
    with pytest.raises(ConfigError, match=r"\[run\] unknown key 'max_stalenes'.*max_staleness"):
        load(None, RewardSettings, "reward")


def test_environment_overrides_the_file(tmp_path, monkeypatch):
    path = write(tmp_path, '[run]\nmax_staleness = 1\nbatch_groups = 8\n\n[trainer]\nlr = 1e-3\n')
    monkeypatch.setenv("RLBUS_RUN__MAX_STALENESS", "3")
    monkeypatch.setenv("RLBUS_TRAINER__CORRECTION", "mis")  # a bare string, not TOML
    monkeypatch.setenv("RLBUS_RUN__POOLS", '["math", "code"]')
    run, trainer = load(path, TrainerSettings, "trainer")
    assert run.max_staleness == 3
    assert run.batch_groups == 8  # from the file
    assert run.pools == ["math", "code"]
    assert trainer.lr == 1e-3 and trainer.correction == "mis"
    assert run.admission_window_groups == (3 + 1) * 8


def test_other_sections_variables_do_not_leak(monkeypatch):
    monkeypatch.setenv("RLBUS_TRAINER__LR", "0.05")
    _, reward = load(None, RewardSettings, "reward")
    assert reward == RewardSettings()


def test_invalid_value_names_the_key_and_what_was_given(tmp_path):
    path = write(tmp_path, '[run]\nmax_staleness = 100\ngroup_size = "eight"\n')
    with pytest.raises(ConfigError) as info:
        load(path, EnvironmentSettings, "environment")
    msg = str(info.value)
    assert "[run] max_staleness" in msg and "100" in msg and "64" in msg
    assert "[run] group_size" in msg and "'eight'" in msg  # every error at once, not one per run


def test_invalid_literal_choice_lists_the_choices(monkeypatch):
    monkeypatch.setenv("RLBUS_GENERATOR__BACKEND", "tensorrt")
    with pytest.raises(ConfigError) as info:
        load(None, GeneratorSettings, "generator")
    assert "[generator] backend" in str(info.value) and "'torch'" in str(info.value)


def test_run_name_must_be_a_subject_token():
    with pytest.raises(ConfigError, match=r"\[run\] run"):
        load_section(RunSettings, {"run": {"run": "my.run"}}, "run")


@pytest.mark.parametrize(("staleness", "batch", "window", "samples"), [(0, 32, 32, 256), (1, 32, 64, 256), (4, 3, 15, 24)])
def test_derived_sizes(staleness, batch, window, samples):
    run = RunSettings(max_staleness=staleness, batch_groups=batch)
    assert run.admission_window_groups == window
    assert run.batch_samples == samples


def test_settings_are_frozen():
    run = RunSettings()
    with pytest.raises(ValidationError):
        run.max_staleness = 5  # type: ignore[misc]


def test_missing_or_broken_file_says_so(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_toml(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        read_toml(write(tmp_path, "[run\n"))
    assert read_toml(None) == {}


def test_secrets_are_redacted_in_the_logged_config():
    class WithSecret(Settings):
        nats_token: str = Field("", description="Token for the NATS server.")
        user: str = Field("me", description="Who connects.")

    shown = WithSecret(nats_token="s3cr3t").redacted()
    assert shown == {"nats_token": "***", "user": "me"}
    assert WithSecret().redacted()["nats_token"] == ""  # nothing to hide: show that it is empty
