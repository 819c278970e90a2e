"""Loading a policy from a Hugging Face folder, and swapping its weights in place.

Why it exists: the generator and the trainer must build the same model from the same folder
(any causal LM, not only the tiny Qwen2), and the generator must install new weights without
rebuilding the model. A weight payload that does not fit is refused as a whole before any
tensor is touched, so a bad message can never leave a half-updated policy behind.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors_bytes
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from rlbus.services.policy.errors import PolicyLoadError, WeightMismatchError

DTypeName = Literal["float32", "bfloat16", "float16"]
AttnName = Literal["sdpa", "eager"]
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

WeightSource = str | Path | bytes | bytearray | memoryview | Mapping[str, torch.Tensor]


def load_policy(
    path: str | Path,
    *,
    dtype: DTypeName = "float32",
    device: str = "cpu",
    attn: AttnName = "sdpa",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model in eval mode, tokenizer) from a local Hugging Face causal-LM folder."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise PolicyLoadError(
            f"{folder} is not a Hugging Face model folder (no config.json): "
            "run `rlbus init-model --out DIR` or point at a saved model"
        )
    if dtype not in _DTYPES:
        raise PolicyLoadError(f"dtype={dtype!r}: use one of {sorted(_DTYPES)}")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=_DTYPES[dtype], attn_implementation=attn, local_files_only=True
        )
        tokenizer = load_tokenizer(folder)
    except (OSError, ValueError, KeyError) as exc:
        raise PolicyLoadError(f"could not load the policy from {folder}: {exc}") from exc
    model.to(device)  # type: ignore[arg-type]  # mypy misreads the decorated PreTrainedModel.to
    model.eval()
    return model, tokenizer


# The class names a folder's tokenizer_config.json gives to a tokenizer saved straight from its
# tokenizer.json (what `save_pretrained` writes for a PreTrainedTokenizerFast).
_GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in a model folder, exactly as it was saved.

    Why not ``AutoTokenizer`` alone: transformers 5 swaps the saved class of some model types
    (qwen2 among them) for that family's own tokenizer class, which rebuilds the pre-tokenizer.
    For rlbus's local models that class drops the spaces of the character vocabulary and merges
    the chat model's byte-level BPE differently, so prompts would reach the model as ids it was
    never trained on.  A folder whose tokenizer was saved as the generic fast class is loaded as
    that class; any other folder (a real model's) goes through ``AutoTokenizer`` as usual."""
    folder = Path(path)
    try:
        saved = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        saved = None
    if saved in _GENERIC_TOKENIZER_CLASSES and (folder / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def read_weights(source: WeightSource) -> dict[str, torch.Tensor]:
    """Name → tensor from a safetensors file, a folder of them, serialized bytes or a mapping.

    Decoding is separate from `load_state_from_safetensors` so a generator can decode a new
    version in the background and only copy between decode steps.  Bytes or files that are not
    safetensors raise `WeightMismatchError`, like any other payload that does not fit.
    """
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        try:
            return load_safetensors_bytes(bytes(source))
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type for any bad byte
            raise WeightMismatchError(f"weight payload of {len(source)} bytes is not safetensors "
                                      f"({type(exc).__name__}: {exc}): publish weights saved with safetensors") from None
    path = Path(source)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightMismatchError(f"no .safetensors file at {path}: pass a file or a model folder")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def check_weights(model: torch.nn.Module, incoming: Mapping[str, torch.Tensor]) -> None:
    """Raise `WeightMismatchError` unless `incoming` fits the live `model` exactly.

    The names must be exactly the model's (tied aliases may be omitted), shapes must match,
    a floating-point tensor of the model needs a floating-point one (cast to the model's
    dtype on copy), any other needs its own dtype, and values must be finite.  Reads the
    model's shapes only, so it may run beside a sampler that uses the model.
    """
    state = model.state_dict()
    unknown = sorted(set(incoming) - set(state))
    if unknown:
        raise WeightMismatchError(
            f"payload has {len(unknown)} tensor(s) the model does not, e.g. {unknown[0]!r}: "
            "was it saved from a different architecture?",
            tensor=unknown[0],
        )
    # Tied weights appear under several names but share storage; one name per storage suffices.
    provided_storage = {state[name].data_ptr() for name in incoming}
    missing = sorted(n for n, t in state.items() if n not in incoming and t.data_ptr() not in provided_storage)
    if missing:
        raise WeightMismatchError(
            f"payload lacks {len(missing)} tensor(s) of the model, e.g. {missing[0]!r}: send the full state dict",
            tensor=missing[0],
        )
    for name, tensor in incoming.items():
        _check_tensor(name, tensor, state[name])


def _check_tensor(name: str, tensor: torch.Tensor, target: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(target.shape):
        raise WeightMismatchError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
            f"{tuple(target.shape)}: the payload is for a different model size",
            tensor=name,
        )
    if target.is_floating_point() != tensor.is_floating_point() or (
            not target.is_floating_point() and tensor.dtype != target.dtype):
        raise WeightMismatchError(
            f"tensor {name!r} has dtype {tensor.dtype}, the model holds {target.dtype}: "
            "save the weights in a floating-point dtype (they are cast to the model's)",
            tensor=name,
        )
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise WeightMismatchError(f"tensor {name!r} contains NaN or Inf: refusing the whole update", tensor=name)


def copy_weights(model: torch.nn.Module, incoming: Mapping[str, torch.Tensor]) -> int:
    """Copy tensors that passed `check_weights` into `model` in place; returns the count."""
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in incoming.items():
            state[name].copy_(tensor)
    return len(incoming)


def load_state_from_safetensors(model: torch.nn.Module, source: WeightSource) -> int:
    """Copy every tensor of `source` into the live `model` in place; returns the count.

    `source` is a safetensors file, a folder of them, the serialized bytes, or a name →
    tensor mapping. Strict (see `check_weights`); all checks run before the first copy, so on
    error the model is unchanged.
    """
    incoming = read_weights(source)
    check_weights(model, incoming)
    return copy_weights(model, incoming)
