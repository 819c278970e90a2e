"""Streamed replies (``stream: true``): a finished chat.completion as the chunk events OpenAI
clients read, and the checks on what a request asked for.

The chunks carry what the completion holds, in the order a streaming client assembles it: the
role, the content, each tool call whole (its index, id, name and arguments in one delta), then the
finish reason; with ``stream_options.include_usage`` a last chunk with no choices carries the
usage.  Every chunk repeats the completion's id, model and system fingerprint.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rlbus.services.chat.errors import ChatError


def streaming(body: dict[str, Any]) -> dict[str, bool]:
    """``{"stream": ..., "include_usage": ...}`` from a request, refusing values of the wrong type."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise ChatError(f"'stream' must be true or false, got {stream!r}", code="invalid_value", param="stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise ChatError("'stream_options' is only allowed with stream=true", code="invalid_value",
                        param="stream_options")
    if options is not None and not isinstance(options, dict):
        raise ChatError("'stream_options' must be an object such as {\"include_usage\": true}", code="invalid_value",
                        param="stream_options")
    return {"stream": bool(stream), "include_usage": bool((options or {}).get("include_usage", False))}


def completion_chunks(completion: dict[str, Any], *, include_usage: bool) -> Iterator[dict[str, Any]]:
    """The chat.completion.chunk objects of one finished ``completion`` (one choice)."""
    head = {k: completion[k] for k in ("id", "created", "model", "system_fingerprint")}
    choice = completion["choices"][0]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    yield chunk({"role": "assistant", "content": ""})
    if message.get("content"):
        yield chunk({"content": message["content"]})
    for k, call in enumerate(message.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": k, **call}]})
    yield chunk({}, choice["finish_reason"])
    if include_usage:
        yield {**head, "object": "chat.completion.chunk", "choices": [], "usage": completion["usage"]}
