"""Least privilege on a real nats-server running the config ``rlbus auth init`` generates.

A role x action table: what each service's dataflow needs (publish, declare and pull its
durables, ack, watch, read the last message, object put/get) succeeds with no permission
violation; what it must not do (a generator publishing weight versions or control, reading
SCORED, purging or deleting a stream; a reward service publishing weights; …) is refused by the
server and reported as ``PermissionDenied`` naming the subject — quickly, not after a timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import stat
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from rlbus.bus.credentials import Credentials, CredentialsError
from rlbus.bus.jetstream import JetStreamBus
from rlbus.bus.permissions import PermissionDenied
from rlbus.bus.protocol import BusError, ConsumerSpec, RequestFailed
from rlbus.bus.server import EmbeddedServer
from rlbus.services.commands.auth import ROLES, init
from rlbus.services.runtime.config import RunSettings

pytestmark = pytest.mark.integration

RUN = "authz"
MODEL = "policy"
OPTIONS = dict(error_backoff=(0.1, 0.5), shutdown_grace=2.0, publish_deadline=10.0, connect_timeout=10.0)
_ids = itertools.count()


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("auth")
    run_cfg = RunSettings(run=RUN, model_name=MODEL, pools=["train"], eval_pool="eval")
    init(out / "auth", run_cfg)
    server = EmbeddedServer(out / "nats", include=out / "auth" / "auth.conf")
    server.start()
    try:
        yield server, out / "auth"
    finally:
        server.stop()


async def connect(secured: Any, role: str, *, password_file: Path | None = None) -> JetStreamBus:
    server, secrets = secured
    creds = Credentials.build(user=role, password_file=str(password_file or secrets / f"{role}.password"))
    return await JetStreamBus.connect(server.url, RUN, name=role, credentials=creds, **OPTIONS)


def msg_id() -> str:
    return f"m{os.getpid()}-{next(_ids)}-{time.time_ns()}"


async def publish(bus: JetStreamBus, subject: str) -> None:
    await bus.publish(subject, b"x", msg_id=msg_id())


async def pull_one_and_ack(bus: JetStreamBus, spec: ConsumerSpec) -> None:
    puller = bus.puller(spec, lambda b: b)
    try:
        got = await puller.fetch(1, 5.0)
        assert got, f"nothing to pull from {spec.durable}"
        await got[0].ack()
        await bus.connection.nc.flush()
        deadline = time.monotonic() + 10.0  # the server applies an ack shortly after it arrives
        while (info := await bus.connection.js.consumer_info(bus.subjects.stream(spec.stream), spec.durable)
               ).num_ack_pending and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert info.num_ack_pending == 0, "the ack did not reach the server"
    finally:
        await puller.close()


async def watch_first(bus: JetStreamBus, subject: str) -> None:
    async def first() -> None:
        async for _ in bus.watch(subject, deliver="all"):
            return

    await asyncio.wait_for(first(), 5.0)


async def feed(secured: Any, subject: str) -> None:
    """The operator puts one message where the role under test will read it."""
    op = await connect(secured, "operator")
    try:
        await publish(op, subject)
    finally:
        await op.close()


S = JetStreamBus  # for the annotations below
Action = Callable[[Any, S], Awaitable[None]]


def subjects():
    from rlbus.bus.subjects import Subjects

    return Subjects(RUN)


def spec(kind: str, durable: str, subject: str) -> ConsumerSpec:
    return ConsumerSpec(stream=kind, durable=durable, filter_subjects=(subject,), ack_wait=30)  # type: ignore[arg-type]


async def gen_pulls_task(secured: Any, bus: S) -> None:
    await feed(secured, subjects().tasks("train"))
    await pull_one_and_ack(bus, spec("TASKS", "generator_train", subjects().tasks("train")))


async def reward_pulls_rollout(secured: Any, bus: S) -> None:
    await feed(secured, subjects().rollouts("train"))
    await pull_one_and_ack(bus, spec("ROLLOUTS", "reward", subjects().all_of("rollouts")))


async def trainer_pulls_scored(secured: Any, bus: S) -> None:
    await feed(secured, subjects().scored("train"))
    await pull_one_and_ack(bus, spec("SCORED", "trainer", subjects().scored("train")))


async def broadcast_pulls_upload(secured: Any, bus: S) -> None:
    await feed(secured, subjects().weight_uploads(MODEL))
    await pull_one_and_ack(bus, spec("UPLOADS", "broadcast", subjects().weight_uploads(MODEL)))


def draft() -> str:
    from rlbus.bus.subjects import draft_model_name

    return draft_model_name(MODEL)


async def speculator_pulls_scored(secured: Any, bus: S) -> None:
    await feed(secured, subjects().scored("train"))
    await pull_one_and_ack(bus, spec("SCORED", "speculator", subjects().scored("train")))


async def broadcast_pulls_draft_upload(secured: Any, bus: S) -> None:
    await feed(secured, subjects().weight_uploads(draft()))
    await pull_one_and_ack(bus, spec("UPLOADS", "broadcast_draft", subjects().weight_uploads(draft())))


def follows_advisories(kind: str, durable: str) -> Action:
    """Declare the advisory durable of (``kind``, ``durable``) and pull from it, as
    ``rlbus.bus.advisories`` does for a connection that consumes that durable."""
    async def act(secured: Any, bus: S) -> None:
        from rlbus.bus.streams import ensure_advisory_consumer

        name = await ensure_advisory_consumer(bus.connection.js, subjects(), kind, durable)
        inbox = await bus.connection.pull_inbox(subjects().advisory_stream, name)
        try:
            assert await inbox.fetch(1, 0.5) == []
        finally:
            await inbox.stop()
    act.__name__ = "follows_advisories"
    return act


async def trainer_pulls_uploads(secured: Any, bus: S) -> None:
    await bus.puller(spec("UPLOADS", "broadcast", subjects().weight_uploads(MODEL)), lambda b: b).fetch(1, 1.0)


async def broadcast_collects_claims(secured: Any, bus: S) -> None:
    """What a collector pass needs is granted: stream state, bucket listing and purge.  (Whether
    this claim goes depends on what other rows left in ROLLOUTS, which share the server: the rule
    itself is tested in test_claim_gc.py; here the pass must judge the claim without a refusal.)"""
    name = f"claims/ROLLOUTS/{msg_id()}"
    await bus.objects.put(name, b"leftover")
    await publish(bus, subjects().metrics("broadcast", "0"))  # the server's clock moves past the claim
    swept = await bus.collect_claims(margin=0.0)
    assert swept.collected + swept.kept >= 1
    if name in {o.name for o in await bus.objects.list()}:
        await bus.objects.delete(name)  # and the purge a collection uses is granted


async def objects_round_trip(secured: Any, bus: S) -> None:
    name = f"obj-{msg_id()}"
    await bus.objects.put(name, b"w" * 300_000)
    assert await bus.objects.get(name) == b"w" * 300_000
    await bus.objects.delete(name)


async def answered(bus: S, subject: str, data: bytes) -> bytes:
    """The reply to a request, retried while the server still reports no responders: a
    subscription flushed on another connection was seen to reach the server's interest graph a
    moment after its PONG (both the queue-group and the plain subscription flaked that way)."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            return await bus.request(subject, data, timeout=5.0)
        except RequestFailed as exc:
            if "no responders" not in str(exc) or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def env_request_answered(secured: Any, bus: S) -> None:
    env = await connect(secured, "environment")
    try:
        async def echo(data: bytes) -> bytes:
            return b"ok:" + data

        await env.serve(subjects().env_any("step"), echo, queue="environment")
        await env.connection.nc.flush()
        assert await answered(bus, subjects().env("math", "step"), b"hi") == b"ok:hi"
    finally:
        await env.close()


