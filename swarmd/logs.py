"""Logging set-up that suits where the lines go: journald, a terminal or a log shipper.

Under systemd, stderr is connected to journald and `JOURNAL_STREAM` names that stream; journald
adds its own timestamps and reads a `<N>` prefix as the syslog priority, so we print that instead
of a time. Elsewhere lines carry an ISO-8601 UTC timestamp. `json` writes one object per line with
fixed keys, for shippers that should not parse prose.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
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


class JournalFormatter(logging.Formatter):
    """`<N>logger: message`, every line of a multi-line record prefixed so none loses its priority."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{priority_of(record.levelno)}>"
        text = f"{record.name}: {super().format(record)}"
        return "\n".join(prefix + line for line in text.splitlines() or [""])


class TextFormatter(logging.Formatter):
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


def configure(level: str, fmt: str, *, stream: IO[str] | None = None, env: Mapping[str, str] = os.environ) -> None:
    """Install one handler for our packages; calling again replaces it (tests, SIGHUP)."""
    stream = stream if stream is not None else sys.stderr
    if fmt == "json":
        formatter: logging.Formatter = JsonFormatter()
    elif journal_attached(stream, env):
        formatter = JournalFormatter()
    else:
        formatter = TextFormatter()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
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
