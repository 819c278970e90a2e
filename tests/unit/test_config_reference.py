"""docs/reference/configuration.md is the settings classes rendered: a key added, renamed or
re-described in a settings class without regenerating the page fails here."""

from __future__ import annotations

from pathlib import Path

from rlbus.services.commands.config_reference import render

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "configuration.md"


def test_the_committed_reference_is_current() -> None:
    assert PAGE.read_text(encoding="utf-8") == render(), (
        "docs/reference/configuration.md is out of date: run "
        "`python -m rlbus.services.commands.config_reference --out docs/reference/configuration.md`")


def test_every_table_of_a_run_config_is_in_the_reference() -> None:
    from rlbus.services.catalog import SERVICES

    text = render()
    for table in ("run", "run.retention", "up", *SERVICES, "trainer.objective", "trainer.advantages"):
        assert f"## `[{table}]`" in text, table
    assert "| `max_staleness` | int | `2` | >= 0, <= 64 |" in text
