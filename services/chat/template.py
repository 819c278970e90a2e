"""The policy's chat template: render messages, encode text, and read tool calls back out.

Rendering goes through the tokenizer's own Hugging Face chat template (`apply_chat_template`
with `tools`), so any model folder whose template follows HF's tool-call conventions works.
Tool calls are read in the Hermes/Qwen form `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
that such templates render: the parser is the template's inverse, so a call the endpoint returns
renders back to the text the policy produced.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rlbus.services.chat.errors import ChatError, PolicyOutputError

TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
ROLES = ("system", "user", "assistant", "tool")


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ChatError(f"{where}: arguments are not JSON ({exc.msg}); send them as a JSON object string",
                            code="invalid_tool_call", param="messages") from exc
    if not isinstance(raw, dict):
        raise ChatError(f"{where}: arguments must be a JSON object, got {type(raw).__name__}",
                        code="invalid_tool_call", param="messages")
    return raw


def normalise(messages: Any) -> list[dict[str, Any]]:
    """The request's messages in one canonical form, so an echoed turn compares equal to the one
    the endpoint returned whatever the client did to it (content None vs '', arguments as a JSON
    string vs an object, extra fields such as tool-call ids)."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("'messages' must be a non-empty list of {role, content} objects", code="invalid_messages",
                        param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ChatError(f"messages[{i}] needs a role, one of {', '.join(ROLES)}", code="invalid_messages",
                            param="messages")
        content = m.get("content") or ""
        if isinstance(content, list):  # OpenAI content parts: only text parts carry anything for this policy
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise ChatError(f"messages[{i}].content must be a string or text parts", code="invalid_messages",
                            param="messages")
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        calls = m.get("tool_calls") or []
        if calls:
            if m["role"] != "assistant" or not isinstance(calls, list):
                raise ChatError(f"messages[{i}]: only an assistant message carries a list of tool_calls",
                                code="invalid_messages", param="messages")
            msg["tool_calls"] = []
            for k, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ChatError(f"messages[{i}].tool_calls[{k}] needs function.name and function.arguments",
                                    code="invalid_tool_call", param="messages")
                args = _arguments(fn.get("arguments", {}), f"messages[{i}].tool_calls[{k}]")
                msg["tool_calls"].append({"type": "function", "function": {"name": fn["name"], "arguments": args}})
        out.append(msg)
    return out


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content outside the calls, calls as {name, arguments}) of an assistant turn's text.
    A `<tool_call>` that is not closed, not JSON, or lacks a name or object arguments raises
    `PolicyOutputError`: the policy produced it, so it is the policy's failure."""
    calls = []
    for match in TOOL_CALL.finditer(text):
        body, closed = match.group(1).strip(), match.group(2)
        if not closed:
            raise PolicyOutputError(f"the policy opened a <tool_call> it never closed: {body[:80]!r}",
                                    code="malformed_tool_call")
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            raise PolicyOutputError(f"the policy's tool call is not JSON ({exc.msg}): {body[:80]!r}",
                                    code="malformed_tool_call") from exc
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]
                and isinstance(call.get("arguments", {}), dict)):
            raise PolicyOutputError(f"the policy's tool call needs a name and object arguments: {body[:80]!r}",
                                    code="malformed_tool_call")
        calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
    content = TOOL_CALL.sub("", text).strip() if calls else text
    return content, calls


class ChatTemplate:
    """The tokenizer's chat template and the encoding the endpoint records tokens with."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatError("the policy's tokenizer has no chat template: serve a model folder whose "
                            "tokenizer_config.json carries one (rlbus builds one with "
                            "rlbus.services.policy.chat_model)",
                            code="no_chat_template")
        if tokenizer.eos_token is None:
            raise ChatError("the policy's tokenizer has no eos token: the endpoint cannot tell where a turn ends",
                            code="no_eos_token")
        self.tokenizer = tokenizer
        self.end_text = str(tokenizer.eos_token)
        self.end_id = int(tokenizer.eos_token_id)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
               generation_prompt: bool) -> str:
        try:
            return str(self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                          add_generation_prompt=generation_prompt))
        except Exception as exc:  # jinja raises its own types, e.g. raise_exception() for an unsupported role
            raise ChatError(f"the chat template cannot render these messages: {exc}", code="template_error",
                            param="messages") from exc

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def text_of(self, ids: list[int]) -> str:
        """An assistant turn's text: special tokens (the end of turn) dropped, tool-call markers kept."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))
