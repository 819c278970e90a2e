"""The installed distribution puts one name on the import path, ``rlbus``.

The code lives in the design card's top-level folders (bus/, schemas/, services/, observability/),
mapped by pyproject.toml onto ``rlbus.bus`` and so on.  PyPI has packages called ``bus``, ``schemas``
and ``services``: had rlbus installed those names, it and any of them would break each other in one
environment.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"rlbus.bus": "bus", "rlbus.schemas": "schemas", "rlbus.services": "services",
           "rlbus.observability": "observability"}


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_listed_under_rlbus() -> None:
    """pyproject.toml lists the packages by hand (a mapped folder cannot be found by prefix): a new
    subpackage left out of that list would be missing from every installed copy."""
    conf = _setuptools()
    assert conf["package-dir"] == {"rlbus": "rlbus", **FOLDERS}
    on_disk = {"rlbus"} | {name + "".join("." + p for p in init.parent.relative_to(ROOT / folder).parts)
                           for name, folder in FOLDERS.items() for init in (ROOT / folder).rglob("__init__.py")
                           if "__pycache__" not in init.parts}
    listed = set(conf["packages"])
    assert listed == on_disk, (f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}; "
                               f"remove: {sorted(listed - on_disk)}")


def test_entry_points_name_rlbus_modules() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    targets = [*project["scripts"].values(),
               *(t for group in project["entry-points"].values() for t in group.values())]
    assert targets and all(t.startswith("rlbus.") for t in targets), targets


def _installed() -> metadata.Distribution:
    try:
        return metadata.distribution("rlbus")
    except metadata.PackageNotFoundError:
        pytest.skip("rlbus is not installed in this environment (pip install -e .)")


def test_the_installed_distribution_has_one_top_level_name() -> None:
    top = (_installed().read_text("top_level.txt") or "").split()
    assert top == ["rlbus"], top


def test_rlbus_imports_from_anywhere_and_the_generic_names_do_not(tmp_path: Path) -> None:
    """From a folder that is not the checkout (``-I``: no current directory, no PYTHONPATH on the path),
    as a user's program would import it."""
    _installed()
    probe = ("import importlib, json\n"
             "got = {}\n"
             "for name in ('rlbus.bus', 'rlbus.schemas', 'rlbus.services.cli', 'rlbus.observability',\n"
             "             'bus', 'schemas', 'services', 'observability'):\n"
             "    try:\n"
             "        importlib.import_module(name); got[name] = 'ok'\n"
             "    except ModuleNotFoundError as e:\n"
             "        got[name] = 'missing ' + str(e.name)\n"
             "print(json.dumps(got))\n")
    out = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert {k: v for k, v in got.items() if k.startswith("rlbus.")} == dict.fromkeys(
        ("rlbus.bus", "rlbus.schemas", "rlbus.services.cli", "rlbus.observability"), "ok")
    assert {k: v for k, v in got.items() if not k.startswith("rlbus.")} == {
        n: f"missing {n}" for n in ("bus", "schemas", "services", "observability")}


@pytest.mark.integration
def test_a_built_wheel_holds_only_rlbus(tmp_path: Path) -> None:
    """What a container image or ``pip install rlbus`` installs (not the editable mapping)."""
    pytest.importorskip("setuptools")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("rlbus-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"rlbus", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, tops
    for module in ("rlbus/__init__.py", "rlbus/bus/jetstream.py", "rlbus/schemas/__init__.py",
                   "rlbus/services/cli.py", "rlbus/services/sandbox/driver.py", "rlbus/observability/__init__.py"):
        assert module in names, module
