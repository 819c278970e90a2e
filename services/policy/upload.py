"""Weight hand-over: each new version's weights go to weight-broadcast, one version at a time.

Shared by the two roles that make versions: the trainer (the policy) and the speculator (the
draft model, under ``rlbus.bus.subjects.draft_model_name``).  The weights are snapshotted when a step
ends (the next step changes them), then written through the weight transport and announced on
``rl.<run>.uploads.<model>`` in the background, while the caller already works on its next step.
One upload runs at a time, in version order, so weight-broadcast never sees version N + 1 before
N.  Each version is recorded in the caller's book (``rlbus.services.runtime.files.NumberBook``: the
trainer's ``VersionBook``, the speculator's ``DraftBook``) before its bytes are written, so a
restarted role never reuses its number: a reused number would overwrite the bytes of the version
it first named.
"""

from __future__ import annotations

import asyncio
import time

import torch
from safetensors.torch import save as save_safetensors

from rlbus.bus.protocol import Bus
from rlbus.bus.subjects import Subjects
from rlbus.observability import tracing
from rlbus.schemas import TensorMeta, WeightManifest
from rlbus.schemas.weights import Transport
from rlbus.services.runtime.files import NumberBook
from rlbus.services.runtime.weights import WeightTransport


def weights_bytes(model: torch.nn.Module) -> tuple[bytes, list[TensorMeta]]:
    # Every named parameter is sent explicitly (lm_head too): an engine with tied embeddings
    # would otherwise keep a stale output layer.
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    metas = [TensorMeta(name=k, dtype=str(v.dtype).removeprefix("torch."), shape=list(v.shape)) for k, v in state.items()]
    return save_safetensors(state), metas


class Uploader:
    def __init__(self, bus: Bus, subjects: Subjects, transport: WeightTransport, model: torch.nn.Module, *,
                 model_name: str, transport_kind: Transport, book: NumberBook) -> None:
        self._bus = bus
        self._book = book  # the highest version handed out, durable before a version leaves
        self._subjects = subjects
        self._transport = transport
        self._transport_kind = transport_kind  # what a generator reads the bytes with
        self._model = model
        self._model_name = model_name
        self._in_flight: asyncio.Task[float] | None = None  # the upload of the newest version
        self.last_upload_s = 0.0  # how long the previous version's upload took

    async def hand_over(self, version: int, step: int, *, policy_version: int = -1) -> None:
        """Snapshot the weights as ``version`` now; upload them once the previous version is up.
        ``policy_version``: for a draft, the policy version its samples came from (the manifest's)."""
        data, metas = await asyncio.to_thread(weights_bytes, self._model)
        if self._in_flight is not None:
            self.last_upload_s = await self._in_flight
        self._in_flight = asyncio.create_task(self._upload(version, data, metas, step, policy_version))

    async def finish(self) -> None:
        """Wait for the upload in flight (a graceful stop hands over what it trained)."""
        if self._in_flight is not None:
            await self._in_flight

    async def _upload(self, version: int, data: bytes, metas: list[TensorMeta], step: int, policy_version: int) -> float:
        # A short trace of its own (upload -> broadcast's verification -> manifest), not the step's.
        with tracing.root_span(f"weights upload v{version}", **{tracing.POLICY_VERSION: version, tracing.STEP: step}):
            return await self._traced_upload(version, data, metas, step, policy_version)

    async def _traced_upload(self, version: int, data: bytes, metas: list[TensorMeta], step: int,
                             policy_version: int) -> float:
        t0 = time.perf_counter()
        await asyncio.to_thread(self._book.reserve, version)
        shard = await self._transport.write(f"weights/{self._model_name}/v{version:08d}/model.safetensors", data)
        manifest = WeightManifest(model=self._model_name, version=version, transport=self._transport_kind,
                                  shards=[shard], tensors=metas, trainer_step=step, created_at=time.time(),
                                  state="uploaded", policy_version=policy_version)
        await self._bus.publish(self._subjects.weight_uploads(self._model_name), manifest.encode(),
                                msg_id=manifest.msg_id)
        return time.perf_counter() - t0
