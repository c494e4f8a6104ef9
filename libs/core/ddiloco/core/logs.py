"""Structured logging: one place configures structlog for every ddiloco process.

Every log line is a JSON object (or a readable line on a terminal) that carries the fields bound
by the caller; services bind ``learner_id``, ``fragment`` and ``version`` where they apply.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO, cast

import structlog

_CONFIGURED = False
_SETTINGS: dict[str, Any] = {}


def configure(level: str | None = None, json: bool | None = None, file: Any = None) -> None:
    """Configure structlog for this process (stderr, or ``file``). ``DDILOCO_LOG_LEVEL`` /
    ``DDILOCO_LOG_JSON`` override."""
    global _CONFIGURED
    level = (level or os.environ.get("DDILOCO_LOG_LEVEL", "info")).upper()
    if json is None:
        env = os.environ.get("DDILOCO_LOG_JSON")
        json = env != "0" if env is not None else not sys.stderr.isatty()
    _SETTINGS.update(level=level, json=json)
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=file or cast(TextIO, _Stderr())),
        cache_logger_on_first_use=False,
    )
    _CONFIGURED = True


class _Stderr:
    """``sys.stderr`` as it is when a line is written, not as it was when logging was configured:
    a stream that replaced it for a while (a test's output capture, a redirect) and was closed
    since would otherwise take every later line, and fail on it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def settings() -> dict[str, Any]:
    """This process's level and format, for a child process to ``configure`` the same way."""
    if not _CONFIGURED:
        configure()
    return dict(_SETTINGS)


def get_logger(name: str, **bound: Any) -> Any:
    if not _CONFIGURED:
        configure()
    return structlog.get_logger(name).bind(**bound)
