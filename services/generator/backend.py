"""The generator backend interface: sample groups of completions, swap weights in place.

A backend samples token-in/token-out and records, per generated token, the behaviour logprob of
the distribution it sampled from and the policy version that produced it.  Weight updates are
*staged* from any thread and applied by the backend between decode steps, so in-flight
sequences continue and their later tokens carry the new version.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from rlbus.services.runtime.registry import Registry

T = TypeVar("T")


class Backend(Protocol):
    @property
    def version(self) -> int: ...

    def sample(self, prompts: list[list[int]], n: int, sampling: Any, stop_ids: list[int], seed: int) -> list[list[Any]]:
        """Blocking; returns per prompt ``n`` ``rlbus.services.policy.sampler.SampleOut``."""
        ...

    def stage(self, version: int, weights: bytes | memoryview) -> None:
        """Validate and stage a new version; applied at the next decode-step boundary."""
        ...

    def apply_staged(self) -> bool:
        """Apply a staged version now (called under the model lock as each version is staged); True when the
        version changed."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    @property
    def eos_id(self) -> int | None: ...

    def metrics(self) -> dict[str, float]: ...


@runtime_checkable
class PinnedSampling(Protocol):
    """Optional capability: sample at an exact older version beside the live weights, so a held-out
    round is scored on one version however far the live weights move meanwhile.  A backend without
    it evaluates on its live weights and the tokens record which versions those were."""

    @property
    def pinned_version(self) -> int | None:
        """The version the pinned copy holds now (None: built without one)."""
        ...

    def sample_at(self, version: int, weights: bytes | memoryview | None, prompts: list[list[int]], n: int,
                  sampling: Any, stop_ids: list[int], seed: int) -> list[list[Any]]:
        """Like ``sample`` on ``version``'s weights; ``weights`` may be None when the copy holds it."""
        ...


@runtime_checkable
class InputLimits(Protocol):
    """Optional capability: what the model can take, so a task it cannot sample is refused alone
    before sampling instead of failing the batch it landed in.  ``None``: not known."""

    @property
    def max_context(self) -> int | None:
        """Positions the model attends over: prompt tokens + max_new_tokens must fit."""
        ...

    @property
    def vocab_size(self) -> int | None:
        """Token ids must lie in [0, vocab_size)."""
        ...


def input_problem(limits: InputLimits, prompt: Sequence[int], max_new_tokens: int) -> str:
    """Why a prompt cannot be sampled with ``max_new_tokens`` on a model of these limits ('' when it can)."""
    if len(prompt) == 0:
        return "the prompt has no tokens: the environment rendered an empty prompt"
    vocab = limits.vocab_size
    bad = next((int(t) for t in prompt if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        return (f"prompt token id {bad} is outside the model's vocabulary (size {vocab}): encode prompts "
                "with the policy's own tokenizer")
    context = limits.max_context
    if context is not None and len(prompt) + max_new_tokens > context:
        return (f"prompt of {len(prompt)} tokens + max_new_tokens {max_new_tokens} = "
                f"{len(prompt) + max_new_tokens} exceeds the model's context of {context} tokens: shorten "
                "the prompt or lower sampling.max_new_tokens")
    return ""


class SampleMeter:
    """What every backend counts around a sample call: seconds, tokens, and the testing slowdown
    (``slowdown`` > 1 sleeps that multiple of the call's time, simulating a slower accelerator;
    the service may change it at run time)."""

    def __init__(self, slowdown: float = 1.0) -> None:
        self.slowdown = slowdown
        self.sample_seconds = 0.0
        self.tokens = 0

    def metered(self, call: Callable[[], list[list[Any]]]) -> list[list[Any]]:
        out = self.paced(call)
        self.tokens += sum(len(s.completion_ids) for g in out for s in g)
        return out

    def paced(self, call: Callable[[], T]) -> T:
        """``call()``, its seconds counted and stretched by the slowdown (the episode engine's runs
        go through here too; their tokens are counted by the engine)."""
        t0 = time.perf_counter()
        out = call()
        spent = time.perf_counter() - t0
        if self.slowdown > 1.0:
            time.sleep(spent * (self.slowdown - 1.0))
        self.sample_seconds += time.perf_counter() - t0
        return out


def cut_at_stop(sample: Any, stops: Sequence[str], decode: Callable[[list[int]], str]) -> Any:
    """The sample ended at the first stop string in its text: completion ids, behaviour logprobs and
    token versions cut after the token that completes it, finish reason 'stop'.  The stop string
    stays in the completion (its tokens were sampled, so the trainer sees them).

    Backends stop only on token ids, so this runs on what they return; a sample is the same
    whether the backend stopped at that token or went on, because the kept tokens' logprobs
    do not depend on the tokens after them.  The shortest cut is found by bisection on decoded
    prefix length (a handful of decodes, not one per token)."""
    ids = list(sample.completion_ids)
    text = decode(ids)
    ends = [i + len(stop) for stop in stops if stop and (i := text.find(stop)) >= 0]
    if not ends:
        return sample
    need = min(ends)
    lo, hi = 1, len(ids)  # the shortest prefix whose text reaches the end of the first stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[:mid])) >= need:
            hi = mid
        else:
            lo = mid + 1
    if lo == len(ids) and sample.finish_reason == "stop":
        return sample
    return dataclasses.replace(sample, completion_ids=ids[:lo], behaviour_logprobs=sample.behaviour_logprobs[:lo],
                               token_versions=sample.token_versions[:lo], finish_reason="stop")


# Lazy "module:attr" entries: choosing a backend imports it, so a torch-only install never imports vLLM.
BACKENDS: Registry[Backend] = Registry("backend", lazy={"torch": "rlbus.services.generator.torch_backend:TorchBackend",
                                                        "vllm": "rlbus.services.generator.vllm_backend:VllmBackend"})
