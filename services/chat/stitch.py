"""One episode's token sequence, stitched across requests without re-tokenising earlier turns.

The first request's messages are rendered with the generation prompt and encoded: that is the
prompt.  Each later request must repeat the conversation so far (the messages the endpoint has
seen, then the assistant turn it returned); only what follows is new.  Its tokens are the
encoding of the *difference* between two renderings by the template:

    render(conversation so far)  is a prefix of  render(conversation + new messages, generation prompt)

and the new text is what the second adds.  The policy's own tokens of earlier turns are kept as
sampled; the template's rendering of those turns is used only to find where the new text starts.
A template that renders earlier turns differently once later ones exist (one that drops an
earlier turn's reasoning, say) breaks the prefix property: the request is refused rather than
silently re-tokenised.

Where the policy's turn ended: the policy stops at the end-of-turn token (eos); whatever the
template renders after it (Qwen-style templates put a newline there) was not sampled, so it is
the first part of the new template tokens.  A turn cut at max_tokens never produced the end token:
the template's end token and what follows it are template tokens too.

Layout (as `schemas.Rollout` wants it): ids = prompt + completion; per completion token, the
loss mask (1 = sampled by the policy), the behaviour logprob (0 for template tokens) and the
policy version (a template token carries the version of the policy token before it, so version
spans break only where the weights did).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlbus.services.chat.errors import ChatError, StitchError
from rlbus.services.chat.template import ChatTemplate


@dataclass
class EpisodeTokens:
    """The episode's tokens as the trainer will see them."""

    ids: list[int] = field(default_factory=list)
    prompt_len: int = 0
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    template_version: int = 0  # version given to template tokens before any policy token exists

    def start(self, prompt: list[int], version: int) -> None:
        self.ids = list(prompt)
        self.prompt_len = len(prompt)
        self.template_version = version

    def append_template(self, ids: list[int]) -> None:
        version = self.versions[-1] if self.versions else self.template_version
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)

    def append_policy(self, ids: list[int], logprobs: np.ndarray, versions: np.ndarray) -> None:
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(f"policy tokens {len(ids)}, logprobs {len(logprobs)} and versions {len(versions)} "
                             "must have one entry per token")
        self.ids += [int(t) for t in ids]
        self.mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs]
        self.versions += [int(v) for v in versions]


class Conversation:
    """What the endpoint has seen of one episode's messages, and how the next request extends it."""

    def __init__(self, template: ChatTemplate, tools: list[dict[str, Any]] | None) -> None:
        self.template = template
        self.tools = tools
        self.messages: list[dict[str, Any]] = []  # normalised, ending with the assistant turn returned
        self.last_ended = True  # the last policy turn ended with the end-of-turn token

    def first(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt ids of the episode's first request (`take` records the messages)."""
        return self.template.encode(self.template.render(messages, self.tools, generation_prompt=True))

    def extends(self, messages: list[dict[str, Any]]) -> bool:
        """Whether `messages` repeats this conversation and adds to it."""
        return len(messages) > len(self.messages) and messages[: len(self.messages)] == self.messages

    def next_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The template tokens that join `messages`' new part (and the next generation prompt) to the
        episode.  Raises `StitchError` when that cannot be done without re-tokenising.  Changes
        nothing: `take` records the messages once their request is sampled."""
        if (tools or None) != (self.tools or None):
            raise StitchError("the tools changed within the episode: the template renders them at the start, so "
                              "earlier tokens would change; keep one tool list per episode or start a new one",
                              code="tools_changed", param="tools")
        if not self.extends(messages):
            raise StitchError(self._divergence(messages), code="conversation_diverged", param="messages")
        before = self.template.render(self.messages, tools, generation_prompt=False)
        after = self.template.render(messages, tools, generation_prompt=True)
        if not after.startswith(before):
            at = next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), len(after))
            raise StitchError(
                f"the chat template renders the earlier turns differently once new messages follow (first "
                f"difference at character {at}: {before[at:at + 40]!r} became {after[at:at + 40]!r}); joining "
                "would re-tokenise sampled text. Use a template whose rendering of a conversation is a prefix of "
                "its rendering with more messages, or send each request as its own episode",
                code="template_not_stitchable")
        end = before.rfind(self.template.end_text)
        if end < 0:
            raise StitchError("the template did not render the end-of-turn token after the assistant's turn: "
                              "cannot tell where the sampled tokens end", code="template_not_stitchable")
        # Text the template puts after the policy's last token: from the end token on if the policy
        # never produced it (cut at max_tokens), else only what follows it.
        tail = before[end:] if not self.last_ended else before[end + len(self.template.end_text):]
        return self.template.encode(tail + after[len(before):])

    def take(self, messages: list[dict[str, Any]]) -> None:
        self.messages = list(messages)

    def answered(self, reply: dict[str, Any], ended: bool) -> None:
        """Record the assistant turn returned for the last request, as the client will echo it."""
        self.messages.append(reply)
        self.last_ended = ended

    def _divergence(self, messages: list[dict[str, Any]]) -> str:
        if len(messages) <= len(self.messages):
            return (f"the request repeats {len(messages)} messages but the episode already holds "
                    f"{len(self.messages)} (ending with the assistant's reply): send the whole conversation "
                    "and append the new messages")
        i = next(i for i, (a, b) in enumerate(zip(self.messages, messages, strict=False)) if a != b)
        return (f"messages[{i}] differs from what the episode holds (role {self.messages[i]['role']}): earlier "
                "turns must be sent back unchanged, including the assistant's reply and its tool calls")


def check_fits(ids: list[int], max_tokens: int, context: int | None) -> None:
    """Refuse a request whose prompt plus max_tokens would not fit the model's context."""
    if context is not None and len(ids) + max_tokens > context:
        raise ChatError(
            f"this episode is {len(ids)} tokens and max_tokens is {max_tokens}: {len(ids) + max_tokens} exceeds "
            f"the model's context of {context} tokens; end the episode or lower max_tokens",
            code="context_length_exceeded", param="messages")
