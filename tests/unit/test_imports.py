"""Only ``bus/`` imports nats: every other package talks to NATS through the bus.

An AST scan (not a text search, so a docstring that mentions nats is fine) of every ``.py`` file
under schemas/, services/, observability/, bench/ and tests/.  A failure names each file and
line; the fix is to go through ``bus`` (``open_bus``, the ``Bus`` Protocol), or to move the
nats-specific code into ``bus/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("rlbus", "schemas", "services", "observability", "bench", "tests")


def _nats_imports(source: str, name: str) -> list[str]:
    """``name:line imports module`` for every absolute import of nats (at any depth) in ``source``."""
    tree = ast.parse(source, filename=name)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"{name}:{node.lineno} imports {n}" for n in names
                  if n == "nats" or n.startswith("nats.")]
    return found


def _python_files() -> list[Path]:
    files = []
    for top in CHECKED:
        files += [p for p in sorted((ROOT / top).rglob("*.py")) if ".cache" not in p.parts]
    return files


def test_only_bus_imports_nats() -> None:
    files = _python_files()
    assert len(files) > 50, f"found only {len(files)} files under {CHECKED}: is ROOT ({ROOT}) right?"
    offenders = [hit for f in files for hit in _nats_imports(f.read_text(encoding="utf-8"), str(f.relative_to(ROOT)))]
    assert not offenders, (
        "only bus/ may import nats; go through the bus (open_bus / the Bus Protocol) or move the code into bus/:\n"
        + "\n".join(offenders)
    )


def test_the_scan_sees_every_import_form() -> None:
    sample = ('"""nats is mentioned here, harmlessly."""\nimport os, nats\nfrom nats.js import api\n'
              "import nats.errors as e\nfrom .nats import x\ndef f():\n    from nats import NATS\n")
    hits = _nats_imports(sample, "sample.py")
    assert [h.split(":", 1)[1] for h in hits] == ["2 imports nats", "3 imports nats.js", "4 imports nats.errors",
                                                  "7 imports nats"]
