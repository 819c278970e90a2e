"""Errors of ``rlbus.services.trainer``: one root, so a caller can catch "the trainer refused"."""

from __future__ import annotations


class TrainerError(RuntimeError):
    """Root of every error raised on purpose by ``rlbus.services.trainer``; the message says how to fix it."""
