"""Reading the deploy/systemd files the way systemd does, for the tests beside this module.

Only the subset of systemd's syntax the units use; anything else (a specifier other than %i and
%%, an environment-file line that is no assignment) is an error, so a unit that grows a new form
makes these tests say so rather than run something that differs from what systemd would run.
"""

from __future__ import annotations

import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "deploy" / "systemd"
INSTALL_BIN = "/opt/rlbus/.venv/bin/"  # where the units expect the venv (docs/deploy.md)
VENV_BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Unit:
    """A unit file's directives in file order: (section, key, value)."""

    name: str
    directives: tuple[tuple[str, str, str], ...]

    def values(self, section: str, key: str) -> list[str]:
        return [v for s, k, v in self.directives if s == section and k == key]

    def one(self, section: str, key: str) -> str:
        found = self.values(section, key)
        if len(found) != 1:
            raise AssertionError(f"{self.name}: expected one [{section}] {key}=, found {found}")
        return found[0]

    def instantiated(self, instance: str) -> Unit:
        """The unit with ``%i`` (and ``%%``) replaced, as systemd expands a template instance."""
        def expand(value: str) -> str:
            left = re.findall(r"%[^i%]", value)
            if left:
                raise AssertionError(f"{self.name}: specifier(s) {left} in {value!r}; teach tests/deploy/units.py them")
            return value.replace("%i", instance).replace("%%", "%")

        return Unit(self.name.replace("@.", f"@{instance}."),
                    tuple((s, k, expand(v)) for s, k, v in self.directives))


def read_unit(path: Path) -> Unit:
    section, out, pending = "", [], ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):  # continuation: systemd joins with a space
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        if not sep or not section:
            raise AssertionError(f"{path.name}: cannot read line {raw!r}")
        out.append((section, key.strip(), value.strip()))
    return Unit(path.name, tuple(out))


def read_env_file(path: Path) -> dict[str, str]:
    """An ``EnvironmentFile=``: VAR=value lines, comments on lines of their own, optional quotes."""
    env = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()):
            raise AssertionError(f"{path}:{n}: not a VAR=value line: {raw!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def environment(unit: Unit) -> dict[str, str]:
    """``Environment=`` assignments, in order (later ones win, as in systemd)."""
    env = {}
    for value in unit.values("Service", "Environment"):
        for assignment in shlex.split(value):
            key, _, val = assignment.partition("=")
            env[key] = val
    return env


def local_copy(dest: Path) -> Path:
    """Every unit of deploy/systemd in ``dest`` with the install prefix pointed at this venv, so
    ``systemd-analyze verify`` finds real executables while checking the units' own text."""
    dest.mkdir(parents=True, exist_ok=True)
    for unit in SYSTEMD.glob("*.service"):
        text = unit.read_text()
        if INSTALL_BIN not in text:
            raise AssertionError(f"{unit.name} does not run from {INSTALL_BIN}; update tests/deploy/units.py")
        (dest / unit.name).write_text(text.replace(INSTALL_BIN, f"{VENV_BIN}/"))
    return dest


def systemd_analyze() -> str | None:
    return shutil.which("systemd-analyze")
