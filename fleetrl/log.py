"""Structured logging: events with fields, rendered for a console on a TTY and as JSON for daemons.

    from fleetrl.log import get_logger
    log = get_logger(__name__)
    log.info("version.published", version=n, bytes=b)
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_configured = False


class _StderrLogger:
    """Writes each rendered event to whatever `sys.stderr` is at that moment.

    Binding the stream at configure time would keep a handle that test capture (or a daemon that
    redirects stderr) later closes.
    """

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


def configure(json: bool | None = None, level: str | int = "INFO") -> None:
    """Set up structlog once per process. `json=None` picks JSON unless stderr is a TTY."""
    global _configured
    if json is None:
        json = not sys.stderr.isatty()
    lvl = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=lambda *args: _StderrLogger(),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str | None = None, **fields: Any) -> Any:
    """A bound structlog logger; configures console/JSON output on first use if nobody has."""
    if not _configured:
        configure()
    # Lazy: the logger is assembled on first use, with the configuration in force then.
    return structlog.get_logger(**({"component": name} if name else {}), **fields)
