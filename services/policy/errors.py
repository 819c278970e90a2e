"""Errors of `rlbus.services.policy`: one root so callers can catch "the policy code refused"."""

from __future__ import annotations


class PolicyError(Exception):
    """Root of every error raised on purpose by `rlbus.services.policy`."""


class PolicyLoadError(PolicyError):
    """A model folder could not be loaded (missing, not a causal LM, incomplete)."""


class WeightMismatchError(PolicyError):
    """A weight payload does not fit the live model; nothing was copied.

    `tensor` names the offending tensor (or is None when the problem is the set of names).
    """

    def __init__(self, message: str, *, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor
