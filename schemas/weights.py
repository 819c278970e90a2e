"""Weight versions: what the trainer hands over and what generators swap to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlbus.schemas.base import Message, invalid

Transport = Literal["objstore", "file"]


@dataclass(frozen=True)
class TensorMeta(Message):
    KIND = "tensor"
    name: str
    dtype: str
    shape: list[int]


@dataclass(frozen=True)
class Shard(Message):
    """One safetensors file: where it lives and the sha256 a reader must verify."""

    KIND = "shard"
    name: str
    sha256: str
    size: int
    location: str  # object name (objstore) or path (file)

    def validate(self) -> None:
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise invalid(self, "sha256", "must be 64 lowercase hex characters", got=self.sha256[:16])


@dataclass(frozen=True)
class WeightManifest(Message):
    """A complete, verifiable version of a model (the policy, or its draft).  Published by
    weight-broadcast on WEIGHTS (the upload from the trainer or the speculator uses the same message
    with ``state="uploaded"``)."""

    KIND = "weight_manifest"
    model: str
    version: int
    transport: Transport
    shards: list[Shard]
    tensors: list[TensorMeta] = field(default_factory=list)
    trainer_step: int = 0
    created_at: float = 0.0
    state: Literal["uploaded", "published"] = "published"
    # A draft model's version (``<model>-draft``, the speculator's): the newest policy version among
    # the samples it was distilled on, so a generator can show how far its draft lags the policy.
    # -1: not a draft, or not known (a manifest written before this field existed).
    policy_version: int = -1

    def validate(self) -> None:
        if self.version < 0:
            raise invalid(self, "version", "must be >= 0", got=str(self.version))
        if not self.shards:
            raise invalid(self, "shards", "a manifest needs at least one shard")

    @property
    def msg_id(self) -> str:
        """Its ``Nats-Msg-Id`` on WEIGHTS: one upload and one announcement per model version."""
        kind = "upload" if self.state == "uploaded" else "weights"
        return f"{kind}.{self.model}.v{self.version}"
