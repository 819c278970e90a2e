"""A light tokenizer wrapper over ``tokenizers`` (no torch, no transformers).

Environment and reward containers must start without torch; they only need text <-> ids of
the policy's tokenizer, read from the Hugging Face folder's ``tokenizer.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class TokenizerError(RuntimeError):
    pass


@dataclass
class TextCodec:
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    _tok: object

    @classmethod
    def from_folder(cls, path: str | Path) -> TextCodec:
        from tokenizers import Tokenizer

        folder = Path(path)
        tj = folder / "tokenizer.json"
        if not tj.exists():
            raise TokenizerError(
                f"{tj} not found: model_path must be a Hugging Face folder with a fast tokenizer "
                "(run `rlbus init-model` to build the default one)"
            )
        tok = Tokenizer.from_file(str(tj))
        cfg: dict = {}
        if (folder / "tokenizer_config.json").exists():
            cfg = json.loads((folder / "tokenizer_config.json").read_text())

        def tid(key: str) -> int | None:
            val = cfg.get(key)
            if isinstance(val, dict):
                val = val.get("content")
            return tok.token_to_id(val) if isinstance(val, str) else None

        return cls(bos_id=tid("bos_token"), eos_id=tid("eos_token"), pad_id=tid("pad_token"), _tok=tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)  # type: ignore[attr-defined]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)  # type: ignore[attr-defined]
