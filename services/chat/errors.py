"""Errors of the chat endpoint, each an HTTP status and an OpenAI-shaped body.

An `openai` client turns the status into its own exception class (400 BadRequestError, 404
NotFoundError, 409 ConflictError, 422 UnprocessableEntityError) and shows `message`, so every
message says what was wrong and what to do.
"""

from __future__ import annotations

from typing import Any


class ChatError(Exception):
    """A request the endpoint refuses; nothing about the generator is broken by it."""

    status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.headers: dict[str, str] = {}  # e.g. the episode a policy failure ended, so the agent can end it

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class NotFound(ChatError):
    status = 404
    kind = "not_found_error"


class Conflict(ChatError):
    """The episode or task is in a state that does not allow the request (ended, published)."""

    status = 409
    kind = "conflict_error"


class PolicyOutputError(ChatError):
    """The policy's own output broke the protocol (a malformed tool call): its tokens are recorded
    and the episode ends with finish reason 'policy_error', so the failure is scored, not hidden."""

    status = 422
    kind = "policy_output_error"


class StitchError(ChatError):
    """The conversation cannot be joined to the episode's tokens without re-tokenising earlier turns."""