async def env_replica_step_answered(secured: Any, bus: S) -> None:
    """An episode's later steps go to the replica that holds it: its own subject, no queue group."""
    env = await connect(secured, "environment")
    try:
        async def echo(data: bytes) -> bytes:
            return b"env-1:" + data

        await env.serve(subjects().env_step_of("env-1"), echo, queue="")
        await env.connection.nc.flush()
        assert await answered(bus, subjects().env_step("calculator", "env-1"), b"t2") == b"env-1:t2"
    finally:
        await env.close()


async def gen_watches_weights(secured: Any, bus: S) -> None:
    await feed(secured, subjects().weights(MODEL))
    await watch_first(bus, subjects().weights(MODEL))
    assert await bus.last(subjects().weights(MODEL)) is not None


async def gen_watches_control(secured: Any, bus: S) -> None:
    await feed(secured, subjects().control_action("generator", "all", "pause"))
    await watch_first(bus, subjects().control_actions("generator", "all"))


async def controller_reads_state(secured: Any, bus: S) -> None:
    names = {s.name for s in await bus.streams()}
    assert subjects().stream("SCORED") in names
    await feed(secured, subjects().metrics("trainer", "0"))
    await watch_first(bus, subjects().all_of("metrics"))


async def controller_watches_heldout_scores(secured: Any, bus: S) -> None:
    """How the controller scores a held-out round: an ordered consumer on the eval pool's scored subject."""
    await feed(secured, subjects().scored("eval"))
    await watch_first(bus, subjects().scored("eval"))


