"""``rlbus status``: the snapshot built from heartbeats, decisions and consumer state, and its tables."""

from __future__ import annotations

import json

from rich.console import Console

from rlbus.bus.protocol import ConsumerState, StreamState
from rlbus.schemas import Admit, AssignPools, Control, Divergence, Heartbeat, RunState, SetMix
from rlbus.services.commands.status import build_snapshot, render

NOW = 1000.0


def fixtures() -> tuple[list[Heartbeat], list[StreamState], list[Control]]:
    hbs = [
        Heartbeat(service="trainer", instance="trainer-0", seq=9, ts=NOW - 1, version=12,
                  metrics={"trainer/idle_fraction": 0.25, "trainer/pending_groups": 3, "trainer/step": 12,
                           "trainer/groups_trained_total": 96, "trainer/groups_dropped_total": 7,
                           "trainer/groups_stale": 2}),
        Heartbeat(service="generator", instance="gen-0", seq=3, ts=NOW - 0.5, version=11,
                  metrics={"generator/groups_per_s": 4.0, "generator/in_flight": 8, "generator/concurrency": 8},
                  info={"boot": "x", "pools": ["a", "b"], "shares": {"a": 1.0}}),
        Heartbeat(service="generator", instance="gen-1", seq=3, ts=NOW - 0.5, version=12, state="draining",
                  metrics={"generator/groups_per_s": 0.5, "generator/in_flight": 1, "generator/concurrency": 1},
                  info={"boot": "y", "pools": ["b", "a"]}),
        Heartbeat(service="controller", instance="controller-0", seq=3, ts=NOW - 0.2, version=12,
                  metrics={"controller/balance/consumption": 2.0, "controller/balance/effective": 1.8,
                           "controller/balance/production": 4.5, "controller/pool/a/consumption": 1.0,
                           "controller/pool/a/effective": 1.2, "controller/pool/b/consumption": 1.0,
                           "controller/pool/b/effective": 0.6, "controller/target/a": 0.5, "controller/target/b": 0.5,
                           "controller/generator/gen-1/latency_s": 3.5, "controller/allowed_total": 40,
                           "controller/mix_from_trainer": 0.0}),
    ]
    streams = [StreamState(name="RL_r_TASKS", subjects=("rl.r.tasks.>",), messages=50, bytes=1,
                           consumers=(ConsumerState("generator_a", pending=30, ack_pending=8, redelivered=2, waiting=0),))]
    decisions = [
        Control(seq=1, decision=Admit(boot="x", grant_total=40, min_version=2), target_service="generator",
                target_instance="gen-0", reason="allowed=...", issued_at=NOW - 5, issuer="controller-0"),
        Control(seq=4, decision=AssignPools(pools=["a", "b"], shares={"a": 0.75, "b": 0.25}), target_service="generator",
                target_instance="gen-0", reason="need a 0.50, b 0.50", issued_at=NOW - 2, issuer="controller-0"),
        Control(seq=3, decision=RunState(state="drain"), target_service="generator", target_instance="gen-1",
                reason="operator", issued_at=NOW - 3, issuer="operator"),
        Control(seq=5, decision=SetMix(mix={"a": 0.5, "b": 0.5}), target_service="controller", target_instance="all",
                issued_at=NOW - 60, issuer="operator"),
    ]
    return hbs, streams, decisions


def test_snapshot_has_every_instance_with_rate_version_lag_in_flight_and_last_decision():
    snap = build_snapshot("r", *fixtures(), now=NOW)
    g0, g1, tr = snap["instances"]["generator/gen-0"], snap["instances"]["generator/gen-1"], snap["instances"]["trainer/trainer-0"]
    assert (g0["rate"], g0["version"], g0["lag"], g0["in_flight"]) == (4.0, 11, 1, 8)
    assert g0["last_decision"]["action"] == "assign_pools" and g0["last_decision"]["age_s"] == 2.0
    assert g0["last_decision"]["decision"] == {"pools": ["a", "b"], "shares": {"a": 0.75, "b": 0.25}}
    assert g0["last_decision"]["issuer"] == "controller-0"
    assert snap["instances"]["generator/gen-1"]["last_decision"]["decision"] == {"state": "drain", "boot": ""}
    assert g1["state"] == "draining" and g1["lag"] == 0 and g1["latency_s"] == 3.5
    assert tr["rate"] == 2.0 and tr["in_flight"] == 3 and tr["lag"] is None
    assert snap["queues"]["RL_r_TASKS"]["consumers"]["generator_a"] == {"pending": 30, "ack_pending": 8,
                                                                       "redelivered": 2}
    assert snap["pools"]["b"]["e_over_c"] == 0.6 and snap["pools"]["a"]["target"] == 0.5
    assert snap["balance"]["e_over_c"] == 0.9 and snap["balance"]["trainer_idle_fraction_total"] == 0.25
    assert snap["admission"]["mix_measured_on"] == "generators"
    assert snap["decisions"]["controller/all"]["action"] == "set_mix"
    assert snap["decisions"]["controller/all"]["decision"] == {"mix": {"a": 0.5, "b": 0.5}}
    json.dumps(snap)  # --json: plain data only


def test_render_shows_the_tables_a_user_reads():
    console = Console(record=True, width=200)
    console.print(*render(build_snapshot("r", *fixtures(), now=NOW)))
    text = console.export_text()
    for expected in ("generator/gen-0", "assign_pools pools=a,b shares=a:0.75,b:0.25 (controller-0", "draining",
                     "drain (operator", "C 2/s vs E 1.8/s", "generator_a", "E/C", "allowed_total=40",
                     "last decision to controller/all: set_mix mix=a:0.5,b:0.5 (operator"):
        assert expected in text, expected


def test_an_empty_run_renders_without_a_controller_or_trainer():
    snap = build_snapshot("r", [], [], [], now=NOW)
    assert snap["instances"] == {} and snap["pools"] == {} and snap["admission"] == {}
    Console(record=True).print(*render(snap))


def test_a_firing_divergence_alarm_is_shown_until_the_controller_clears_it():
    hbs, streams, decisions = fixtures()
    fired = Control(seq=6, decision=Divergence(firing=True, reward_trend=0.3, heldout_trend=-0.2, from_version=2,
                                               to_version=12, heldout_readings=3,
                                               detail="training reward +0.300 ... check reward hacking"),
                    target_service="controller", target_instance="controller-0", issued_at=NOW - 1,
                    issuer="controller-0")
    snap = build_snapshot("r", hbs, streams, [*decisions, fired], now=NOW)
    assert snap["divergences"]["controller-0"]["versions"] == [2, 12]
    assert snap["divergences"]["controller-0"]["heldout_trend"] == -0.2
    console = Console(record=True, width=200)
    console.print(*render(snap))
    assert "DIVERGING (controller-0): training reward +0.300 ... check reward hacking" in console.export_text()
    cleared = Control(seq=7, decision=Divergence(firing=False), target_service="controller",
                      target_instance="controller-0", issuer="controller-0")
    assert build_snapshot("r", hbs, streams, [*decisions, cleared, fired], now=NOW)["divergences"] == {}
