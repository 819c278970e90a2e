"""weight-broadcast service — verify, version and announce new weights of the policy and of its draft.

consumes:  rl.<run>.uploads.<model>  (WeightManifest state=uploaded)  durable 'broadcast' on UPLOADS
           rl.<run>.uploads.<model>-draft  (the same, the speculator's draft)  durable 'broadcast_draft'
           rl.<run>.metrics.generator.*     (Heartbeat)  which versions generators still use (policy: the
                                            heartbeat's version; draft: DraftKeys.VERSION)
           rl.<run>.control.generator.all.evaluate  (Control ``Evaluate``)  policy versions held-out rounds are pinned to
produces:  rl.<run>.weights.<model>[-draft]  (WeightManifest state=published)  msg id 'weights.<model>.v<N>'
           the newest message on each subject is the ``latest`` pointer late joiners read
           rl.<run>.dead.uploads|control     an upload that fails verification; an evaluate record that does
                                             not decode or holds another decision (with the reason)
waits for: the trainer's uploads (and the speculator's, when one runs)
Each model is a lane of its own (``Lane``: a ``Broadcaster`` and its durable), so the two numberings,
retentions and refusals never mix; only the policy's versions are pinned by held-out rounds.  The
draft has its own durable rather than a second filter on 'broadcast' because JetStream cannot
change an existing durable's filter: a run made before the draft existed keeps working.
A shard whose bytes are missing, unaddressable (a bad object name) or do not match their sha256 is
refused at once: the upload goes to DEAD with the reason and the previous version stays current.
Only a transient error (the server unavailable) naks it for another try.  A restart past an
undecodable newest manifest resumes from the newest readable one.  Versions beyond
``keep_versions`` are deleted once no generator heartbeat reports using them and no recent
held-out round (``keep_eval_versions``) is pinned to them.
Every ``CLAIM_COLLECT_EVERY_S`` it also deletes the claim-checked payloads no message still held
can reference (``rlbus.bus.claims``: a SCORED group dropped by its retention, a release a crash missed),
counted on its heartbeat as ``broadcast/claims_collected``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from rlbus.bus.protocol import (
    BadObjectName,
    Bus,
    BusClosed,
    BusError,
    ConsumerSpec,
    Delivery,
    ObjectNotFound,
    Poison,
    ServerUnavailable,
)
from rlbus.bus.subjects import Subjects, draft_model_name
from rlbus.observability.logging import get_logger
from rlbus.schemas import Control, Evaluate, Heartbeat, SchemaError, Shard, WeightManifest
from rlbus.schemas.metric_keys import DraftKeys
from rlbus.services.broadcast.settings import BroadcastSettings
from rlbus.services.runtime.config import RunSettings
from rlbus.services.runtime.heartbeat import Beat
from rlbus.services.runtime.lifecycle import Lifecycle, run_until_stopped
from rlbus.services.runtime.weights import WeightIntegrityError, WeightTransport, make_transport

log = get_logger()

# At start-up, how long the search for a readable manifest behind an unreadable newest one may take.
RESUME_SCAN_S = 10.0
# Between two passes of the claim collector: claims become collectable only a publish deadline plus
# outage budget (minutes) after their message is dropped, so a pass every few minutes loses nothing.
CLAIM_COLLECT_EVERY_S = 300.0


def refusal(upload: WeightManifest, shard: Shard, exc: BaseException) -> str:
    """The dead letter's reason for a shard that cannot be verified."""
    if isinstance(exc, (FileNotFoundError, ObjectNotFound, KeyError)):
        what = "is missing"
    elif isinstance(exc, BadObjectName):
        what = "is not an object name the store can address"
    else:
        what = "does not verify"
    return (f"upload v{upload.version}: shard {shard.location[:200]!r} {what} ({type(exc).__name__}: {exc}); "
            "the version is refused and the previous one stays current: re-publish it from the trainer")


Role = Literal["policy", "draft"]


