"""New policy versions, from WEIGHTS to the backend, and the versions held-out rounds are pinned to;
with [generator.speculative] drafter = "model", a second follower does the same for the draft model
(``<model>-draft``, the speculator's versions), staged with ``backend.stage_draft``.

A version is read through the transport its manifest names (the trainer and weight-broadcast
agree on it), so generators need no setting of their own that could disagree.  Every read is
digest-verified (``rlbus.services.runtime.weights``); a version that does not verify is never swapped in,
nor one that verifies but does not fit the model (names, shapes, dtypes, non-finite values: the
backend checks before staging).  Either is refused (logged, shown on the heartbeat, dead-lettered)
and sampling goes on with the live weights.  A version whose bytes retention deleted before this
generator read them is skipped: the newer versions' manifests follow.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlbus.bus.protocol import Bus, BusError, Delivery, ObjectNotFound
from rlbus.observability.logging import get_logger
from rlbus.schemas import SchemaError, Task, WeightManifest
from rlbus.schemas.metric_keys import DraftKeys
from rlbus.services.generator.backend import Backend, PinnedSampling
from rlbus.services.generator.core import Generator, Pins
from rlbus.services.generator.status import Status
from rlbus.services.runtime.weights import WeightIntegrityError, WeightTransport, make_transport

log = get_logger()


@dataclass(frozen=True)
class Followed:
    """Which model of the backend a follower keeps current: its version now and how a new one is
    staged.  The policy's is the backend itself; the draft's (drafter "model") the speculative
    tail's draft slot."""

    what: str  # "policy" | "draft": logs, and whose refusals the heartbeat counts where
    version: Callable[[], int]
    stage: Callable[[int, bytes | memoryview], None]


def followed_policy(backend: Backend) -> Followed:
    return Followed("policy", lambda: backend.version, backend.stage)


def followed_draft(backend: Any) -> Followed:
    """The draft of a torch backend built with drafter = "model" (``draft_version``, ``stage_draft``)."""
    return Followed("draft", lambda: int(backend.draft_version), backend.stage_draft)


class WeightFollower:
    """Stages each newer version in the background for the backend to swap in between decode steps;
    keeps the recent manifests so a held-out round can be read at the version it was scheduled at;
    dead-letters a version it refuses (unreadable manifest, bytes that do not match their digest)."""

    KEEP_MANIFESTS = 32  # recent versions a held-out round may still be pinned to
    PIN_WAIT_S = 5.0  # how long a round scheduled at a version not seen yet waits for its manifest

    def __init__(self, bus: Bus, subject: str, gen: Generator, status: Status, *, run_dir: str,
                 followed: Followed | None = None) -> None:
        self.bus = bus
        self.subject = subject
        self.gen = gen
        self.backend = gen.backend
        self.followed = followed or followed_policy(gen.backend)
        self.status = status
        self.run_dir = run_dir
        self.manifests: dict[int, WeightManifest] = {}
        self.transports: dict[str, WeightTransport] = {}
        self.refused: set[int] = set()  # versions that did not fit: a held-out round never pins to them

    async def follow(self) -> None:
        async for d in self.bus.watch(self.subject, deliver="last_per_subject"):
            await self.on_manifest(d)

    async def on_manifest(self, d: Delivery[bytes]) -> None:
        """Stage the version ``d`` announces, or refuse it; never raises for what the version holds,
        since the newest manifest is replayed to every generator that (re)joins: a version that
        raised here would kill each of them, again on every restart."""
        try:
            manifest = WeightManifest.decode(d.msg)
        except SchemaError as exc:
            await self._refuse(d, None, exc)
            return
        self._remember(manifest)
        if manifest.version <= self.followed.version():
            return
        t0 = time.perf_counter()
        try:
            data = await self._transport(manifest.transport).read(manifest.shards[0])
        except (FileNotFoundError, ObjectNotFound) as exc:
            self._skip(manifest, exc)
            return
        except Exception as exc:  # noqa: BLE001 - unreadable or forged bytes: refused, never fatal
            await self._refuse(d, manifest.version, exc)
            return
        try:
            # The backend checks names, shapes, dtypes and values against the live model before
            # anything is swapped: a version that does not fit raises here and sampling goes on.
            await asyncio.to_thread(self.followed.stage, manifest.version, data)
        except Exception as exc:  # noqa: BLE001 - a version that does not fit: refused, never fatal
            await self._refuse(d, manifest.version, exc)
            return
        fetch_s = time.perf_counter() - t0
        self.status.set_metric("generator/weight_fetch_s" if self.followed.what == "policy"
                               else "generator/draft_fetch_s", fetch_s)
        log.info("weights_staged", model=self.followed.what, version=manifest.version, fetch_s=round(fetch_s, 4))
        if self.followed.what == "policy":
            # Swapped in now (between the engine's runs, or between batches, under the model lock), not
            # at the next decode step: the controller holds a version's freed admission window until this
            # generator reports its weights, so one waiting for a fuller grant would otherwise wait on itself.
            await asyncio.to_thread(self.gen.apply_staged)
        self.status.changed()  # the heartbeat shows the new version at once; a freshness floor may have opened

    async def _refuse(self, d: Delivery[bytes], version: int | None, exc: BaseException) -> None:
        """Keep sampling on the live weights; say which version was refused and why (log, heartbeat,
        DEAD)."""
        error = f"{type(exc).__name__}: {exc}"
        if version is None:
            self.gen.dead += 1
        else:
            self.refused.add(version)
            if self.followed.what == "policy":  # a draft's refusals are counted in ``metrics``
                self.gen.note_weights_refused(version, error)
        log.error("weights_refused", model=self.followed.what, version=version, live_version=self.followed.version(),
                  error=error, hint="sampling goes on with the live weights; publish a version saved from this model")
        self.status.changed()
        try:
            await self.bus.dead_letter(d.subject, d.msg, reason="weights_refused", error=error)
        except BusError as bus_exc:
            log.warning("dead_letter_failed", subject=d.subject, error=str(bus_exc))

    def _skip(self, manifest: WeightManifest, exc: BaseException) -> None:
        """A lagging generator found the version's bytes deleted by retention: newer versions exist
        (retention keeps the newest) and their manifests follow on the watch, so go on to them."""
        self.gen.weights_skipped += 1
        log.warning("weights_gone", version=manifest.version, error=f"{type(exc).__name__}: {exc}",
                    hint="retention deleted it before this generator read it; the newer versions follow")
        self.status.changed()

    def metrics(self) -> dict[str, float]:
        """The draft follower's heartbeat keys: the draft version in use and how far the policy has
        moved since the samples it was distilled on.  The folder's draft (version 0) was built from
        the initial policy, version 0; a version whose manifest this generator never saw reports no lag."""
        if self.followed.what != "draft":
            return {}
        version = self.followed.version()
        manifest = self.manifests.get(version)
        distilled_on = manifest.policy_version if manifest is not None else (0 if version == 0 else -1)
        out = {DraftKeys.VERSION: float(version), "generator/draft_refused": float(len(self.refused))}
        if distilled_on >= 0:
            out[DraftKeys.VERSION_LAG] = float(max(self.backend.version - distilled_on, 0))
        return out

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
            if v in self.refused:
                log.warning("eval_unpinned", version=v, error="this version was refused: it does not fit the model",
                            hint="the round runs on the live weights")
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
