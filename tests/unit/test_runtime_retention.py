"""[run.retention] and publish_outage_s: validated bounds, derived stream limits, the trainer's check."""

from __future__ import annotations

import pytest

from rlbus.bus.subjects import Subjects
from rlbus.services.runtime.config import ConfigError, RunSettings, load_section


def test_bus_options_size_the_streams_from_the_run_config():
    run = RunSettings(batch_groups=16, max_staleness=2,
                      retention={"scored_keep_steps": 100, "queue_max_msgs": 5000, "dead_max_mib": 64})
    opts = run.bus_options()
    r = opts["retention"]
    assert r.scored_max_msgs == 100 * 16  # steps kept for replay x groups per step
    assert (r.queue_max_msgs, r.dead_max_bytes, r.queue_max_bytes) == (5000, 64 * 1024 * 1024, 0)
    assert opts["publish_outage"] == 900.0  # minutes of outage before a publish gives up


def test_scored_must_outlive_the_staleness_window():
    with pytest.raises(ConfigError) as err:
        load_section(RunSettings, {"run": {"max_staleness": 8, "retention": {"scored_keep_steps": 20}}}, "run")
    msg = str(err.value)
    assert "scored_keep_steps" in msg and "at least 40" in msg


def test_bounds_name_the_nested_key():
    with pytest.raises(ConfigError, match=r"\[run.retention\] dead_max_msgs"):
        load_section(RunSettings, {"run": {"retention": {"dead_max_msgs": 1}}}, "run")
    with pytest.raises(ConfigError, match=r"\[run.retention\] unknown key 'dead_max'"):
        load_section(RunSettings, {"run": {"retention": {"dead_max": 1}}}, "run")


def test_the_trainer_refuses_a_scored_stream_shorter_than_what_it_holds_unacked():
    from rlbus.services.trainer.intake import consumer_spec
    from rlbus.services.trainer.settings import TrainerSettings

    # It holds up to two checkpoints' worth of groups (acks lag one checkpoint): with
    # max_staleness 2 and checkpoint_every 10, 2 x (2 x 10 + 2 x 3 + 2 + 3) = 62 steps.
    run = RunSettings(pools=["math"], retention={"scored_keep_steps": 62})
    consumer_spec(run, TrainerSettings(checkpoint_every=10), Subjects("r"))
    with pytest.raises(ConfigError, match="scored_keep_steps .* too small .* checkpoint_every = 11"):
        consumer_spec(run, TrainerSettings(checkpoint_every=11), Subjects("r"))
    with pytest.raises(ConfigError, match="scored_keep_steps .* too small .* checkpoint_every = 40"):
        consumer_spec(run, TrainerSettings(checkpoint_every=40), Subjects("r"))