class Broadcaster:
    """The versions of one model: which are published, which generators use, which may go.
    ``role`` "draft": a generator's draft version is read from its heartbeat's
    ``DraftKeys.VERSION``, held-out rounds pin nothing, and metrics are under
    ``broadcast/draft/``."""

    def __init__(self, transport: WeightTransport, cfg: BroadcastSettings, *, model: str = "",
                 role: Role = "policy") -> None:
        self.transport = transport
        self.cfg = cfg
        self.model = model  # "" (tests): whatever model the lane's subject carries
        self.role = role
        self.published: dict[int, WeightManifest] = {}
        self.latest = -1
        self.in_use: dict[str, tuple[int, float]] = {}  # generator instance -> (version, seen at)
        self.eval_pins: deque[int] = deque(maxlen=cfg.keep_eval_versions)  # versions of the latest held-out rounds
        self.refused = 0
        self.deleted = 0
        self.verify_seconds = 0.0

    async def accept(self, upload: WeightManifest) -> WeightManifest | None:
        """Verify every shard; return the manifest to publish, or None for a duplicate."""
        if upload.version <= self.latest:
            log.info("weights_duplicate_upload", version=upload.version, latest=self.latest)
            return None
        if upload.transport != self.transport.name:
            raise Poison(f"upload v{upload.version} uses transport {upload.transport!r} but this "
                         f"broadcast serves {self.transport.name!r}; align [broadcast].transport and the trainer")
        t0 = time.perf_counter()
        for shard in upload.shards:
            try:
                await self.transport.read(shard)
            except (ServerUnavailable, BusClosed):
                raise  # transient (or the service is stopping): the upload is naked and read again
            except (WeightIntegrityError, BusError, OSError, KeyError) as exc:
                # Missing, unaddressable or corrupt bytes never get better: refuse the version now
                # (DEAD with the reason) instead of retrying it until max_deliver, which held up
                # the real uploads behind forged ones (max_ack_pending is small).
                self.refused += 1
                raise Poison(refusal(upload, shard, exc)) from None
        self.verify_seconds += time.perf_counter() - t0
        if self.model and upload.model != self.model:
            raise Poison(f"upload v{upload.version} names model {upload.model!r} on the uploads subject of "
                         f"{self.model!r}; publish each model's uploads on subjects.weight_uploads(<its model>)")
        # replace(): every field of the upload travels on (the draft's policy_version too).
        return dataclasses.replace(upload, created_at=time.time(), state="published")

    def mark_published(self, manifest: WeightManifest) -> None:
        self.published[manifest.version] = manifest
        self.latest = max(self.latest, manifest.version)

    def note_generator(self, hb: Heartbeat) -> None:
        if hb.service != "generator":
            return
        version = hb.version if self.role == "policy" else int(hb.metrics.get(DraftKeys.VERSION, -1))
        if version >= 0:
            self.in_use[hb.instance] = (version, time.time() if hb.state != "stopped" else 0.0)

    def note_evaluation(self, ctl: Control) -> None:
        """Pin the version of a held-out round (``Evaluate``); other decisions are not about retention,
        and held-out rounds sample the policy, never the draft."""
        if self.role == "policy" and isinstance(ctl.decision, Evaluate) and self.cfg.keep_eval_versions > 0:
            self.eval_pins.append(ctl.decision.version)

    def deletable(self) -> list[int]:
        now = time.time()
        used = {v for v, seen in self.in_use.values() if now - seen < self.cfg.in_use_ttl} | set(self.eval_pins)
        keep = set(sorted(self.published)[-self.cfg.keep_versions:])
        return [v for v in sorted(self.published) if v not in keep and v not in used]

    async def collect_garbage(self) -> None:
        for version in self.deletable():
            manifest = self.published.pop(version)
            for shard in manifest.shards:
                await self.transport.delete(shard)
            self.deleted += 1
            log.info("weights_deleted", version=version)

    def metrics(self) -> dict[str, float]:
        out = {"broadcast/latest": self.latest, "broadcast/retained": len(self.published),
               "broadcast/refused": self.refused, "broadcast/deleted": self.deleted,
               "broadcast/verify_seconds": self.verify_seconds}
        if self.role == "policy":
            return out
        return {k.replace("broadcast/", "broadcast/draft/", 1): v for k, v in out.items()}


