"""New policy versions, from WEIGHTS to the backend, and the versions held-out rounds are pinned to.

A version is read through the transport its manifest names (the trainer and weight-broadcast
agree on it), so generators need no setting of their own that could disagree.  Every read is
digest-verified (``services.runtime.weights``); a version that does not verify is never swapped in.
"""

from __future__ import annotations

import asyncio
import time

from bus.protocol import Bus, BusError, Delivery
from observability.logging import get_logger
from schemas import SchemaError, Task, WeightManifest
from services.generator.backend import PinnedSampling
from services.generator.core import Generator, Pins
from services.generator.status import Status
from services.runtime.weights import WeightIntegrityError, WeightTransport, make_transport

log = get_logger()


class WeightFollower:
    """Stages each newer version in the background for the backend to swap in between decode steps;
    keeps the recent manifests so a held-out round can be read at the version it was scheduled at;
    dead-letters a version it refuses (unreadable manifest, bytes that do not match their digest)."""

    KEEP_MANIFESTS = 32  # recent versions a held-out round may still be pinned to
    PIN_WAIT_S = 5.0  # how long a round scheduled at a version not seen yet waits for its manifest

    def __init__(self, bus: Bus, subject: str, gen: Generator, status: Status, *, run_dir: str) -> None:
        self.bus = bus
        self.subject = subject
        self.gen = gen
        self.backend = gen.backend
        self.status = status
        self.run_dir = run_dir
        self.manifests: dict[int, WeightManifest] = {}
        self.transports: dict[str, WeightTransport] = {}

    async def follow(self) -> None:
        async for d in self.bus.watch(self.subject, deliver="last_per_subject"):
            await self.on_manifest(d)

    async def on_manifest(self, d: Delivery[bytes]) -> None:
        try:
            manifest = WeightManifest.decode(d.msg)
            self._remember(manifest)
            if manifest.version <= self.backend.version:
                return
            t0 = time.perf_counter()
            data = await self._transport(manifest.transport).read(manifest.shards[0])
            await asyncio.to_thread(self.backend.stage, manifest.version, data)
        except (SchemaError, WeightIntegrityError, BusError, ValueError) as exc:
            self.gen.dead += 1
            log.error("weights_refused", error=str(exc))
            await self.bus.dead_letter(d.subject, d.msg, reason="weights_refused", error=f"{type(exc).__name__}: {exc}")
            return
        fetch_s = time.perf_counter() - t0
        self.status.set_metric("generator/weight_fetch_s", fetch_s)
        log.info("weights_staged", version=manifest.version, fetch_s=round(fetch_s, 4))
        self.status.changed()  # an idle batch loop applies it now; a freshness floor may have opened

    def _remember(self, manifest: WeightManifest) -> None:
        self.manifests[manifest.version] = manifest
        for old in sorted(self.manifests)[:-self.KEEP_MANIFESTS]:
            del self.manifests[old]

    def _transport(self, kind: str) -> WeightTransport:
        if kind not in self.transports:
            self.transports[kind] = make_transport(kind, bus=self.bus, root=self.run_dir)
        return self.transports[kind]

    async def pins_for(self, tasks: list[Task]) -> Pins:
        """The weights of each held-out version in a batch, for the backend's pinned copy.  A round
        scheduled at a version whose manifest has not arrived yet waits for it a little; one that
        can no longer be read (retention deleted it, or the generator joined after it) runs on the
        live weights, whose tokens record their versions, and is counted as unpinned."""
        pinned_now = self.backend.pinned_version if isinstance(self.backend, PinnedSampling) else None
        if pinned_now is None:
            return {}
        pins: Pins = {}
        for v in sorted({v for t in tasks if (v := Generator.eval_version(t)) is not None}):
            if v == pinned_now:
                pins[v] = None
                continue
            try:
                pins[v] = await self._read_version(v)
            except (LookupError, BusError, WeightIntegrityError, OSError) as exc:
                log.warning("eval_unpinned", version=v, error=f"{type(exc).__name__}: {exc}",
                            hint="the round runs on the live weights; raise [broadcast].keep_eval_versions")
        return pins

    async def _read_version(self, version: int) -> bytes | memoryview:
        deadline = time.monotonic() + self.PIN_WAIT_S
        while version not in self.manifests and version > max(self.manifests, default=-1) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        manifest = self.manifests.get(version)
        if manifest is None:
            raise LookupError(f"no manifest of v{version} was seen by this generator")
        return await self._transport(manifest.transport).read(manifest.shards[0])
