"""The resolved config `rlbus up` writes reads back as the same tables, nested ones included."""

from __future__ import annotations

import tomllib

from rlbus.services.up.tomlw import dumps


def test_round_trip_with_nested_tables() -> None:
    tables = {
        "run": {"run": "demo", "pools": ["a", "b"], "max_staleness": 2},
        "trainer": {"lr": 1e-4, "objective": {"is_cap": 3.0, "correction": "tis"},
                    "advantages": {"normalize_std": False}},
        "generator": {"backend": "vllm", "vllm": {"threads": 2, "extra args": {"x": 1}}},
        "up": {},
    }
    assert tomllib.loads(dumps(tables)) == tables