class ClaimSweeper:
    """Runs the bus's claim collector every ``every`` seconds (``Bus.collect_claims``).

    It lives in weight-broadcast because that is the one service of a run that already keeps the
    object bucket (it deletes old weight versions) and holds the grants a collection needs (the
    bucket, and reading every stream's state); the controller has no bucket grant.  The collector
    keeps no state and deletes only what no held message can reference, so a restarted broadcast,
    or a second one, is harmless.  A failed pass is logged and tried again at the next: a claim
    left a while longer costs bytes, never a message."""

    def __init__(self, bus: Bus, *, every: float = CLAIM_COLLECT_EVERY_S, margin: float | None = None) -> None:
        self.bus = bus
        self.every = every
        self.margin = margin  # None: the bus's own (its publish deadline plus outage budget)
        self.collected = 0
        self.orphans = 0
        self.kept = 0
        self.failures = 0

    async def loop(self) -> None:
        while True:
            await self.once()
            await asyncio.sleep(self.every)

    async def once(self) -> None:
        try:
            result = await self.bus.collect_claims(margin=self.margin)
        except BusClosed:
            raise  # the service is stopping
        except BusError as exc:
            self.failures += 1
            log.warning("claim_collection_failed", error=str(exc)[:500],
                        todo=f"tried again in {self.every:.0f}s; until then claims only take space")
            return
        self.collected += result.collected
        self.orphans += result.orphans
        self.kept = result.kept

    def metrics(self) -> dict[str, float]:
        return {"broadcast/claims_collected": self.collected, "broadcast/claims_kept": self.kept,
                "broadcast/orphan_chunks_collected": self.orphans,
                "broadcast/claim_collection_failures": self.failures}


@dataclass
class Lane:
    """One model's uploads in and manifests out: its ``Broadcaster`` and its uploads durable."""

    model: str
    b: Broadcaster
    uploads: ConsumerSpec


