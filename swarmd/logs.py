"""Logging set-up that suits where the lines go: journald, a terminal or a log shipper.

Under systemd, stderr is connected to journald and `JOURNAL_STREAM` names that stream; journald
adds its own timestamps and reads a `<N>` prefix as the syslog priority, so we print that instead
of a time. Elsewhere lines carry an ISO-8601 UTC timestamp. `json` writes one object per line with
fixed keys, for shippers that should not parse prose.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Mapping

ROOT_LOGGER = "swarmd"
# Loggers of the packages we compose; they share the daemon's level and handler.
PACKAGE_LOGGERS = ("swarmd", "transport")

# syslog priorities (sd-daemon.h): journald maps these to its own levels.
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def priority_of(levelno: int) -> int:
    """The syslog priority for a logging level; levels between named ones round toward urgent."""
    for level in sorted(_PRIORITY, reverse=True):
        if levelno >= level:
            return _PRIORITY[level]
    return 7


def terminal_safe(text: str) -> str:
    """`text` with its control characters but newline and tab escaped as `repr` writes them: log
    messages quote peers' own error texts, and a terminal showing the log would obey an escape
    sequence in one (a multi-line message, such as a supervisor's traceback, keeps its lines)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


class _SafeMessage(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:
        safe = terminal_safe(record.message)
        if safe != record.message:
            record = copy.copy(record)  # other handlers format the record as it came
            record.message = safe
        return super().formatMessage(record)


class JournalFormatter(_SafeMessage):
    """`<N>logger: message`, every line of a multi-line record prefixed so none loses its priority."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{priority_of(record.levelno)}>"
        text = f"{record.name}: {super().format(record)}"
        return "\n".join(prefix + line for line in text.splitlines() or [""])


class TextFormatter(_SafeMessage):
    """`2026-01-02T03:04:05.678Z INFO logger: message` in UTC, so hosts in many zones line up."""

    converter = time.gmtime

    def __init__(self) -> None:
        super().__init__("%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (Unix seconds), level, logger, msg, and exc when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def journal_attached(stream: IO[str], env: Mapping[str, str]) -> bool:
    """True when `stream` is the journald stream systemd named in JOURNAL_STREAM (`device:inode`).

    Checking the inode, as sd_journal_stream_fd's documentation advises, keeps a redirected stderr
    (`swarmd 2>file` inside a unit) from getting priority prefixes meant for journald.
    """
    named = env.get("JOURNAL_STREAM", "")
    if not named:
        return False
    try:
        device, inode = (int(part) for part in named.split(":"))
        info = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (info.st_dev, info.st_ino) == (device, inode)


def level_number(name: str) -> int:
    return logging.getLevelNamesMapping()[name.upper()]


def source_of(record: logging.LogRecord) -> str | None:
    """Who a warning is about, when it is about a remote party: the `source` a caller passed in
    `extra`, or the host of the address the transport's "... from %s" lines name first."""
    source = getattr(record, "source", None)
    if source is not None:
        return str(source)
    args = record.args if isinstance(record.args, tuple) else ()
    if args and isinstance(args[0], tuple) and args[0]:
        return str(args[0][0])
    return None


@dataclass(frozen=True)
class WarningLimit:
    """How many WARNING lines about one remote source reach the log per window: a peer that sends
    malformed bytes on purpose would otherwise write our disk at its own pace. The first line past
    the window after a quiet spell carries the count of those dropped."""

    per_source: int = 5
    window_s: float = 60.0
    #: Sources remembered; the least recently heard is forgotten past it (an attacker with many
    #: addresses costs a small entry each, and each forgotten one may write `per_source` again).
    sources: int = 4096


class SourceRateLimit(logging.Filter):
    """Drops WARNING lines about a source past `limit.per_source` in `limit.window_s`, and counts
    them (`suppressed`, in total); lines about no remote source always pass."""

    def __init__(self, limit: WarningLimit = WarningLimit(), clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.limit, self._clock = limit, clock
        self._windows: OrderedDict[str, list] = OrderedDict()  # source -> [window start, lines, dropped]
        self.suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or (source := source_of(record)) is None:
            return True
        now = self._clock()
        window = self._windows.pop(source, None)
        if window is None or now - window[0] >= self.limit.window_s:
            dropped = window[2] if window is not None else 0
            window = [now, 0, 0]
            if dropped:
                note = f" [{dropped} more such lines about {source} were dropped]"
                record.msg = f"{record.msg}{note.replace('%', '%%') if record.args else note}"
        self._windows[source] = window
        while len(self._windows) > self.limit.sources:
            self._windows.popitem(last=False)
        if window[1] < self.limit.per_source:
            window[1] += 1
            return True
        window[2] += 1
        self.suppressed += 1
        return False


#: The limiter of the handler `configure` installed last (the daemon reads its count for status).
warning_limiter = SourceRateLimit()


def configure(level: str, fmt: str, *, stream: IO[str] | None = None, env: Mapping[str, str] = os.environ,
              limit: WarningLimit = WarningLimit()) -> None:
    """Install one handler for our packages; calling again replaces it (tests, SIGHUP)."""
    global warning_limiter
    stream = stream if stream is not None else sys.stderr
    if fmt == "json":
        formatter: logging.Formatter = JsonFormatter()
    elif journal_attached(stream, env):
        formatter = JournalFormatter()
    else:
        formatter = TextFormatter()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    warning_limiter = SourceRateLimit(limit)
    handler.addFilter(warning_limiter)
    for name in PACKAGE_LOGGERS:
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(level_number(level))
        logger.propagate = False


def set_level(level: str) -> None:
    """Change the level in place (SIGHUP) without touching handlers."""
    for name in PACKAGE_LOGGERS:
        logging.getLogger(name).setLevel(level_number(level))
