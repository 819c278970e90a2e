"""Episodes over a real nats-server: two environment replicas in one queue group, each episode's
later turns routed to the replica holding it; unknown and expired episodes refused with an error
that says so; and the ``python`` tool's sandbox containing every escape attempt while the
environment service keeps answering."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from rlbus.bus.jetstream import JetStreamBus
from rlbus.bus.protocol import RequestFailed
from rlbus.bus.subjects import Subjects
from rlbus.schemas import EnvReply, EnvStep, EpisodeLimits, Task
from rlbus.services.environment import service as env_service
from rlbus.services.environment.settings import EnvironmentSettings
from rlbus.services.runtime.config import RunSettings
from rlbus.services.runtime.lifecycle import Lifecycle
from rlbus.services.sandbox import SandboxLimits, SandboxSettings, probe
from tests.conftest import BUS_TEST_OPTIONS
from tests.integration.sandbox_cases import (
    CPU_LOOP,
    FORK_BOMB,
    HIDDEN_SECRET,
    HUGE_OUTPUT,
    KILL_PARENT,
    MEMORY_BOMB,
    connect_code,
    exists_code,
    host_listener,
    outside_paths,
    secret_paths,
    write_code,
)

pytestmark = pytest.mark.integration
ISO = probe()
needs_sandbox = pytest.mark.skipif(not (ISO.bwrap and ISO.separate_uid),
                                   reason="needs bubblewrap and root (apt-get install bubblewrap; run as root)")
SMALL = SandboxLimits(wall_s=4, cpu_s=1, memory_mb=256, processes=16, file_size_mb=1, output_bytes=4096)
# Apart from test_sandbox.py's and test_reward_integrity.py's uids, one range per test worker.
UID_BASE = 61500 + 32 * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A policy folder as far as the environment is concerned: the character tokenizer."""
    from rlbus.services.policy.tokenizer import build_char_tokenizer

    folder = tmp_path_factory.mktemp("policy")
    build_char_tokenizer().save_pretrained(folder)
    return folder


@asynccontextmanager
async def replica(nats_server: Any, run: str, model_dir: Any, run_dir: Any, instance: str,
                  **settings: Any) -> AsyncIterator[None]:
    """One environment service on its own connection, answering its own step subject when this yields."""
    bus = await JetStreamBus.connect(nats_server.url, run, name=instance, **BUS_TEST_OPTIONS)
    life = Lifecycle(grace=2.0)
    cfg = EnvironmentSettings(instance=instance, **settings)
    service = asyncio.create_task(env_service.run(RunSettings(run=run, model_path=str(model_dir), run_dir=str(run_dir)),
                                                  cfg, bus=bus, life=life))
    try:
        deadline = time.monotonic() + 20
        while True:  # its own step subject is subscribed last: once it answers, every subject is served
            try:
                probe_reply = await request(bus, Subjects(run).env_step("calculator", instance), step(2, "1", "probe"))
                assert "not open on this replica" in probe_reply.error
                break
            except RequestFailed:
                assert not service.done(), service
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        yield
    finally:
        life.shutdown()
        await asyncio.wait_for(service, 15)
        await bus.close()


def task(env: str = "calculator", **kw: Any) -> Task:
    base = dict(run="t", task_id="calc-1", pool="train", env=env, prompt="123+456+789+101=", answer="1469")
    base.update(kw)
    return Task(**base)


def step(turn: int, text: str, episode: str, env: str = "calculator", **task_kw: Any) -> EnvStep:
    return EnvStep(task=task(env, **task_kw), episode_id=episode, action_text=text, turn=turn)


async def request(bus: Any, subject: str, req: EnvStep, timeout: float = 30.0) -> EnvReply:
    return EnvReply.decode(await bus.request(subject, req.encode(), timeout=timeout))


async def test_each_episode_is_served_by_the_replica_that_holds_it(nats_server, bus, run_name, model_dir, tmp_path):
    s = Subjects(run_name)
    async with replica(nats_server, run_name, model_dir, tmp_path, "env-a"), \
            replica(nats_server, run_name, model_dir, tmp_path, "env-b"):
        holders = {}
        for i in range(16):  # the queue group spreads first turns over both replicas
            first = await request(bus, s.env("calculator", "step"), step(1, "calc(123+456+789+101)", f"ep-{i}"))
            assert (first.error, first.done, first.episodic, first.observation_text) == ("", False, True, "=1469 ")
            holders[f"ep-{i}"] = first.replica
        assert set(holders.values()) == {"env-a", "env-b"}, holders
        for episode, holder in holders.items():
            other = "env-b" if holder == "env-a" else "env-a"
            wrong = await request(bus, s.env_step("calculator", other), step(2, "1469", episode))
            assert f"episode {episode!r} is not open on this replica" in wrong.error
            second = await request(bus, s.env_step("calculator", holder), step(2, "1469", episode))
            assert (second.error, second.done, second.finish_reason, second.replica) == ("", True, "done", holder)
        # An ended episode's state is gone: a third turn is refused, not answered from stale state.
        episode, holder = next(iter(holders.items()))
        late = await request(bus, s.env_step("calculator", holder), step(3, "1469", episode))
        assert "not open on this replica" in late.error