class BroadcastService:
    """The I/O around the ``Broadcaster`` of each model (the policy's and the draft's): uploads in,
    published manifests and a heartbeat out, and the two watches (generator heartbeats, held-out
    rounds) that decide what may be deleted."""

    def __init__(self, run_cfg: RunSettings, cfg: BroadcastSettings, *, bus: Bus, life: Lifecycle,
                 broadcaster: Broadcaster, claims: ClaimSweeper | None = None, draft: Broadcaster | None = None) -> None:
        self.run_cfg = run_cfg
        self.bus = bus
        self.life = life
        self.subjects = Subjects(run_cfg.run)
        self.b = broadcaster
        draft_name = draft_model_name(run_cfg.model_name)
        self.draft = draft if draft is not None else Broadcaster(broadcaster.transport, cfg, model=draft_name,
                                                                 role="draft")
        self.lanes = {self.subjects.weight_uploads(m): Lane(m, b, self._uploads_spec(m, durable))
                      for m, b, durable in ((run_cfg.model_name, self.b, "broadcast"),
                                            (draft_name, self.draft, "broadcast-draft"))}
        self.claims = claims if claims is not None else ClaimSweeper(bus)
        self.beat = Beat(bus, self.subjects, "broadcast", cfg.instance)
        self.beat.extra = lambda: {**self.b.metrics(), **self.draft.metrics(), **self.claims.metrics()}

    def _uploads_spec(self, model: str, durable: str) -> ConsumerSpec:
        return ConsumerSpec(stream="UPLOADS", durable=self.subjects.durable(durable),
                            filter_subjects=(self.subjects.weight_uploads(model),), ack_wait=120, max_deliver=3,
                            max_ack_pending=4)

    @property
    def uploads(self) -> ConsumerSpec:
        """The policy's uploads durable."""
        return self.lanes[self.subjects.weight_uploads(self.run_cfg.model_name)].uploads

    async def resume(self) -> None:
        """Take each model's latest published version as current (a restarted broadcast)."""
        for lane in self.lanes.values():
            await self._resume(lane)

    async def _resume(self, lane: Lane) -> None:
        """An undecodable newest manifest (forged, or written by a newer schema) must not stop the
        service from starting: it is skipped with a warning and the newest readable one before it is
        taken, or none (the version numbering then rests on the uploads still to come)."""
        subject = self.subjects.weights(lane.model)
        latest_raw = await self.bus.last(subject, wait=True)
        if latest_raw is None:
            return
        try:
            latest: WeightManifest | None = WeightManifest.decode(latest_raw)
        except SchemaError as exc:
            log.warning("unreadable_weight_manifest", subject=subject, error=str(exc)[:500],
                        todo="skipped at start-up; looking for the newest readable manifest before it")
            latest = await self._newest_readable(subject, latest_raw)
        if latest is not None:
            lane.b.mark_published(latest)
            log.info("broadcast_resumed", model=lane.model, latest=latest.version)

    async def _newest_readable(self, subject: str, unreadable: bytes) -> WeightManifest | None:
        """The highest-version readable manifest stored on ``subject`` before the unreadable newest
        one (read in order until that one comes by), bounded by ``RESUME_SCAN_S``."""
        best: WeightManifest | None = None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(RESUME_SCAN_S):
                async with contextlib.aclosing(self.bus.watch(subject, deliver="all")) as stored:  # type: ignore[type-var]
                    async for d in stored:
                        if d.msg == unreadable:
                            break
                        with contextlib.suppress(SchemaError):
                            m = WeightManifest.decode(d.msg)
                            if m.state == "published" and (best is None or m.version > best.version):
                                best = m
        log.warning("broadcast_resumed_past_unreadable", latest=best.version if best else None)
        return best

    def workers(self) -> tuple[Callable[[], Awaitable[None]], ...]:
        """Every loop the service runs, for ``run_until_stopped``."""
        return (lambda: self.beat.loop(self.life), self.watch_generators, self.watch_evaluations, self.claims.loop,
                *(self._consumer(lane) for lane in self.lanes.values()))

    def _consumer(self, lane: Lane) -> Callable[[], Awaitable[None]]:
        return lambda: self.bus.consume(lane.uploads, WeightManifest.decode, self.on_upload, batch=1)

    async def on_upload(self, upload: WeightManifest, d: Delivery[WeightManifest]) -> None:
        lane = self.lanes.get(d.subject)
        if lane is None:  # each durable filters on one lane's subject: a bug, not a bad upload
            raise Poison(f"an upload on {d.subject!r}, which no lane of this broadcast serves")
        manifest = await lane.b.accept(upload)
        if manifest is None:
            return
        await self.bus.publish(self.subjects.weights(lane.model), manifest.encode(), msg_id=manifest.msg_id)
        lane.b.mark_published(manifest)
        if lane.b is self.b:  # the heartbeat's version is the policy's
            self.beat.version = manifest.version
        log.info("weights_published", model=lane.model, version=manifest.version, shards=len(manifest.shards))
        await lane.b.collect_garbage()

    async def watch_generators(self) -> None:
        async for d in self.bus.watch(self.subjects.metrics_of("generator"), deliver="new"):
            try:
                hb = Heartbeat.decode(d.msg)
            except SchemaError as exc:
                log.warning("bad_heartbeat", error=str(exc))
                continue
            for lane in self.lanes.values():
                lane.b.note_generator(hb)

    async def watch_evaluations(self) -> None:
        async for d in self.bus.watch(self.subjects.control_action("generator", "all", "evaluate"),
                                      deliver="last_per_subject"):
            try:
                ctl = Control.decode(d.msg)
            except SchemaError as exc:
                await self.bus.dead_letter(d.subject, d.msg, reason="bad_control", error=f"SchemaError: {exc}")
                continue
            if not isinstance(ctl.decision, Evaluate):
                await self.bus.dead_letter(
                    d.subject, d.msg, reason="misplaced_control",
                    error=f"a {type(ctl.decision).__name__} decision on {d.subject!r}, where only Evaluate belongs; "
                          "publish each decision on subjects.control_action(service, instance, control.action)")
                continue
            self.b.note_evaluation(ctl)


async def run(run_cfg: RunSettings, cfg: BroadcastSettings, *, bus: Bus, life: Lifecycle) -> None:
    service = BroadcastService(run_cfg, cfg, bus=bus, life=life,
                               broadcaster=Broadcaster(make_transport(cfg.transport, bus=bus, root=run_cfg.run_dir), cfg,
                                                       model=run_cfg.model_name))
    await service.resume()
    service.beat.state = "running"
    await run_until_stopped(life, *service.workers())
