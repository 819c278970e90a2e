"""structlog configured once per process: JSON when not on a terminal, console otherwise.

Every line carries run/service/instance (bound at start) and, inside a message handler, the
subject, msg id and policy version (bound per message with ``bind_message``)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

_CONFIGURED = False


def _add_trace_ids(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    # Imported lazily: a process that never traces pays nothing.
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event.setdefault("span_id", format(ctx.span_id, "016x"))
    return event


def configure_logging(*, service: str, run: str, instance: str = "0", level: str | None = None,
                      json: bool | None = None) -> structlog.stdlib.BoundLogger:
    """Configure structlog for this process (idempotent) and return a bound logger."""
    global _CONFIGURED
    level_name = (level or os.environ.get("RLBUS_LOG_LEVEL", "INFO")).upper()
    if json is None:
        json = not sys.stderr.isatty()
    if not _CONFIGURED:
        renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                _add_trace_ids,
                structlog.processors.format_exc_info,
                renderer,
            ],
            wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
            logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
            cache_logger_on_first_use=True,
        )
        _CONFIGURED = True
    structlog.contextvars.bind_contextvars(run=run, service=service, instance=instance)
    return structlog.get_logger()


def get_logger(**bound: Any) -> Any:
    return structlog.get_logger().bind(**bound)


def bind_message(**fields: Any) -> Any:
    """Bind per-message context (subject, msg_id, version); returns tokens for ``reset``."""
    return structlog.contextvars.bind_contextvars(**fields)


def unbind_message(*keys: str) -> None:
    structlog.contextvars.unbind_contextvars(*keys)