async def operator_purges(secured: Any, bus: S) -> None:
    await bus.connection.js.purge_stream(subjects().stream("DEAD"))


def pub(subject_of: Callable[[], str]) -> Action:
    async def act(secured: Any, bus: S) -> None:
        await publish(bus, subject_of())
    act.__name__ = "publish"
    return act


async def gen_reads_scored(secured: Any, bus: S) -> None:
    await bus.puller(spec("SCORED", "trainer", subjects().scored("train")), lambda b: b).fetch(1, 1.0)


async def gen_watches_scored(secured: Any, bus: S) -> None:
    await watch_first(bus, subjects().scored("train"))


async def gen_last_scored(secured: Any, bus: S) -> None:
    await bus.last(subjects().scored("train"))


async def purge_scored(secured: Any, bus: S) -> None:
    await bus.connection.js.purge_stream(subjects().stream("SCORED"))


async def delete_tasks(secured: Any, bus: S) -> None:
    await bus.connection.js.delete_stream(subjects().stream("TASKS"))


async def snoop_trainer_inbox(secured: Any, bus: S) -> None:
    await bus.connection.nc.subscribe("_INBOX.trainer.>")
    await bus.connection.nc.flush()
    await asyncio.sleep(5)  # the denial arrives asynchronously; guard fails as soon as it does


ALLOWED: list[tuple[str, str, Action]] = [
    ("generator", "pull a task and ack it", gen_pulls_task),
    ("generator", "publish a rollout", pub(lambda: subjects().rollouts("train"))),
    ("generator", "publish its heartbeat", pub(lambda: subjects().metrics("generator", "0"))),
    ("generator", "request an environment step", env_request_answered),
    ("generator", "request a step of the replica holding an episode", env_replica_step_answered),
    ("generator", "watch and read the weights", gen_watches_weights),
    ("generator", "watch its control subjects", gen_watches_control),
    ("generator", "put, get and delete an object", objects_round_trip),
    ("reward", "pull a rollout and ack it", reward_pulls_rollout),
    ("reward", "publish a scored group", pub(lambda: subjects().scored("train"))),
    ("trainer", "pull a scored group and ack it", trainer_pulls_scored),
    ("trainer", "publish a weight upload", pub(lambda: subjects().weight_uploads(MODEL))),
    ("trainer", "put, get and delete an object", objects_round_trip),
    ("broadcast", "pull an upload and ack it", broadcast_pulls_upload),
    ("broadcast", "publish a weight version", pub(lambda: subjects().weights(MODEL))),
    ("broadcast", "collect unreachable claims", broadcast_collects_claims),
    ("broadcast", "pull a draft upload and ack it", broadcast_pulls_draft_upload),
    ("broadcast", "publish a draft version", pub(lambda: subjects().weights(draft()))),
    ("speculator", "pull a scored group and ack it", speculator_pulls_scored),
    ("speculator", "publish a draft upload", pub(lambda: subjects().weight_uploads(draft()))),
    ("speculator", "put, get and delete an object", objects_round_trip),
    ("generator", "follow its own durable's advisories", follows_advisories("TASKS", "generator_train")),
    ("broadcast", "follow the uploads' advisories", follows_advisories("UPLOADS", "broadcast")),
    ("controller", "publish a control decision", pub(lambda: subjects().control_action("generator", "all", "pause"))),
    ("controller", "publish an eval task", pub(lambda: subjects().tasks("eval"))),
    ("controller", "read stream state and heartbeats", controller_reads_state),
    ("controller", "watch the held-out pool's scored groups", controller_watches_heldout_scores),
    ("environment", "publish its heartbeat", pub(lambda: subjects().metrics("environment", "0"))),
    ("operator", "publish a task", pub(lambda: subjects().tasks("train"))),
    ("operator", "purge a stream", operator_purges),
]

