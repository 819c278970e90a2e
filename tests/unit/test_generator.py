"""The generator's sampling rules beyond the sampler itself.

Held-out rounds pinned to one version: the generator samples them on a second copy of the model
that holds exactly the round's version while the live weights move on, and weight-broadcast keeps
the versions of recent rounds readable.  Stop strings: a sample ends at the first one, whatever
the backend returned after it."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save as save_safetensors

from rlbus.schemas import Control, Evaluate, RunState, SamplingParams, Shard, Task, WeightManifest
from rlbus.services.broadcast.service import Broadcaster
from rlbus.services.broadcast.settings import BroadcastSettings
from rlbus.services.generator.backend import cut_at_stop
from rlbus.services.generator.core import Generator
from rlbus.services.generator.settings import GeneratorSettings
from rlbus.services.generator.torch_backend import TorchBackend
from rlbus.services.policy.sampler import SampleOut
from rlbus.services.policy.tokenizer import encode_prompt
from rlbus.services.tasks.addition import make_split

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def _perturbed(backend: TorchBackend, scale: float) -> bytes:
    """Weights visibly different from the backend's: every tensor shifted by noise."""
    gen = torch.Generator().manual_seed(1)
    state = backend.slot.model.state_dict()
    return save_safetensors({k: (v + scale * torch.randn(v.shape, generator=gen)).contiguous() for k, v in state.items()})


@pytest.fixture(scope="module")
def backend(tiny_model: Path) -> TorchBackend:
    return TorchBackend(str(tiny_model), pin_eval=True)


@pytest.fixture(scope="module")
def prompts(backend: TorchBackend) -> list[list[int]]:
    return [encode_prompt(backend.tokenizer, t.prompt) for t in make_split("heldout", 8, seed=5)]


def _ids(groups: list[list[object]]) -> list[list[int]]:
    return [s.completion_ids for g in groups for s in g]  # type: ignore[attr-defined]


@pytest.mark.slow  # the warm-started tiny model: a 90-second build on a fresh checkout
def test_pinned_copy_samples_an_old_version_while_the_live_weights_move_on(backend, prompts) -> None:  # type: ignore[no-untyped-def]
    v0 = _ids(backend.sample(prompts, 1, GREEDY, [], seed=0))
    backend.stage(1, _perturbed(backend, 0.5))
    assert backend.apply_staged() and backend.version == 1
    v1 = _ids(backend.sample(prompts, 1, GREEDY, [], seed=0))
    assert v1 != v0, "the perturbed weights should change some greedy answer"

    # The pinned copy still holds the initial version: no weights needed, same answers as before.
    assert backend.pinned_version == 0
    at0 = backend.sample_at(0, None, prompts, 1, GREEDY, [], seed=0)
    assert _ids(at0) == v0
    assert all(set(s.token_versions.tolist()) == {0} for g in at0 for s in g)
    assert backend.version == 1, "sampling the pinned copy never touches the live weights"

    # Asked for a version it does not hold, it needs that version's weights and says so.
    with pytest.raises(ValueError, match="pass the weights of v1"):
        backend.sample_at(1, None, prompts, 1, GREEDY, [], seed=0)


@pytest.mark.slow  # the warm-started tiny model: a 90-second build on a fresh checkout
def test_generator_samples_each_round_at_its_version_and_counts_the_rest(tiny_model: Path, prompts) -> None:  # type: ignore[no-untyped-def]
    backend = TorchBackend(str(tiny_model), pin_eval=True)
    v2 = _perturbed(backend, 0.3)
    backend.stage(3, _perturbed(backend, 0.6))
    backend.apply_staged()
    gen = Generator(backend, GeneratorSettings(max_batch_groups=16), ["train"])

    def task(i: int, version: int | None) -> Task:
        meta = {"eval_version": version} if version is not None else {}
        return Task(run="r", task_id=f"t{i}", pool="eval", env="addition", prompt="1+1=", group_size=1,
                    sampling=GREEDY, eval=version is not None, metadata=meta)

    batch = [(task(0, 2), prompts[0]), (task(1, 2), prompts[1]), (task(2, 7), prompts[2]),
             (task(3, None), prompts[3])]
    groups = gen.sample(batch, {2: v2})
    versions = [set(r.version_spans[:, 1].tolist()) for g in groups for r in g.rollouts]
    # Round 2 ran on exactly v2; round 7 (no readable weights given) and the training task ran live.
    assert versions == [{2}, {2}, {3}, {3}]
    assert (gen.eval_pinned, gen.eval_unpinned) == (2, 1)
    assert backend.pinned_version == 2 and backend.version == 3
    # Two rounds in one batch: the one the copy holds (no weights passed) runs before the other loads.
    v4 = _perturbed(backend, 0.1)
    groups = gen.sample([(task(4, 4), prompts[4]), (task(5, 2), prompts[5])], {4: v4, 2: None})
    assert [set(r.version_spans[:, 1].tolist()) for g in groups for r in g.rollouts] == [{4}, {2}]


