"""deploy/compose.yaml (+ compose.gpu.yaml) and deploy/Containerfile*, checked statically: no
container engine runs on the test machines, so nothing here builds an image or starts a container.

What is checked: every build context and Containerfile exists, and every COPY source is in the
build context (and let through .dockerignore); every bind-mounted host path exists (the files
other parts of the repo own included: deploy/prometheus/prometheus.yml, observability/grafana/);
every rlbus service's command names a catalog service, instances are distinct, and the run config
it names, with that service's environment applied, loads as `rlbus serve` loads it.
"""

from __future__ import annotations

import os
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlbus.services.catalog import SERVICES
from rlbus.services.serve import parse_unit, resolve

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILES = ("compose.yaml", "compose.gpu.yaml")
# Host paths the operator provides (gitignored): the model folders, and the credentials
# `rlbus auth init --out deploy/auth` writes.
AUTH = DEPLOY / "auth"
PROVIDED_BY_USER = {ROOT / "models", AUTH / "auth.conf"}
CONFIG_CHOICES = ("run.toml", "qwen-instruct-gpu.toml")  # what ${RLBUS_CONFIG} is documented to name


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ``${VAR}`` / ``${VAR:-default}`` / ``$$``; any other ``$`` form is an error here."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, default = m.group(1), m.group(3)
        return env.get(name) or (default if default is not None else "")

    out = re.sub(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(:-([^}]*))?\}", one, value)
    assert "$" not in out.replace("$$", ""), f"unhandled interpolation in {value!r}"
    return out