FORBIDDEN: list[tuple[str, str, Action, str]] = [
    ("generator", "publish a weight version", pub(lambda: subjects().weights(MODEL)), "publish"),
    ("generator", "publish a weight upload", pub(lambda: subjects().weight_uploads(MODEL)), "publish"),
    ("generator", "publish control", pub(lambda: subjects().control_action("generator", "all", "resume")), "publish"),
    ("generator", "publish a scored group", pub(lambda: subjects().scored("train")), "publish"),
    ("generator", "pull SCORED", gen_reads_scored, "publish"),
    ("generator", "watch SCORED", gen_watches_scored, "publish"),
    ("generator", "read the last SCORED message", gen_last_scored, "publish"),
    ("generator", "purge a stream", purge_scored, "publish"),
    ("generator", "delete a stream", delete_tasks, "publish"),
    ("generator", "subscribe to the trainer's inbox", snoop_trainer_inbox, "subscribe"),
    # An advisory names a message of the durable's stream: only the role that may read it follows it.
    ("generator", "follow the trainer's advisories", follows_advisories("SCORED", "trainer"), "publish"),
    ("trainer", "follow weight-broadcast's advisories", follows_advisories("UPLOADS", "broadcast"), "publish"),
    ("trainer", "pull the uploads (weight-broadcast's alone)", trainer_pulls_uploads, "publish"),
    ("reward", "publish a weight version", pub(lambda: subjects().weights(MODEL)), "publish"),
    ("reward", "delete a stream", delete_tasks, "publish"),
    ("trainer", "publish a weight version (only uploads)", pub(lambda: subjects().weights(MODEL)), "publish"),
    ("trainer", "publish a task", pub(lambda: subjects().tasks("train")), "publish"),
    ("environment", "publish a rollout", pub(lambda: subjects().rollouts("train")), "publish"),
    # Serving steps is subscribing: an environment never requests one (of itself or another replica).
    ("environment", "request a replica's step", pub(lambda: subjects().env_step("calculator", "env-1")), "publish"),
    ("reward", "request a replica's step", pub(lambda: subjects().env_step("calculator", "env-1")), "publish"),
    ("environment", "publish control", pub(lambda: subjects().control_action("generator", "all", "pause")), "publish"),
    ("controller", "publish a scored group", pub(lambda: subjects().scored("train")), "publish"),
    ("controller", "publish a training task", pub(lambda: subjects().tasks("train")), "publish"),
    ("broadcast", "publish control", pub(lambda: subjects().control_action("generator", "all", "pause")), "publish"),
    ("broadcast", "purge a stream", purge_scored, "publish"),
    ("speculator", "publish a policy upload", pub(lambda: subjects().weight_uploads(MODEL)), "publish"),
    ("speculator", "publish a draft version (only uploads)", pub(lambda: subjects().weights(draft())), "publish"),
    ("trainer", "publish a draft upload", pub(lambda: subjects().weight_uploads(draft())), "publish"),
]


@pytest.mark.parametrize(("role", "what", "action"), ALLOWED, ids=[f"{r}: {w}" for r, w, _ in ALLOWED])
async def test_a_role_may_do_what_its_dataflow_needs(secured, role, what, action):
    bus = await connect(secured, role)
    try:
        await asyncio.wait_for(bus.connection.startup(action(secured, bus), what), 20.0)
        await bus.connection.nc.flush()
        await asyncio.sleep(0.1)  # a refused ack or flow-control reply is reported asynchronously
        assert bus.connection.denials.seen == [], f"{role} was refused something while it may {what}"
    finally:
        await bus.close()


@pytest.mark.parametrize(("role", "what", "action", "permission"), FORBIDDEN,
                         ids=[f"{r}: {w}" for r, w, _, _ in FORBIDDEN])
