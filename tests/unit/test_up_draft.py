"""``rlbus up`` with a drafter that uses a draft model ("model", "static", "model+group",
"static+group") and no draft folder builds the draft from the policy
into the run folder (``rlbus init-draft``), so the speculative run starts with one config line."""

from __future__ import annotations

from pathlib import Path

from rlbus.services.commands.init_model import init_draft_cmd
from rlbus.services.generator.settings import SpeculativeOptions
from rlbus.services.policy.load import load_policy
from rlbus.services.up.main import ensure_draft


def test_up_builds_the_draft_only_when_a_drafter_needs_one(tiny_model: Path, tmp_path: Path) -> None:
    data = {"generator": {"speculative": {"drafter": "model"}}}
    ensure_draft(data, tiny_model, tmp_path)
    path = data["generator"]["speculative"]["draft_model_path"]
    assert path == str(tmp_path / "draft")
    draft, _ = load_policy(path)
    policy, _ = load_policy(str(tiny_model))
    assert draft.config.num_hidden_layers == 1 < policy.config.num_hidden_layers
    assert SpeculativeOptions(drafter="model", draft_model_path=path).draft_model_path == path  # the generator takes it
    combined = {"generator": {"speculative": {"drafter": "model+group"}}}
    ensure_draft(combined, tiny_model, tmp_path)  # the folder built above is reused
    assert combined["generator"]["speculative"]["draft_model_path"] == path
    for kept in ({"generator": {"speculative": {"drafter": "group"}}},
                 {"generator": {"speculative": {"drafter": "static", "draft_model_path": "mine"}}},
                 {"generator": {"speculative": {"drafter": "static+group", "draft_model_path": "mine"}}}, {}):
        before = repr(kept)
        ensure_draft(kept, tiny_model, tmp_path / "other")
        assert repr(kept) == before and not (tmp_path / "other").exists()


def test_init_draft_refuses_what_it_cannot_build(tiny_model: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert init_draft_cmd(str(tiny_model), str(tmp_path / "d"), layers=99) == 2
    assert "layers=99" in capsys.readouterr().err
    assert init_draft_cmd(str(tiny_model), str(tmp_path / "d"), layers=2) == 0
    assert init_draft_cmd(str(tiny_model), str(tmp_path / "d"), layers=2) == 2
    assert "--overwrite" in capsys.readouterr().err
