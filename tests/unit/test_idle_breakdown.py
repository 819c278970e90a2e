"""bench/pipeline_bench.py's idle breakdown: each trainer wait laid over the generator's batch
phases, from the two services' log lines (synthetic here, in the services' own format)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.pipeline_bench import idle_breakdown, with_settings


def _write(path: Path, events: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + "not json: a traceback line\n")


def test_each_wait_is_split_by_what_the_generator_was_doing(tmp_path: Path) -> None:
    # Generator: batch 1 from t=100: grant wait 0.5, take 0.1, env 0.2, sample 1.0, publish 0.2 (ends 102.0);
    # nothing in hand until batch 2 at t=103: sample 1.0 from 103.0 (ends 104.0).
    _write(tmp_path / "generator-0.log", [
        {"event": "batch", "started": 100.0, "grant_wait_s": 0.5, "take_s": 0.1, "env_s": 0.2, "sample_s": 1.0, "publish_s": 0.2},
        {"event": "step_other"},
        {"event": "batch", "started": 103.0, "grant_wait_s": 0.0, "take_s": 0.0, "env_s": 0.0, "sample_s": 1.0, "publish_s": 0.0},
    ])
    # Trainer waits: 100.4-101.4 (0.1 grant, 0.1 take, 0.2 env, 0.6 sample) and 101.8-103.5
    # (0.2 publish, 1.0 nothing in hand, 0.5 sample of batch 2).
    _write(tmp_path / "trainer.log", [
        {"event": "idle", "started": 100.4, "wait_s": 1.0, "short": 32, "arrived_train": 20, "arrived_filtered": 4},
        {"event": "idle", "started": 101.8, "wait_s": 1.7, "short": 12, "arrived_train": 12, "arrived_stale": 1},
    ])
    out = idle_breakdown(tmp_path)
    assert out["waits"] == 2 and out["wait_s_total"] == pytest.approx(2.7)
    share = out["share_by_generator_phase"]
    seconds = {k: v * 2.7 for k, v in share.items()}  # type: ignore[union-attr]
    expected = {"grant_wait": 0.1, "take": 0.1, "env": 0.2, "sample": 1.1, "publish": 0.2, "no_batch": 1.0}
    for k, v in expected.items():
        assert seconds[k] == pytest.approx(v, abs=0.01), k
    assert out["groups_arriving_during_waits"] == {"train": 32, "filtered": 4, "stale": 1}


def test_no_logs_gives_an_empty_breakdown(tmp_path: Path) -> None:
    out = idle_breakdown(tmp_path)
    assert out["waits"] == 0 and out["wait_s_total"] == 0 and out["groups_arriving_during_waits"] == {}


def test_the_episode_engines_busy_spans_count_as_sampling(tmp_path: Path) -> None:
    # One-turn episodes play on the engine beside the batch driver: a wait with no batch phase over
    # it but the engine decoding is "episodes", not "no_batch".
    _write(tmp_path / "generator-0.log", [
        {"event": "batch", "started": 100.0, "grant_wait_s": 0.0, "take_s": 0.1, "env_s": 0.1, "sample_s": 0.0, "publish_s": 0.0},
        {"event": "episodes_busy", "started": 100.5, "span_s": 0.7},
        {"event": "generator_no_grant", "started": 101.2, "span_s": 0.2},
    ])
    _write(tmp_path / "trainer.log", [{"event": "idle", "started": 100.0, "wait_s": 1.5}])
    seconds = {k: v * 1.5 for k, v in idle_breakdown(tmp_path)["share_by_generator_phase"].items()}  # type: ignore[union-attr]
    assert seconds["episodes"] == pytest.approx(0.7, abs=0.01)
    assert seconds["no_grant"] == pytest.approx(0.2, abs=0.01)  # the batch driver's grant was used up
    assert seconds["no_batch"] == pytest.approx(0.4, abs=0.01)  # 1.5 - 0.2 (take, env) - 0.7 - 0.2


def test_engine_runs_merge_into_spans_logged_at_a_gap_or_at_their_longest(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlbus.services.generator import spans as module

    logged: list[dict[str, object]] = []
    monkeypatch.setattr(module.log, "info", lambda event, **kw: logged.append({"event": event, **kw}))
    spans = module.LoggedSpans("episodes_busy")
    spans.ran(10.0, 10.2)
    spans.ran(10.21, 10.4)  # 10 ms later: the same span
    assert logged == []
    spans.ran(11.0, 11.1)  # after a 0.6 s gap: the first span is logged
    assert logged == [{"event": "episodes_busy", "started": 10.0, "span_s": 0.4}]
    for i in range(30):  # back to back for 3 s: logged once it is MAX_S long
        spans.ran(11.1 + 0.1 * i, 11.2 + 0.1 * i)
    assert len(logged) == 2 and logged[1]["span_s"] == pytest.approx(module.LoggedSpans.MAX_S, abs=0.11)
    spans.flush()
    spans.flush()  # nothing open: nothing more
    assert len(logged) == 3 and sum(float(e["span_s"]) for e in logged[1:]) == pytest.approx(3.1, abs=0.01)  # type: ignore[arg-type]


def test_a_setting_replaces_the_bench_configs_own_key_and_adds_new_tables() -> None:
    import tomllib

    base = "[up]\nstop_at_accuracy = 0.0\n[controller]\neval_every = 50\n"
    text = with_settings(base, ["controller.eval_every=5", "generator.batch_wait_s=0", "up.seed=1"], flag="--with")
    assert tomllib.loads(text) == {"up": {"stop_at_accuracy": 0.0, "seed": 1}, "controller": {"eval_every": 5},
                                   "generator": {"batch_wait_s": 0}}
    with pytest.raises(SystemExit, match="TABLE.KEY=VALUE"):
        with_settings(base, ["eval_every=5"], flag="--with")