async def test_a_role_is_refused_what_its_dataflow_does_not_need(secured, role, what, action, permission):
    bus = await connect(secured, role)
    try:
        t0 = time.monotonic()
        with pytest.raises(PermissionDenied) as err:
            await asyncio.wait_for(bus.connection.startup(action(secured, bus), what), 20.0)
        assert time.monotonic() - t0 < 5.0, "the denial should fail the operation at once, not after a timeout"
        assert err.value.permission == permission
        assert f"user {role!r}" in str(err.value) and err.value.subject in str(err.value)
    finally:
        await bus.close()


def test_the_generated_secrets_are_private_and_cover_every_role(secured):
    _, secrets = secured
    for role in ROLES:
        for suffix in (".password", ".env"):
            mode = stat.S_IMODE((secrets / f"{role}{suffix}").stat().st_mode)
            assert mode == 0o600, f"{role}{suffix} is {oct(mode)}"
    conf = (secrets / "auth.conf").read_text()
    for role in ROLES:
        password = (secrets / f"{role}.password").read_text().strip()
        assert password and password not in conf  # only its bcrypt hash is there
        assert f'user: "{role}"' in conf
    assert '"$2' in conf and "$RLBUS" not in conf


async def test_a_wrong_password_is_refused_at_once_with_the_key_to_check(secured, tmp_path):
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password\n")
    t0 = time.monotonic()
    with pytest.raises(CredentialsError, match=r"authorization violation.*nats_password_file") as err:
        await connect(secured, "trainer", password_file=wrong)
    assert time.monotonic() - t0 < 5.0, "a refused login must not wait out the connect timeout"
    assert "not-the-password" not in str(err.value)


async def test_a_password_in_the_url_works_and_is_never_in_an_error(secured, tmp_path):
    server, secrets = secured
    password = (secrets / "operator.password").read_text().strip()
    host = server.url.removeprefix("nats://")
    bus = await JetStreamBus.connect(f"nats://operator:{password}@{host}", RUN, name="cli",
                                     credentials=Credentials(), **OPTIONS)
    await bus.close()
    with pytest.raises(CredentialsError) as err:
        await JetStreamBus.connect(f"nats://operator:wrong-{password}@{host}", RUN, name="cli",
                                   credentials=Credentials(), **OPTIONS)
    assert "check the user:password in the NATS URL" in str(err.value)
    assert password not in str(err.value) and "***@" in str(err.value)


# --- credentials in the config, and where they may not go ------------------------------------------
def test_a_clear_password_key_is_refused_with_where_to_put_it(tmp_path, monkeypatch):
    from rlbus.services.reward.settings import RewardSettings
    from rlbus.services.runtime.config import ConfigError, load

    cfg = tmp_path / "run.toml"
    cfg.write_text('[run]\nnats_user = "reward"\nnats_password = "hunter2"\n')
    with pytest.raises(ConfigError, match=r"nats_password is not a key.*nats_password_file.*RLBUS_NATS_PASSWORD") as err:
        load(cfg, RewardSettings, "reward")
    assert "hunter2" not in str(err.value)
    monkeypatch.setenv("RLBUS_RUN__NATS_PASSWORD", "hunter2")
    with pytest.raises(ConfigError, match="nats_password is not a key"):
        load(None, RewardSettings, "reward")


def test_the_password_comes_from_its_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("RLBUS_NATS_PASSWORD", raising=False)
    secret = tmp_path / "reward.password"
    secret.write_text("s3cret\n")
    run = RunSettings(nats_user="reward", nats_password_file=str(secret))
    creds = run.bus_options()["credentials"]
    assert creds.connect_options()["password"] == "s3cret" and creds.connect_options()["user"] == "reward"
    assert "s3cret" not in repr(creds) and run.redacted()["nats_password_file"] == "***"
    monkeypatch.setenv("RLBUS_NATS_PASSWORD", "from-env")
    assert RunSettings(nats_user="reward").credentials().password == "from-env"
    with pytest.raises(CredentialsError, match=r"nats_password_file = .*missing.* cannot be read"):
        RunSettings(nats_user="reward", nats_password_file=str(tmp_path / "missing")).credentials()
    with pytest.raises(CredentialsError, match="no user: set \\[run\\] nats_user"):
        RunSettings().credentials()