async def test_unknown_and_expired_episodes_are_refused_with_the_reason(nats_server, bus, run_name, model_dir,
                                                                          tmp_path):
    s = Subjects(run_name)
    async with replica(nats_server, run_name, model_dir, tmp_path, "env-a", episode_ttl_s=0.3):
        ghost = await request(bus, s.env_step("calculator", "env-a"), step(2, "1469", "ghost"))
        assert "episode 'ghost' is not open on this replica" in ghost.error and "EnvReply.replica" in ghost.error
        via_group = await request(bus, s.env("calculator", "step"), step(2, "1469", "ghost"))
        assert "not open on this replica" in via_group.error
        first = await request(bus, s.env("calculator", "step"), step(1, "calc(1+2)", "idle"))
        assert first.replica == "env-a" and not first.done
        await asyncio.sleep(1.0)  # past the TTL: the sweeper closes it
        expired = await request(bus, s.env_step("calculator", "env-a"), step(2, "3", "idle"))
        assert "episode 'idle' expired" in expired.error and "episode_ttl_s" in expired.error
        malformed = await request(bus, s.env("calculator", "step"), step(1, "calc(2+)", "bad"))
        assert (malformed.done, malformed.failure, malformed.finish_reason) == (True, "policy", "policy_error")


# ---------------------------------------------------------------------------------------
# the python tool's sandbox, through the environment service


@pytest.fixture
async def python_env(nats_server, bus, run_name, model_dir, tmp_path):
    sandbox = SandboxSettings(uid_base=UID_BASE, uid_span=8, max_concurrent=4, limits=SMALL)
    async with replica(nats_server, run_name, model_dir, tmp_path, "env-py", sandbox=sandbox):
        yield PythonTool(bus, Subjects(run_name))


class PythonTool:
    """Sends a policy turn holding one code block to the python environment, as a generator would."""

    def __init__(self, bus: Any, subjects: Subjects) -> None:
        self.bus, self.subjects, self.n = bus, subjects, 0

    async def run(self, code: str) -> EnvReply:
        self.n += 1
        req = step(1, f"let me try\n```python\n{code}\n```\n", f"py-{self.n}", env="python",
                   limits=EpisodeLimits(max_turns=4, max_tool_s=60))
        reply = await request(self.bus, self.subjects.env("python", "step"), req)
        assert reply.error == "" and reply.failure == "" and reply.episodic and not reply.done, reply
        return reply

    async def still_serves(self) -> None:
        """A normal program right after, and the episode's final answer on its replica."""
        reply = await self.run("print(sum(range(10)))")
        assert reply.observation_text == "exit status 0\nstdout:\n45\n\n", reply.observation_text
        end = await request(self.bus, self.subjects.env_step("python", reply.replica),
                            step(2, "the answer is 45", f"py-{self.n}", env="python"))
        assert (end.done, end.finish_reason) == (True, "done")


@needs_sandbox
async def test_python_network_connect_is_refused(python_env):
    with host_listener() as port:
        reply = await python_env.run(connect_code(port))
    assert "connected" not in reply.observation_text and reply.observation_text.count("refused") == 2
    await python_env.still_serves()


@needs_sandbox
async def test_python_fork_bomb_is_contained(python_env):
    reply = await python_env.run(FORK_BOMB)
    assert not reply.observation_text.startswith("exit status 0") and reply.tool_s < SMALL.wall_s + 3
    await python_env.still_serves()


@needs_sandbox
async def test_python_memory_bomb_is_contained(python_env):
    reply = await python_env.run(MEMORY_BOMB)
    assert reply.observation_text.startswith("memory limit hit") and "MemoryError" in reply.observation_text
    await python_env.still_serves()


@needs_sandbox
async def test_python_infinite_loop_is_killed(python_env):
    reply = await python_env.run(CPU_LOOP)
    assert reply.observation_text.split("\n")[0] in ("killed: CPU-time limit", "killed: wall-clock limit")
    await python_env.still_serves()


@needs_sandbox
async def test_python_huge_output_is_cut(python_env):
    reply = await python_env.run(HUGE_OUTPUT)
    assert reply.observation_text.startswith("killed: output limit")
    assert "more characters cut" in reply.observation_text and "output cut by the sandbox" in reply.observation_text
    assert len(reply.observation_text) < 2 * EnvironmentSettings().observation_chars + 500
    await python_env.still_serves()


@needs_sandbox
async def test_python_cannot_write_outside_its_work_dir(python_env, tmp_path):
    paths, host_files = outside_paths(tmp_path)
    reply = await python_env.run(write_code(paths))
    assert "wrote /tmp/escaped" in reply.observation_text and reply.observation_text.count("wrote") == 1
    assert not any(f.exists() for f in host_files)
    await python_env.still_serves()


@needs_sandbox
async def test_python_cannot_read_hidden_tests_or_the_host(python_env, tmp_path):
    run_dirs = Path(tempfile.gettempdir()) / f"rlbus-sandbox-{os.getpid()}"  # the service's Sandbox.root
    paths = secret_paths(tmp_path, run_dirs)
    reply = await python_env.run(exists_code(paths) + f"\nprint(open({paths[0]!r}).read())")
    assert reply.observation_text.count(" False") == len(paths) and HIDDEN_SECRET not in reply.observation_text
    assert "FileNotFoundError" in reply.observation_text
    await python_env.still_serves()


@needs_sandbox
async def test_python_killing_its_parent_leaves_the_service_serving(python_env):
    await python_env.run(KILL_PARENT)
    os.kill(os.getpid(), 0)  # the test process hosting the environment service is alive
    await python_env.still_serves()


@needs_sandbox
async def test_the_service_answers_other_episodes_while_a_program_runs(python_env):
    """A sandbox run is awaited, not run on the event loop: calculator turns are answered meanwhile."""
    slow = asyncio.create_task(python_env.run("import time\ntime.sleep(3)\nprint('woke')"))
    await asyncio.sleep(0.3)
    for i in range(5):
        reply = await request(python_env.bus, python_env.subjects.env("calculator", "step"),
                              step(1, "calc(2*21)", f"quick-{i}"))
        assert reply.observation_text == "=42 "
    assert not slow.done()  # every quick turn was answered while the program still slept
    assert "woke" in (await slow).observation_text
