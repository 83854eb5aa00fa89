"""Structured logging: events with fields, rendered for a console on a TTY and as JSON for daemons.

    from fleetrl.log import get_logger
    log = get_logger(__name__)
    log.info("version.published", version=n, bytes=b)

Every secret the config resolves is registered here (`register_secret`); a processor replaces it by
`[REDACTED]` in every event, exception text included, and `redact` does the same for lines printed
outside the logger (fatal errors, status).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, MutableMapping
from typing import Any

import structlog

_configured = False
_secrets: set[str] = set()
REDACTED = "[REDACTED]"
_MIN_SECRET_CHARS = 4  # shorter values would blank ordinary words in every event


def register_secret(value: str) -> None:
    """Redact `value` from every later log event and `redact()` call of this process."""
    value = value.strip()
    if len(value) >= _MIN_SECRET_CHARS:
        _secrets.add(value)


def redact(text: str) -> str:
    """`text` with every registered secret replaced by `[REDACTED]` (longest first)."""
    for secret in sorted(_secrets, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def _redact_value(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: _redact_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_redact_value(v) for v in value)
    if isinstance(value, BaseException | bytes):
        return redact(str(value))
    return value


def redact_processor(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: registered secrets never reach the renderer (runs after exceptions are formatted)."""
    if not _secrets:
        return event_dict
    return {k: _redact_value(v) for k, v in event_dict.items()}


class _StderrLogger:
    """Writes each rendered event to whatever `sys.stderr` is at that moment.

    Binding the stream at configure time would keep a handle that test capture (or a daemon that
    redirects stderr) later closes. Each event is one write of the line and its newline under a
    process-wide lock: `print` writes the two apart, so two threads logging at once could put two
    events on one line, which no JSON log reader can split.
    """

    _lock = threading.Lock()

    def msg(self, message: str) -> None:
        with self._lock:
            stream = sys.stderr
            stream.write(message + "\n")
            stream.flush()

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
            redact_processor,
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


class LogBudget:
    """One event logged at most `per_window` times in each `window_s`; the rest are counted by key.

    A flood of bad input would otherwise write one line per record (160,000 in the demo's fuzz run):
    `warning(log, key, **fields)` logs the event while the window has room and counts it under `key`
    once it has none; the counts come out as one `<event>.suppressed` line (`count`, `by` key,
    `window_s`) when a later event finds its window over, or at `flush` (callers flush on close).
    Metrics still count every event; this bounds only the log.
    """

    def __init__(self, event: str, *, per_window: int = 20, window_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if per_window < 0 or window_s <= 0:
            raise ValueError(f"LogBudget({event!r}): per_window must be >= 0 and window_s > 0")
        self.event, self.per_window, self.window_s = event, per_window, window_s
        self._clock = clock
        self._start = clock()
        self._used = 0
        self._suppressed: Counter[str] = Counter()

    def warning(self, log: Any, key: str, **fields: Any) -> None:
        now = self._clock()
        if now - self._start >= self.window_s:
            self.flush(log)
            self._start, self._used = now, 0
        if self._used < self.per_window:
            self._used += 1
            log.warning(self.event, **fields)
        else:
            self._suppressed[key] += 1

    def flush(self, log: Any) -> None:
        """Log the counts suppressed so far, if any, as one line."""
        if self._suppressed:
            log.warning(f"{self.event}.suppressed", count=sum(self._suppressed.values()),
                        by=dict(self._suppressed), window_s=self.window_s)
            self._suppressed.clear()