def test_a_password_in_a_url_is_never_logged_or_put_in_an_error():
    from rlbus.bus.urls import BadServerURL, redact_url, server_urls

    url = "nats://gen:pw123@nats-1:4222,nats://nats-2:4222"
    assert redact_url(url) == "nats://***@nats-1:4222,nats://nats-2:4222"
    assert RunSettings(nats_url=url).redacted()["nats_url"] == redact_url(url)
    with pytest.raises(BadServerURL) as err:
        server_urls("nats://gen:pw123@")
    assert "pw123" not in str(err.value)


# --- TLS -----------------------------------------------------------------------------------------
def _openssl(*args: str, cwd: Path) -> None:
    import subprocess

    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(d: Path) -> None:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate it signed."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=rlbus-test-ca",
             cwd=d)
    for who, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
                     ("client", "extendedKeyUsage=clientAuth")):
        (d / f"{who}.ext").write_text(ext + "\n")
        _openssl("req", *ec, "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN={who}", cwd=d)
        _openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{who}.pem", "-days", "1", "-extfile", f"{who}.ext", cwd=d)


async def test_mutual_tls_with_the_run_keys(tmp_path):
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("the openssl command makes this test's certificates")
    _certificates(tmp_path)
    tls = tmp_path / "tls.conf"
    tls.write_text(f"tls {{ cert_file: {str(tmp_path / 'server.pem')!r}, key_file: {str(tmp_path / 'server.key')!r}, "
                   f"ca_file: {str(tmp_path / 'ca.pem')!r}, verify: true }}\n".replace("'", '"'))
    server = EmbeddedServer(tmp_path / "nats", include=tls)
    server.start()
    try:
        run = RunSettings(run="tlsrun", nats_url=server.url, nats_tls_ca=str(tmp_path / "ca.pem"),
                          nats_tls_cert=str(tmp_path / "client.pem"), nats_tls_key=str(tmp_path / "client.key"))
        bus = await JetStreamBus.connect(server.url, run.run, name="tls", connect_timeout=10.0,
                                         credentials=run.credentials())
        try:
            await publish(bus, bus.subjects.dead("tls"))  # a stored, acknowledged publish over TLS
        finally:
            await bus.close()
        no_client_cert = RunSettings(run="tlsrun", nats_tls_ca=str(tmp_path / "ca.pem"))
        with pytest.raises(BusError, match="cannot connect"):
            await JetStreamBus.connect(server.url, run.run, name="tls", connect_timeout=3.0,
                                       credentials=no_client_cert.credentials())
    finally:
        server.stop()


async def test_cli_tools_log_in_from_the_operator_env_file(secured, monkeypatch):
    """``rlbus publish``/``status``/``streams`` take no run config: they read operator.env's variables."""
    server, secrets = secured
    for line in (secrets / "operator.env").read_text().splitlines():
        key, _, value = line.partition("=")
        monkeypatch.setenv(key, value)
    from rlbus.services.commands.streams import streams

    assert await asyncio.to_thread(streams, RUN, server.url, as_json=True) == 0
    monkeypatch.setenv("RLBUS_NATS_PASSWORD", "wrong")
    with pytest.raises(CredentialsError, match="check \\[run\\] nats_user = 'operator'.*RLBUS_NATS_PASSWORD"):
        await asyncio.to_thread(streams, RUN, server.url, as_json=True)


def test_rlbus_auth_init_prints_no_secret_and_keeps_existing_passwords(tmp_path, capsys):
    from rlbus.services.cli import main

    out = tmp_path / "auth"
    assert main(["auth", "init", "--out", str(out), "--run", "other"]) == 0
    printed = capsys.readouterr().out
    before = {role: (out / f"{role}.password").read_text().strip() for role in ROLES}
    assert not any(pw in printed for pw in before.values())
    assert '"rl.other.rollouts.train"' in (out / "auth.conf").read_text()  # the run's own names
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert main(["auth", "init", "--out", str(out)]) == 2  # would rotate every password
    assert "--force" in capsys.readouterr().err
    assert {role: (out / f"{role}.password").read_text().strip() for role in ROLES} == before
    assert main(["auth", "init", "--out", str(out), "--force"]) == 0
    assert (out / "generator.password").read_text().strip() != before["generator"]