def load_compose(*names: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The files merged as ``docker compose -f a -f b`` merges services (maps key by key)."""
    merged: dict[str, Any] = {"services": {}}
    for name in names:
        doc = interpolate(yaml.safe_load((DEPLOY / name).read_text()), env or {})
        for svc, body in doc.get("services", {}).items():
            merged["services"][svc] = {**merged["services"].get(svc, {}), **body}
        merged.setdefault("volumes", {}).update(doc.get("volumes") or {})
    return merged


def rlbus_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose["services"].items() if "Containerfile" in s.get("build", {}).get("dockerfile", "")}


def host_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path of each bind mount (named volumes left out)."""
    out = {}
    for spec in service.get("volumes", []):
        if isinstance(spec, dict):  # long syntax
            source, target = (spec["source"], spec["target"]) if spec["type"] == "bind" else ("", "")
        else:
            source, target = spec.split(":")[:2]
        if source.startswith((".", "/")):
            out[target] = (DEPLOY / source).resolve()
    return out


def resolve_unit(service: dict[str, Any]) -> tuple[str, str]:
    argv = service["command"]
    assert argv[0] == "serve" and argv[2] == "--config", argv
    return parse_unit(argv[1])[0].name, argv[3]


def test_compose_services_are_the_catalog_plus_the_stack() -> None:
    services = load_compose("compose.yaml")["services"]
    rlbus = rlbus_services(load_compose("compose.yaml"))
    roles = {resolve_unit(s)[0] for s in rlbus.values()}
    assert roles == set(SERVICES), f"compose runs {sorted(roles)}, the catalog has {sorted(SERVICES)}"
    assert {"nats-1", "nats-2", "nats-3", "jaeger", "prometheus", "grafana"} <= set(services)
    generators = [n for n, s in rlbus.items() if resolve_unit(s)[0] == "generator"]
    assert len(generators) >= 2, "the stack shows replicated generators"
    for name, svc in services.items():
        if "image" in svc:
            assert ":" in svc["image"] and not svc["image"].endswith(":latest"), f"{name}: pin the image tag"


@pytest.mark.parametrize("files", [("compose.yaml",), COMPOSE_FILES])
def test_builds_and_bind_mounts_exist(files: tuple[str, ...]) -> None:
    missing = []
    for name, svc in load_compose(*files)["services"].items():
        if "build" in svc:
            context = (DEPLOY / svc["build"]["context"]).resolve()
            if not (context / svc["build"]["dockerfile"]).is_file():
                missing.append(f"{name}: build file {svc['build']['dockerfile']} in {context}")
        for target, source in host_mounts(svc).items():
            if source not in PROVIDED_BY_USER and not source.exists():
                missing.append(f"{name}: {source.relative_to(ROOT)} (mounted at {target})")
    assert not missing, "missing from the repository:\n" + "\n".join(missing)


@pytest.mark.parametrize("config", CONFIG_CHOICES)
@pytest.mark.parametrize("files", [("compose.yaml",), COMPOSE_FILES])
def test_every_rlbus_service_loads_its_config_with_its_environment(
        files: tuple[str, ...], config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    compose = load_compose(*files, env={"RLBUS_CONFIG": config})
    nats_nodes = sorted(n for n in compose["services"] if n.startswith("nats-"))
    instances = {}
    for name, svc in rlbus_services(compose).items():
        unit, in_container = svc["command"][1], svc["command"][3]
        mounts = host_mounts(svc)
        target = next((t for t in mounts if in_container.startswith(t + "/")), None)
        assert target is not None, f"{name}: --config {in_container} is on no bind mount"
        host_config = mounts[target] / in_container[len(target) + 1:]
        assert host_config.is_file(), f"{name}: {host_config} does not exist"
        for key in [k for k in os.environ if k.startswith("RLBUS_")]:
            monkeypatch.delenv(key)
        for key, value in svc.get("environment", {}).items():
            monkeypatch.setenv(key, str(value))
        entry, run_cfg, cfg = resolve(unit, str(host_config))  # raises ConfigError naming the key
        instances[name] = (entry.name, cfg.instance)
        assert run_cfg.nats_url.split(",") == [f"nats://{n}:4222" for n in nats_nodes], run_cfg.nats_url
        assert run_cfg.replicas == len(nats_nodes)
        assert run_cfg.metrics_port == 9464  # deploy/prometheus/prometheus.yml scrapes it
    pairs = list(instances.values())
    assert len(set(pairs)) == len(pairs), f"two services share a role and instance: {instances}"


def node_config(svc: dict[str, Any], mounts: dict[str, Path]) -> tuple[str, Path]:
    """The folder in the container of the config a nats node's ``-c`` names, and its host file
    through the bind mount (``mounts``: ``host_mounts(svc)``) that holds it."""
    conf = svc["command"][svc["command"].index("-c") + 1]
    target = next(t for t in mounts if conf.startswith(t + "/"))
    return target, mounts[target] / conf[len(target) + 1:]


def test_nats_nodes_run_the_cluster_config() -> None:
    services = load_compose("compose.yaml")["services"]
    for n in ("nats-1", "nats-2", "nats-3"):
        svc = services[n]
        text = node_config(svc, host_mounts(svc))[1].read_text()
        assert "$NATS_NAME" in text and svc["environment"]["NATS_NAME"] == n
        routes = re.findall(r"nats://(nats-\d):6222", text)
        assert sorted(routes) == ["nats-1", "nats-2", "nats-3"], routes
        assert any(isinstance(v, str) and v.endswith(":/data") for v in svc["volumes"]), f"{n}: JetStream store (/data) is not on a volume"


def _dockerignore_allows(rel: str) -> bool:
    """Whether .dockerignore lets ``rel`` (a top-level path) into the build context: the last
    pattern that matches it decides, ``!`` lets in."""
    allowed = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        pattern = line.removeprefix("!")
        if pattern == "*" or rel == pattern or rel.startswith(pattern + "/"):
            allowed = line.startswith("!")
    return allowed


@pytest.mark.parametrize("containerfile", sorted(p.name for p in DEPLOY.glob("Containerfile*")
                                                 if not p.name.endswith(".dockerignore")))
def test_containerfile_copies_what_exists_and_installs_known_extras(containerfile: str) -> None:
    text = (DEPLOY / containerfile).read_text()
    copies = [shlex.split(line)[1:-1] for line in text.splitlines() if line.startswith("COPY ")]
    assert copies, f"{containerfile} copies nothing"
    for sources in copies:
        for src in sources:
            assert not src.startswith("--"), f"{containerfile}: COPY {src}: teach this test the flag"
            assert (ROOT / src).exists(), f"{containerfile}: COPY source {src} does not exist"
            assert _dockerignore_allows(src), f"{containerfile}: COPY {src} is excluded by .dockerignore"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for group in re.findall(r"'\.\[([a-z0-9,-]+)\]'", text):
        unknown = set(group.split(",")) - set(extras)
        assert not unknown, f"{containerfile} installs extras {unknown} that pyproject.toml does not define"
    assert re.search(r'^ENTRYPOINT \["rlbus"\]$', text, re.M), f"{containerfile}: the entrypoint is rlbus"
    # Everything that runs the service as root would also write the runs volume as root.
    assert re.search(r"^USER rlbus$", text, re.M), f"{containerfile}: run as the rlbus user"


def test_every_containerfile_is_used() -> None:
    used = {s["build"]["dockerfile"] for f in COMPOSE_FILES for s in load_compose(f)["services"].values() if "build" in s}
    files = {f"deploy/{p.name}" for p in DEPLOY.glob("Containerfile*") if not p.name.endswith(".dockerignore")}
    assert files == used, f"built by no compose file: {files - used}; missing: {used - files}"


def _included(conf: Path) -> list[Path]:
    """The files a nats-server config includes, resolved as the server does: against its folder."""
    return [conf.parent / m for m in re.findall(r'^\s*include\s+"?([^"\s]+)"?\s*$', conf.read_text(), re.M)]


def test_every_rlbus_service_reads_its_roles_credentials() -> None:
    """Each service loads the env file `rlbus auth init --out deploy/auth` writes for its role,
    and nothing in its own environment overrides the identity that file gives."""
    for files in (("compose.yaml",), COMPOSE_FILES):
        for name, svc in rlbus_services(load_compose(*files)).items():
            role = resolve_unit(svc)[0]
            assert svc.get("env_file") == [f"auth/{role}.env"], f"{name} ({role}): env_file {svc.get('env_file')}"
            assert (DEPLOY / svc["env_file"][0]).resolve().parent == AUTH
            clash = {k for k in svc.get("environment", {}) if "NATS_USER" in k or "NATS_PASSWORD" in k}
            assert not clash, f"{name}: environment sets {clash}, which would override its role's env file"
    # The folder is never committed nor sent to an image build.
    assert "deploy/auth/" in (ROOT / ".gitignore").read_text().splitlines()
    assert not _dockerignore_allows("deploy/auth") and not _dockerignore_allows("deploy")


def test_nats_nodes_use_the_generated_users_and_fail_without_them() -> None:
    services = load_compose("compose.yaml")["services"]
    for n in ("nats-1", "nats-2", "nats-3"):
        svc = services[n]
        mounts = host_mounts(svc)
        conf_dir, host_conf = node_config(svc, mounts)
        includes = _included(host_conf)
        assert [p.name for p in includes] == ["auth.conf"], f"{n}: {host_conf.name} includes {includes}"
        in_container = f"{conf_dir}/{includes[0].relative_to(host_conf.parent)}"
        assert mounts.get(in_container) == AUTH / "auth.conf", (
            f"{n}: {in_container} (what {host_conf.name} includes) is not the generated deploy/auth/auth.conf")
        spec = next(v for v in svc["volumes"] if isinstance(v, dict) and v["target"] == in_container)
        # Short syntax would make an empty folder when the file is missing, and the node would fail
        # with a confusing parse error; this way compose itself refuses, naming the path.
        assert spec["bind"]["create_host_path"] is False and spec["read_only"] is True, spec
    # The file it is mounted over is the fail-closed placeholder, so a node started without the
    # mount refuses every client instead of running open.
    placeholder = (DEPLOY / "nats" / "auth.conf").read_text()
    assert '"replace-me"' in placeholder and "authorization" in placeholder


def test_generated_env_files_give_each_compose_service_its_role(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `rlbus auth init` writes, loaded the way compose loads env_file, resolves to the role's
    user for every service with its config (the grants name the config's run)."""
    from rlbus.bus.credentials import PASSWORD_ENV
    from rlbus.services.commands.auth import auth_init_cmd
    from tests.deploy.units import read_env_file

    compose = load_compose("compose.yaml", env={"RLBUS_CONFIG": "run.toml"})
    assert auth_init_cmd(str(tmp_path / "auth"), str(DEPLOY / "configs" / "run.toml")) == 0
    for name, svc in rlbus_services(compose).items():
        for key in [k for k in os.environ if k.startswith("RLBUS_")]:
            monkeypatch.delenv(key)
        env = {**read_env_file(tmp_path / svc["env_file"][0]), **svc.get("environment", {})}
        for key, value in env.items():
            monkeypatch.setenv(key, str(value))
        entry, run_cfg, _ = resolve(svc["command"][1], str(DEPLOY / "configs" / "run.toml"))
        assert run_cfg.nats_user == entry.name and os.environ[PASSWORD_ENV], name
        assert f'"{entry.name}"' in (tmp_path / "auth" / "auth.conf").read_text()
