"""Faults that must cost only the bad thing, never the generator or the tasks beside it.

On the in-memory bus (the harness of ``test_generator_intake``): a task whose pool or environment
is no subject token is dead-lettered where it is decoded (and, should one get past decoding, costs
only itself); a task the model cannot take (prompt + max_new_tokens past its context) is refused
alone before sampling; a backend that raises for one task's input is bisected down to that task,
so its neighbours are published on their first delivery; a verified weight version that does not
fit the model is refused (heartbeat, log, DEAD) while sampling goes on, also for a replica that
joins later and is handed that version first; a version whose file retention deleted is skipped.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from safetensors.torch import save as save_safetensors

from rlbus.bus.subjects import SubjectError, Subjects
from rlbus.schemas import (
    EnvReply,
    EnvReplyBatch,
    EnvResetBatch,
    SamplingParams,
    SchemaError,
    Shard,
    Task,
    WeightManifest,
)
from rlbus.schemas.metric_keys import GeneratorKeys
from rlbus.services.generator import service as generator_service
from rlbus.services.generator.batch import BatchDriver
from rlbus.services.generator.settings import GeneratorSettings
from rlbus.services.generator.torch_backend import TorchBackend
from rlbus.services.policy.errors import WeightMismatchError
from rlbus.services.policy.model_init import init_model
from rlbus.services.runtime.lifecycle import Lifecycle
from tests.unit.test_generator_intake import RUN, FakeBackend, Harness, eventually, settle

torch.set_num_threads(1)

BAD_TOKENS = ["a.b", "a b", "*", ">", "", "x\n", "tab\there", "caf\u00e9", "bell\x07", "x" * 65]


def _task(task_id: str, *, pool: str = "train", env: str = "addition", max_new_tokens: int = 2,
          prompt: str = "1+1=") -> Task:
    return Task(run=RUN, task_id=task_id, pool=pool, env=env, prompt=prompt, answer="2", group_size=2,
                sampling=SamplingParams(max_new_tokens=max_new_tokens))


def _wire_with(task: Task, **fields: Any) -> bytes:
    """``task`` encoded with some fields replaced on the wire, past every check of the encoder."""
    wire = task._to_wire()
    wire.update(fields)
    return msgpack.packb(wire, use_bin_type=True)


async def _publish(h: Harness, data: bytes, msg_id: str, pool: str = "train") -> None:
    await h.bus.publish(h.s.tasks(pool), data, msg_id=msg_id)


# ---------------------------------------------------------------------------------------------
# 1. pool / env names that are no subject token


@pytest.mark.parametrize("field", ["pool", "env"])
@pytest.mark.parametrize("value", BAD_TOKENS)
def test_a_task_whose_pool_or_env_is_no_subject_token_does_not_decode(field: str, value: str) -> None:
    with pytest.raises(SchemaError) as err:
        Task.decode(_wire_with(_task("t"), **{field: value}))
    assert err.value.field == field and "letters, digits, '_' or '-'" in str(err.value), str(err.value)
    assert Task.decode(_task("t").encode()).pool == "train"


def test_a_subject_token_with_a_trailing_newline_is_refused() -> None:
    # re.match with '$' accepts "x\n": the bus's own check must not.
    with pytest.raises(SubjectError):
        Subjects("run").rollouts("x\n")


async def test_tasks_with_bad_pool_or_env_are_dead_lettered_and_the_generator_goes_on(tmp_path: Path) -> None:
    async with Harness(tmp_path) as h:
        bad = [(f"bad-{field}-{i}", field, v) for i, v in enumerate(BAD_TOKENS) for field in ("pool", "env")]
        for task_id, field, value in bad:
            await _publish(h, _wire_with(_task(task_id), **{field: value}), f"task.{task_id}")
        good = await h.tasks("train", 3)
        await h.admit(len(bad) + 3)
        await eventually(lambda: len(h.groups()) == 3, what="the good tasks published")
        await eventually(lambda: len(h.bus.dead_letters) == len(bad), what="every bad task dead-lettered")
        assert not h.task.done(), "the generator is still running"  # type: ignore[union-attr]
        assert sorted(g.task.task_id for g in h.groups()) == sorted(good)
        for letter in h.bus.dead_letters:
            assert letter.reason == "schema_error", letter
            assert "letters, digits, '_' or '-'" in letter.error and ("'pool'" in letter.error or "'env'" in letter.error)
        assert h.waiting("train") == 0


async def test_a_bad_pool_that_got_past_decoding_costs_only_its_task(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Any other way in (an older decoder, a producer in-process): the generator must not die on it.
    monkeypatch.setattr(Task, "validate", lambda self: None)
    async with Harness(tmp_path) as h:
        await _publish(h, _task("sneaky", pool="a.b").encode(), "task.sneaky")
        await h.tasks("train", 2)
        await h.admit(3)
        await eventually(lambda: len(h.groups()) == 2, what="the good tasks published")
        await eventually(lambda: len(h.bus.dead_letters) == 1, what="the bad task dead-lettered")
        [letter] = h.bus.dead_letters
        assert "'sneaky' cannot be addressed" in letter.reason and "'a.b'" in letter.reason
        await settle(0.3)
        assert not h.task.done(), "the generator is still running"  # type: ignore[union-attr]
        await h.tasks("train", 1, prefix="later")
        await h.admit(4)
        await eventually(lambda: len(h.groups()) == 3, what="a later task published")


# ---------------------------------------------------------------------------------------------
# 2. a task the model cannot take, and a backend that raises for one task


class LimitedBackend(FakeBackend):
    """A fake with the model's limits; like the torch sampler, it fails a whole call that holds a
    prompt it cannot take (``poison_id`` stands for any other input the backend raises on)."""

    max_context = 8
    vocab_size = 100

    def __init__(self, poison_id: int | None = None) -> None:
        super().__init__()
        self.poison_id = poison_id
        self.failed_calls = 0

    def sample(self, prompts: list[list[int]], n: int, sampling: Any, stop_ids: list[int], seed: int) -> list[list[Any]]:
        if any(len(p) + sampling.max_new_tokens > self.max_context for p in prompts) or \
                any(self.poison_id in p for p in prompts):
            self.failed_calls += 1
            raise RuntimeError(f"cannot sample a prompt of this call (ids {prompts})")
        return super().sample(prompts, n, sampling, stop_ids, seed)


async def _serve_env(h: Harness) -> None:
    """Prompt ids [1, 2, 3], or [9, 9, 9] for a prompt that starts with 'boom'."""
    async def reset_batch(data: bytes) -> bytes:
        tasks = EnvResetBatch.decode(data).tasks
        return EnvReplyBatch(replies=[EnvReply(episode_id=t.task_id, observation_ids=np.array(
            [9, 9, 9] if t.prompt.startswith("boom") else [1, 2, 3], dtype="<i4")) for t in tasks]).encode()

    await h.bus.serve(h.s.env_any("reset_batch"), reset_batch, queue="environment")


async def test_a_task_past_the_models_context_is_refused_alone_before_sampling(tmp_path: Path) -> None:
    backend = LimitedBackend()
    async with Harness(tmp_path, backend=backend) as h:
        await h.tasks("train", 3, prefix="before")
        long = _task("too-long", max_new_tokens=6)  # 3 prompt tokens + 6 > 8
        await _publish(h, long.encode(), long.msg_id)
        await h.tasks("train", 3, prefix="after")
        await h.admit(7)
        await eventually(lambda: len(h.groups()) == 6, what="the 6 good tasks published")
        await eventually(lambda: len(h.bus.dead_letters) == 1, what="the long task dead-lettered")
        [letter] = h.bus.dead_letters
        assert letter.reason == ("task 'too-long': prompt of 3 tokens + max_new_tokens 6 = 9 exceeds the model's "
                                 "context of 8 tokens: shorten the prompt or lower sampling.max_new_tokens")
        assert letter.deliveries == 1 and Task.decode(letter.data).task_id == "too-long"
        assert backend.failed_calls == 0 and backend.calls == [6], "refused before sampling, in one batch"
        await eventually(lambda: h.metric(GeneratorKeys.GROUPS_STARTED) == 6, what="its grant given back")
        assert h.metric("generator/tasks_redelivered") == 0 and h.waiting("train") == 0


async def test_a_backend_error_for_one_task_costs_its_neighbours_no_delivery(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BatchDriver, "SAMPLING_RETRY_S", 0.05)
    backend = LimitedBackend(poison_id=9)
    async with Harness(tmp_path, backend=backend, env=False) as h:
        await _serve_env(h)
        await h.tasks("train", 5, prefix="a")
        await h.tasks("train", 1, prefix="boom", prompt="boom")
        await h.tasks("train", 6, prefix="b")
        await h.admit(12)
        await eventually(lambda: len(h.groups()) == 11, what="the 11 good tasks published")
        await eventually(lambda: len(h.bus.dead_letters) == 1, timeout=20.0, what="the bad task dead-lettered")
        [letter] = h.bus.dead_letters
        assert letter.reason.startswith("task 'boom-0' failed sampling on delivery 5 of 5"), letter.reason
        assert "cannot sample a prompt" in letter.reason
        assert sorted(g.task.task_id for g in h.groups()) == sorted([f"a-{i}" for i in range(5)] +
                                                                    [f"b-{i}" for i in range(6)])
        # Only the bad task came back: its four redeliveries, none of its neighbours'.
        await eventually(lambda: h.metric("generator/tasks_redelivered") == 4, what="the redelivery count")
        await settle(0.3)
        assert h.metric("generator/tasks_redelivered") == 4 and h.waiting("train") == 0
        assert h.metric(GeneratorKeys.GROUPS_STARTED) == 11, "the bad task's grant was given back each time"


# ---------------------------------------------------------------------------------------------
# 3. weight versions that do not fit, and versions retention deleted


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("policy") / "tiny"
    init_model(out, seed=0, max_warm_steps=2, log=lambda _: None)
    return out


def _state(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {k: v.clone().contiguous() for k, v in backend.slot.model.state_dict().items()}


def _misfits(backend: TorchBackend) -> dict[str, tuple[bytes, str]]:
    """Payloads that verify (their sha256 is right) but do not fit the model, with what names the misfit."""
    good = _state(backend)
    name = sorted(good)[1]
    shape = {**good, name: torch.zeros(3, 3)}
    renamed = {("renamed." + k if k == name else k): v for k, v in good.items()}
    ints = {**good, name: torch.zeros(good[name].shape, dtype=torch.int64)}
    nan = {**good, name: torch.full_like(good[name], float("nan"))}
    return {"shape": (save_safetensors(shape), name), "names": (save_safetensors(renamed), "renamed."),
            "dtype": (save_safetensors(ints), "int64"), "nan": (save_safetensors(nan), "NaN"),
            "garbage": (b"\x08\x00\x00\x00\x00\x00\x00\x00not safetensors", "not safetensors")}


def test_the_torch_backend_refuses_a_version_that_does_not_fit_before_staging(model_dir: Path) -> None:
    backend = TorchBackend(str(model_dir))
    before = _state(backend)
    for kind, (payload, named) in _misfits(backend).items():
        with pytest.raises(WeightMismatchError, match=named):
            backend.stage(1, payload)
        assert not backend.apply_staged() and backend.version == 0, kind
    assert all(torch.equal(before[k], v) for k, v in backend.slot.model.state_dict().items())
    backend.stage(2, save_safetensors({k: v + 0.01 for k, v in before.items()}))  # one that fits
    assert backend.apply_staged() and backend.version == 2
    # The model's limits, for refusing a task before sampling.
    assert backend.max_context == backend.slot.model.config.max_position_embeddings
    assert backend.vocab_size == backend.slot.model.config.vocab_size


async def _announce(h: Harness, version: int, data: bytes, *, transport: str = "objstore",
                    location: str | None = None) -> None:
    location = location or f"weights/v{version}/model.safetensors"
    if transport == "objstore":
        await h.bus.objects.put(location, data)
    manifest = WeightManifest(model="policy", version=version, transport=transport,  # type: ignore[arg-type]
                              shards=[Shard(name="model.safetensors", sha256=hashlib.sha256(data).hexdigest(),
                                            size=len(data), location=location)])
    await h.bus.publish(h.s.weights("policy"), manifest.encode(), msg_id=f"weights.{version}")


async def test_a_version_that_does_not_fit_is_refused_and_sampling_goes_on_also_after_a_restart(
        tmp_path: Path, model_dir: Path) -> None:
    backend = TorchBackend(str(model_dir))
    payload, tensor = _misfits(backend)["shape"]
    async with Harness(tmp_path, backend=backend) as h:  # type: ignore[arg-type]
        await _announce(h, 1, payload)
        await eventually(lambda: h.metric("generator/weights_refused") == 1, what="v1 refused on the heartbeat")
        assert h.metric("generator/weights_refused_version") == 1
        why = h.info()["weights_refused"]
        assert why.startswith("v1: WeightMismatchError") and tensor in why, why
        [letter] = h.bus.dead_letters
        assert letter.reason == "weights_refused" and tensor in letter.error
        await h.tasks("train", 2)
        await h.admit(2)
        await eventually(lambda: len(h.groups()) == 2, what="sampling on the live weights")
        assert h.heartbeat().version == 0 and not h.task.done()  # type: ignore[union-attr]
        assert {int(v) for g in h.groups() for r in g.rollouts for v in r.version_spans[:, 1]} == {0}

        # A replica that (re)joins is handed that version first (the newest manifest): it refuses
        # it too and serves, instead of crash-looping.
        h.life.shutdown()
        await asyncio.wait_for(h.task, 10)  # type: ignore[arg-type]
        life = Lifecycle(grace=1.0)
        cfg = GeneratorSettings(instance="gen-1", admission=False, min_batch_groups=1, batch_wait_s=0.0)
        replica = asyncio.create_task(generator_service.run(h.run_cfg, cfg, bus=h.bus, life=life,
                                                            backend=TorchBackend(str(model_dir))))
        try:
            await h.tasks("train", 2, prefix="after-restart")
            await eventually(lambda: len(h.groups()) == 4, timeout=20.0, what="the replica sampling")
            await settle(0.3)
            assert not replica.done() and len(h.bus.dead_letters) == 1, "refused again, dead-lettered once"
        finally:
            life.shutdown()
            await asyncio.wait_for(replica, 10)


async def test_a_version_whose_file_retention_deleted_is_skipped_for_the_next(tmp_path: Path) -> None:
    async with Harness(tmp_path) as h:
        gone = tmp_path / "weights" / "v1" / "model.safetensors"
        kept = tmp_path / "weights" / "v2" / "model.safetensors"
        kept.parent.mkdir(parents=True)
        kept.write_bytes(b"v2 weights")
        await _announce(h, 1, b"v1 weights", transport="file", location=str(gone))  # deleted before it was read
        await _announce(h, 2, b"v2 weights", transport="file", location=str(kept))
        await eventually(lambda: h.heartbeat().version == 2, what="v2 live")  # type: ignore[union-attr]
        assert h.backend.staged == [(2, b"v2 weights")] and h.metric("generator/weights_skipped") == 1
        assert h.bus.dead_letters == [] and not h.task.done()  # type: ignore[union-attr]


async def test_a_manifest_naming_a_file_outside_the_run_is_refused(tmp_path: Path) -> None:
    run_dir, outside = tmp_path / "run", tmp_path / "elsewhere.safetensors"
    run_dir.mkdir()
    outside.write_bytes(b"someone else's file")
    async with Harness(run_dir) as h:
        await _announce(h, 1, b"someone else's file", transport="file", location=str(outside))
        await eventually(lambda: len(h.bus.dead_letters) == 1, what="the version refused")
        assert "outside" in h.bus.dead_letters[0].error and h.backend.staged == []
        assert h.heartbeat().version == 0 and outside.exists()  # type: ignore[union-attr]
