"""The shape a newcomer can hold in their head, kept by a test: no function of the project's
packages runs past a screen, and no service keeps its state in closures (``nonlocal``).

Benchmarks and tests are exempt (a benchmark script may read top to bottom)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bus", "schemas", "services", "observability")
MAX_FUNCTION_LINES = 80


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), filename=str(p))) for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def test_no_function_longer_than_a_screen() -> None:
    long = [f"{p.relative_to(ROOT)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p, tree in _modules() for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno is not None
            and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"split these into named steps (at most {MAX_FUNCTION_LINES} lines each): {long}"


def test_no_state_hidden_in_closures() -> None:
    hidden = [f"{p.relative_to(ROOT)}:{n.lineno}" for p, tree in _modules() for n in ast.walk(tree)
              if isinstance(n, ast.Nonlocal)]
    assert not hidden, f"state shared through nonlocal; give it a name on a class instead: {hidden}"


def test_service_run_functions_only_wire() -> None:
    """Each service's ``run()`` builds its parts and starts them; the work lives in methods."""
    for service in sorted((ROOT / "services").glob("*/service.py")):
        tree = ast.parse(service.read_text())
        runs = [n for n in tree.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "run"]
        assert runs, f"{service.relative_to(ROOT)} has no top-level async def run()"
        nested = [n.name for n in ast.walk(runs[0]) if n is not runs[0]
                  and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        assert not nested, f"{service.relative_to(ROOT)}: run() defines {nested}; make them methods of a class"
