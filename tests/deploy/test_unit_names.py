"""``rlbus serve <service>-<suffix>``: the unit name a systemd template passes (``rlbus@generator-1``
runs ``rlbus serve generator-1``) names the role and the instance."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbus.services.cli import main
from rlbus.services.runtime.config import ConfigError
from rlbus.services.serve import parse_unit, resolve


def test_plain_service_keeps_the_configured_instance(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('[generator]\ninstance = "gen-7"\n')
    entry, _, cfg = resolve("generator", str(config))
    assert (entry.name, cfg.instance) == ("generator", "gen-7")
    assert resolve("generator", None)[2].instance == "gen-0"


@pytest.mark.parametrize(("unit", "role"), [("generator-1", "generator"), ("trainer-a-b", "trainer"),
                                            ("environment-2", "environment"), ("controller-eu", "controller")])
def test_suffixed_unit_name_is_the_instance(unit: str, role: str) -> None:
    entry, run_cfg, cfg = resolve(unit, None)
    assert (entry.name, cfg.instance) == (role, unit)
    assert run_cfg.run == "demo"  # the rest of the config is loaded as for the plain name


@pytest.mark.parametrize("unit", ["generatorx", "gen-1", "generator-", "-1", "foo"])
def test_unknown_role_names_the_services(unit: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_unit(unit)
    assert f"unknown service {unit!r}" in str(err.value) and "generator-1 runs the generator" in str(err.value)


def test_instance_must_fit_a_subject_token() -> None:
    with pytest.raises(ConfigError, match="instance from the unit name.*no dots"):
        resolve("generator-a.b", None)


def test_a_config_naming_another_instance_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLBUS_GENERATOR__INSTANCE", "gen-3")
    with pytest.raises(ConfigError, match=r"instance = 'gen-3'.*disagrees with the unit name's instance 'generator-1'"):
        resolve("generator-1", None)
    monkeypatch.setenv("RLBUS_GENERATOR__INSTANCE", "generator-1")  # agreeing is fine
    assert resolve("generator-1", None)[2].instance == "generator-1"


def test_cli_refuses_an_unknown_service_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "trainr-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlbus serve trainr-1: unknown service 'trainr-1'") and "trainer" in err
