"""Loading a policy from a Hugging Face folder, and swapping its weights in place.

Why it exists: the generator and the trainer must build the same model from the same folder
(any causal LM, not only the tiny Qwen2), and the generator must install new weights without
rebuilding the model. A weight payload that does not fit is refused as a whole before any
tensor is touched, so a bad message can never leave a half-updated policy behind.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors_bytes
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from services.policy.errors import PolicyLoadError, WeightMismatchError

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
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise PolicyLoadError(f"could not load the policy from {folder}: {exc}") from exc
    model.to(device)  # type: ignore[arg-type]  # mypy misreads the decorated PreTrainedModel.to
    model.eval()
    return model, tokenizer


def read_weights(source: WeightSource) -> dict[str, torch.Tensor]:
    """Name → tensor from a safetensors file, a folder of them, serialized bytes or a mapping.

    Decoding is separate from `load_state_from_safetensors` so a generator can decode a new
    version in the background and only copy between decode steps.
    """
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return load_safetensors_bytes(bytes(source))
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


def load_state_from_safetensors(model: torch.nn.Module, source: WeightSource) -> int:
    """Copy every tensor of `source` into the live `model` in place; returns the count.

    `source` is a safetensors file, a folder of them, the serialized bytes, or a name →
    tensor mapping. Strict: the names must be exactly the model's (tied aliases may be
    omitted), shapes must match, values must be finite; dtype is cast to the model's. All
    checks run before the first copy, so on error the model is unchanged.
    """
    incoming = read_weights(source)
    state = model.state_dict()
    # Tied weights appear under several names but share storage; one name per storage suffices.
    owners: dict[int, str] = {}
    for name, tensor in state.items():
        owners.setdefault(tensor.data_ptr(), name)
    unknown = sorted(set(incoming) - set(state))
    if unknown:
        raise WeightMismatchError(
            f"payload has {len(unknown)} tensor(s) the model does not, e.g. {unknown[0]!r}: "
            "was it saved from a different architecture?",
            tensor=unknown[0],
        )
    provided_storage = {state[name].data_ptr() for name in incoming}
    missing = sorted(n for n, t in state.items() if n not in incoming and t.data_ptr() not in provided_storage)
    if missing:
        raise WeightMismatchError(
            f"payload lacks {len(missing)} tensor(s) of the model, e.g. {missing[0]!r}: send the full state dict",
            tensor=missing[0],
        )
    for name, tensor in incoming.items():
        target = state[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise WeightMismatchError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(target.shape)}: the payload is for a different model size",
                tensor=name,
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise WeightMismatchError(f"tensor {name!r} contains NaN or Inf: refusing the whole update", tensor=name)
    with torch.no_grad():
        for name, tensor in incoming.items():
            state[name].copy_(tensor)
    return len(incoming)


