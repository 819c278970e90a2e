"""Configuration: strict keys, environment overrides, errors that name the key and the fix.

The frozen-keys test lists every public key of every settings class: adding, renaming or
removing a knob must be a deliberate edit here too (and in the docs).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import Field, ValidationError

from rlbus.services.broadcast.settings import BroadcastSettings
from rlbus.services.controller.divergence import DivergenceConfig
from rlbus.services.controller.settings import ControllerSettings
from rlbus.services.environment.settings import EnvironmentSettings
from rlbus.services.generator.settings import ChatEndpointOptions, GeneratorSettings, SpeculativeOptions
from rlbus.services.reward.settings import RewardSettings
from rlbus.services.runtime.config import (
    ConfigError,
    RetentionSettings,
    RunSettings,
    Settings,
    load,
    load_section,
    read_toml,
)
from rlbus.services.speculator.settings import SpeculatorSettings
from rlbus.services.tasks.reasoning_gym import ReasoningGymSettings
from rlbus.services.trainer.advantages import AdvantageConfig
from rlbus.services.trainer.objective import ObjectiveConfig
from rlbus.services.trainer.settings import TrainerSettings
from rlbus.services.up.settings import UpSettings

# Settings classes and the nested tables inside them ([trainer.objective] …).
FROZEN_KEYS: dict[type, list[str]] = {
    RunSettings: ["run", "nats_url", "nats_user", "nats_password_file", "nats_creds_file", "nats_nkey_seed_file",
                  "nats_tls_ca", "nats_tls_cert", "nats_tls_key", "model_name", "model_path", "pools", "eval_pool",
                  "group_size", "batch_groups", "max_staleness", "run_dir", "retention", "replicas", "publish_outage_s",
                  "metrics_port"],
    RetentionSettings: ["queue_max_msgs", "queue_max_mib", "scored_keep_steps", "scored_max_mib", "control_per_subject",
                        "dead_max_msgs", "dead_max_mib", "objects_max_mib"],
    GeneratorSettings: ["instance", "backend", "pools", "max_batch_groups", "min_batch_groups", "batch_wait_s", "threads", "dtype", "deterministic",
                        "admission", "mid_sequence_swap", "single_turn", "eval_weights", "seed", "env_timeout", "slowdown", "slowdown_file", "openai_port", "openai", "vllm", "speculative"],
    SpeculativeOptions: ["drafter", "tail_rows", "max_k", "draft_model_path"],
    ChatEndpointOptions: ["host", "model", "pool", "env", "max_tokens", "group_timeout_s", "episode_ttl_s"],
    TrainerSettings: ["instance", "lr", "weight_decay", "betas", "grad_clip", "threads", "dtype", "autocast", "deterministic",
                      "objective", "advantages", "micro_batch_seqs", "checkpoint_every", "checkpoint_keep",
                      "transport", "max_steps", "ack_wait", "fetch_timeout", "distributed"],
    ObjectiveConfig: ["clip_low", "clip_high", "correction", "is_cap", "is_low", "is_high", "seq_low", "seq_high",
                      "kl_coef", "aggregation"],
    AdvantageConfig: ["normalize_std", "baseline"],
    RewardSettings: ["instance", "batch", "concurrency", "format_weight", "sandbox"],
    EnvironmentSettings: ["instance", "episode_ttl_s", "max_episodes", "observation_chars", "sandbox"],
    BroadcastSettings: ["instance", "transport", "keep_versions", "keep_eval_versions", "in_use_ttl"],
    SpeculatorSettings: ["instance", "draft_model_path", "batch_samples", "buffer_samples", "publish_every", "lr",
                         "threads", "transport", "max_deliver"],
    ControllerSettings: ["instance", "period", "silent_after", "max_outstanding", "eval_tasks", "eval_every",
                         "refresh", "pool_mix", "route_period", "tau", "stall_after", "divergence"],
    DivergenceConfig: ["window", "reward_rise", "heldout_drop", "min_heldout", "min_steps", "z"],
    ReasoningGymSettings: ["config", "system", "extract", "reward"],
    UpSettings: ["task", "model", "reasoning_gym", "train_tasks", "epochs", "eval_tasks", "max_steps", "stop_at_accuracy", "stop_rounds", "seed", "backend", "generators",
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


def fields_of(cls: type) -> dict:
    """Fields of a settings model or of a nested table (a pydantic dataclass)."""
    return dict(cls.__pydantic_fields__)  # type: ignore[attr-defined]


@pytest.mark.parametrize("cls", list(FROZEN_KEYS), ids=lambda c: c.__name__)
def test_public_keys_are_frozen(cls):
    assert list(fields_of(cls)) == FROZEN_KEYS[cls], (
        f"{cls.__name__} keys changed: update FROZEN_KEYS deliberately (and the docs)"
    )


@pytest.mark.parametrize("cls", list(FROZEN_KEYS), ids=lambda c: c.__name__)
def test_every_key_is_documented_and_every_default_is_valid(cls):
    for name, field in fields_of(cls).items():
        assert field.description and len(field.description) > 10, f"{cls.__name__}.{name} has no description"
    cls()  # the defaults alone make a valid config


def test_every_nested_table_of_the_trainer_is_listed():
    for name, field in fields_of(TrainerSettings).items():
        if hasattr(field.annotation, "__pydantic_fields__"):
            assert field.annotation in FROZEN_KEYS, f"TrainerSettings.{name} is a table: freeze its keys too"


def test_unknown_key_names_it_and_lists_the_valid_ones(tmp_path):
    path = write(tmp_path, "[run]\nmax_staleness = 2\n\n[trainer]\nlrr = 1e-4\n")
    with pytest.raises(ConfigError) as info:
        load(path, TrainerSettings, "trainer")
    msg = str(info.value)
    assert "[trainer] unknown key 'lrr'" in msg
    valid = msg.split("valid keys:")[1]
    assert all(k in valid for k in ("lr", "objective", "advantages", "max_steps"))


def test_a_typo_in_an_environment_variable_is_an_error_too(monkeypatch):
    monkeypatch.setenv("RLBUS_RUN__MAX_STALENES", "3")
    with pytest.raises(ConfigError, match=r"\[run\] unknown key 'max_stalenes'.*max_staleness"):
        load(None, RewardSettings, "reward")


def test_environment_overrides_the_file(tmp_path, monkeypatch):
    path = write(tmp_path, '[run]\nmax_staleness = 1\nbatch_groups = 8\n\n[trainer]\nlr = 1e-3\n')
    monkeypatch.setenv("RLBUS_RUN__MAX_STALENESS", "3")
    monkeypatch.setenv("RLBUS_TRAINER__OBJECTIVE__CORRECTION", "mis")  # a bare string, not TOML
    monkeypatch.setenv("RLBUS_RUN__POOLS", '["math", "code"]')
    run, trainer = load(path, TrainerSettings, "trainer")
    assert run.max_staleness == 3
    assert run.batch_groups == 8  # from the file
    assert run.pools == ["math", "code"]
    assert trainer.lr == 1e-3 and trainer.objective.correction == "mis"
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


# ---- nested tables: [trainer.objective], [trainer.advantages] --------------------------------


def test_the_trainer_tables_are_the_classes_the_maths_uses(tmp_path, monkeypatch):
    path = write(tmp_path, "[trainer]\nlr = 1e-3\n\n[trainer.objective]\ncorrection = \"mis\"\nis_cap = 3\n"
                           "kl_coef = 0.01\n\n[trainer.advantages]\nbaseline = \"leave_one_out\"\n")
    monkeypatch.setenv("RLBUS_TRAINER__OBJECTIVE__IS_CAP", "4")  # one `__` per level
    monkeypatch.setenv("RLBUS_TRAINER__ADVANTAGES__NORMALIZE_STD", "false")
    _, trainer = load(path, TrainerSettings, "trainer")
    assert trainer.objective == ObjectiveConfig(correction="mis", is_cap=4.0, kl_coef=0.01)  # the file's rest kept
    assert trainer.advantages == AdvantageConfig(normalize_std=False, baseline="leave_one_out")
    assert trainer.redacted()["objective"]["is_cap"] == 4.0


@pytest.mark.parametrize(("key", "value", "bound"), [
    ("is_cap", "0.5", "greater than or equal to 1"),  # once passed here and failed at the first step
    ("is_cap", "inf", "finite"),
    ("is_low", "1.5", "less than or equal to 1"),
    ("is_low", "0", "greater than 0"),
    ("is_high", "0.9", "greater than or equal to 1"),
    ("seq_low", "1.01", "less than or equal to 1"),
    ("seq_high", "0.999", "greater than or equal to 1"),
    ("clip_low", "1.0", "less than 1"),
    ("clip_high", "-0.1", "greater than or equal to 0"),
    ("kl_coef", "nan", "finite"),
    ("correction", '"ppo"', "'tis'"),
])
def test_an_objective_bound_is_checked_when_the_config_is_read(tmp_path, key, value, bound):
    path = write(tmp_path, f"[trainer.objective]\n{key} = {value}\n")
    with pytest.raises(ConfigError) as info:
        load(path, TrainerSettings, "trainer")
    line = str(info.value).splitlines()[1]
    assert line.strip().startswith(f"[trainer.objective] {key}:") and bound in line, line
    # ... and it quotes the key's documentation, which says why the bound is what it is.
    doc = " ".join(fields_of(ObjectiveConfig)[key].description.replace("``", "").split())
    assert line.endswith(doc)


def test_an_old_flat_key_says_where_it_moved(tmp_path, monkeypatch):
    path = write(tmp_path, "[trainer]\nis_cap = 3\nbaseline = \"mean\"\n")
    with pytest.raises(ConfigError) as info:
        load(path, TrainerSettings, "trainer")
    msg = str(info.value)
    assert "'is_cap' moved to [trainer.objective] is_cap" in msg and "RLBUS_TRAINER__OBJECTIVE__IS_CAP" in msg
    assert "'baseline' moved to [trainer.advantages] baseline" in msg
    monkeypatch.setenv("RLBUS_TRAINER__KL_COEF", "0.1")
    with pytest.raises(ConfigError, match=r"'kl_coef' moved to \[trainer.objective\] kl_coef"):
        load(None, TrainerSettings, "trainer")


def test_a_typo_inside_a_nested_table_names_the_table(monkeypatch):
    monkeypatch.setenv("RLBUS_TRAINER__OBJECTIVE__IS_CAPP", "3")
    with pytest.raises(ConfigError) as info:
        load(None, TrainerSettings, "trainer")
    msg = str(info.value)
    assert "[trainer.objective] unknown key 'is_capp'" in msg
    assert "is_cap" in msg.split("valid keys:")[1] and "clip_low" in msg


def test_a_variable_cannot_open_a_table_where_the_file_has_a_value(tmp_path, monkeypatch):
    path = write(tmp_path, "[trainer]\nobjective = 3\n")
    monkeypatch.setenv("RLBUS_TRAINER__OBJECTIVE__IS_CAP", "3")
    with pytest.raises(ConfigError, match=r"\[trainer\] objective is a value in the config file"):
        load(path, TrainerSettings, "trainer")


def test_nats_url_takes_the_members_of_a_cluster_and_names_a_bad_one(monkeypatch):
    # The compose file's value, as its environment variable carries it.
    monkeypatch.setenv("RLBUS_RUN__NATS_URL", '"nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222"')
    run, _ = load(None, RewardSettings, "reward")
    from rlbus.bus.urls import server_urls

    assert server_urls(run.nats_url) == ["nats://nats-1:4222", "nats://nats-2:4222", "nats://nats-3:4222"]
    monkeypatch.setenv("RLBUS_RUN__NATS_URL", '"nats://nats-1:4222,nats-2:4222"')
    with pytest.raises(ConfigError, match=r"'nats-2:4222' is not a NATS server URL.*scheme://host:port"):
        load(None, RewardSettings, "reward")