@pytest.mark.slow  # the warm-started tiny model: a 90-second build on a fresh checkout
def test_a_backend_built_without_a_pinned_copy_runs_rounds_live(tiny_model: Path, prompts) -> None:  # type: ignore[no-untyped-def]
    backend = TorchBackend(str(tiny_model))
    assert backend.pinned_version is None
    with pytest.raises(RuntimeError, match="pin_eval=True"):
        backend.sample_at(0, None, prompts, 1, GREEDY, [], seed=0)


def _manifest(v: int) -> WeightManifest:
    return WeightManifest(model="policy", version=v, transport="objstore", state="published",
                          shards=[Shard(name="model.safetensors", sha256="0" * 64, size=1, location=f"w/{v}")])


def test_broadcast_keeps_the_versions_of_recent_held_out_rounds() -> None:
    b = Broadcaster(transport=None, cfg=BroadcastSettings(keep_versions=2, keep_eval_versions=2))  # type: ignore[arg-type]
    for v in range(10):
        b.mark_published(_manifest(v))
    assert b.deletable() == list(range(8))
    for seq, v in enumerate((2, 5, 6)):
        b.note_evaluation(Control(seq=seq, decision=Evaluate(version=v, tasks=10), target_service="generator",
                                  target_instance="all", reason="every 5", issued_at=time.time()))
    # Only the last two rounds hold their versions; other decisions are ignored.
    b.note_evaluation(Control(seq=9, decision=RunState(state="pause"), target_service="generator",
                              target_instance="all", reason="", issued_at=time.time()))
    assert b.deletable() == [0, 1, 2, 3, 4, 7]


def _chars(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def _sample(text: str, finish: str = "length") -> SampleOut:
    ids = [ord(c) for c in text]
    return SampleOut(completion_ids=ids, behaviour_logprobs=-np.arange(1, len(ids) + 1, dtype=np.float32) / 10,
                     token_versions=np.arange(len(ids), dtype=np.int64), finish_reason=finish)  # type: ignore[arg-type]


def test_a_sample_ends_at_the_first_stop_string_with_its_logprobs_and_versions() -> None:
    cut = cut_at_stop(_sample("12+3=15\n\nand more"), ["\n\n", "and"], _chars)
    assert _chars(cut.completion_ids) == "12+3=15\n\n" and cut.finish_reason == "stop"
    assert cut.behaviour_logprobs.tolist() == pytest.approx([-(i + 1) / 10 for i in range(9)])
    assert cut.token_versions.tolist() == list(range(9))
    # The earliest stop wins whichever is listed first; no stop string: the sample is unchanged.
    assert _chars(cut_at_stop(_sample("x and\n\n"), ["\n\n", "and"], _chars).completion_ids) == "x and"
    untouched = _sample("no stop here")
    assert cut_at_stop(untouched, ["\n\n"], _chars) is untouched
    # A stop string spread over tokens: the cut is after the token that completes it.
    two = SampleOut(completion_ids=[1, 2, 3], behaviour_logprobs=np.zeros(3, np.float32),
                    token_versions=np.zeros(3, np.int64), finish_reason="length")
    pieces = {1: "ab", 2: "c#", 3: "#d"}
    assert cut_at_stop(two, ["##"], lambda ids: "".join(pieces[i] for i in ids)).completion_ids == [1, 2, 3]
    assert cut_at_stop(two, ["c#"], lambda ids: "".join(pieces[i] for i in ids)).completion_ids == [1, 2]
