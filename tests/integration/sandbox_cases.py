"""Escape attempts of a sandboxed program, shared by the sandbox's own tests
(``test_sandbox.py``) and the environment service's (``test_episodes_bus.py``, the same programs
sent as a policy's ``python`` tool calls).  Each program prints what it managed; the tests check
that it managed nothing that reaches the host."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
MEMORY_BOMB = "blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))"
CPU_LOOP = "while True:\n    pass"
HUGE_OUTPUT = "import os\nwhile True:\n    os.write(1, b'x' * 65536)\n    os.write(2, b'y' * 65536)"
KILL_PARENT = ("import os, signal\nfor pid in (os.getppid(), -1, 1):\n"
               "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\nprint('still here')")
HIDDEN_SECRET = "expected-7f3a"


def connect_code(port: int) -> str:
    """Connect to a host listener on loopback and to the internet; prints 'connected' or 'refused' per try."""
    return (f"import socket\nfor addr in [('127.0.0.1', {port}), ('1.1.1.1', 80)]:\n"
            "    try:\n        socket.create_connection(addr, timeout=2); print('connected', addr)\n"
            "    except OSError as e:\n        print('refused', e.errno)\n")


def write_code(paths: list[str]) -> str:
    """Try to write each path; prints 'wrote <path>' or 'denied <path>'."""
    return (f"import os\nfor p in {paths!r}:\n"
            "    try:\n        open(p, 'w').write('x'); print('wrote', p)\n"
            "    except OSError as e:\n        print('denied', p, e.errno)\n")


def exists_code(paths: list[str]) -> str:
    """Prints '<path> True|False' for each path."""
    return f"import os\nfor p in {paths!r}:\n    print(p, os.path.exists(p))\n"


def outside_paths(tmp_path: Path) -> tuple[list[str], list[Path]]:
    """Paths outside the work dir to write to, and the host files none of them may create (only the
    sandbox's private /tmp, a tmpfs gone with the run, accepts a write)."""
    target = tmp_path / "escaped"
    paths = ["/usr/escaped", "/escaped", str(target), "/tmp/escaped", str(ROOT / "escaped")]
    return paths, [target, ROOT / "escaped", Path("/tmp/escaped")]


def secret_paths(tmp_path: Path, sandbox_root: Path) -> list[str]:
    """A hidden-tests file on the host, the repository, /etc and the sandbox's own run dirs."""
    hidden = tmp_path / "hidden_tests.json"
    hidden.write_text(f'{{"secret": "{HIDDEN_SECRET}"}}')
    return [str(hidden), str(ROOT / "README.md"), "/etc/shadow", "/etc/passwd", "/root", str(sandbox_root)]


@contextmanager
def host_listener() -> Iterator[int]:
    """A real listener on the host's loopback; on exit, asserts nothing connected to it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    try:
        yield server.getsockname()[1]
        try:
            server.accept()
        except BlockingIOError:
            return
        raise AssertionError("a sandboxed program connected to a listener on the host")
    finally:
        server.close()
