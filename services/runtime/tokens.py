"""A light tokenizer wrapper over ``tokenizers`` (no torch, no transformers).

Environment and reward containers must start without torch; they only need text <-> ids of
the policy's tokenizer, read from the Hugging Face folder's ``tokenizer.json``, and its chat template
(``tokenizer_config.json``'s ``chat_template``, or ``chat_template.jinja``), rendered with Jinja in a
sandbox the way transformers renders it (tests/unit/test_chat_render.py compares the two).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any


class TokenizerError(RuntimeError):
    pass


@dataclass
class TextCodec:
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    _tok: object
    chat_template: str = ""  # the folder's Jinja chat template ('' when it has none)
    special: dict[str, str] = field(default_factory=dict)  # bos_token / eos_token / pad_token text

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

        def text(key: str) -> str | None:
            val = cfg.get(key)
            if isinstance(val, dict):
                val = val.get("content")
            return val if isinstance(val, str) else None

        def tid(key: str) -> int | None:
            val = text(key)
            return tok.token_to_id(val) if val is not None else None

        special = {k: v for k in ("bos_token", "eos_token", "pad_token") if (v := text(k)) is not None}
        return cls(bos_id=tid("bos_token"), eos_id=tid("eos_token"), pad_id=tid("pad_token"), _tok=tok,
                   chat_template=_chat_template(folder, cfg), special=special)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)  # type: ignore[attr-defined]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)  # type: ignore[attr-defined]

    def render_chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """``messages`` as the policy's chat template writes them (the text a prompt is encoded from)."""
        if not self.chat_template:
            raise TokenizerError("the model folder's tokenizer has no chat template (tokenizer_config.json "
                                 "chat_template or chat_template.jinja): use an instruct model's folder, or give "
                                 "the task a plain prompt")
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    **self.special)


def _chat_template(folder: Path, cfg: dict) -> str:
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if isinstance(template, str) and template:
        return template
    jinja = folder / "chat_template.jinja"
    return jinja.read_text(encoding="utf-8") if jinja.exists() else ""


def render_chat_template(template: str, messages: list[dict[str, str]], *, add_generation_prompt: bool = True,
                         **special: str) -> str:
    """Render a Hugging Face chat template (compiled once per template: the environment renders one per
    prompt)."""
    from jinja2 import TemplateError

    try:
        return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **special)
    except TemplateError as exc:
        raise TokenizerError(f"the model's chat template failed to render: {exc}") from exc


@lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    """Jinja in an immutable sandbox (the template comes with a model folder, so it may not touch anything
    but its arguments), blocks trimmed as transformers trims them, with its ``raise_exception`` helper and
    JSON filter."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                 ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise TokenizerError(f"the model's chat template does not compile: {exc}") from exc
