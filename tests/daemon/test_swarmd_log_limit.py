"""The per-source limit on warning lines (issue 13, hole 8): a peer that sends junk on purpose must
not write the log at its own pace, and what was dropped is counted."""

from __future__ import annotations

import io
import logging

from swarmd import logs


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def logger_with(limit: logs.SourceRateLimit) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(limit)
    logger = logging.getLogger("test.log_limit")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger, stream


def test_a_thousand_warnings_about_one_source_write_five_lines_then_a_count():
    clock = Clock()
    limit = logs.SourceRateLimit(logs.WarningLimit(per_source=5, window_s=60.0), clock)
    logger, stream = logger_with(limit)
    for i in range(1000):
        logger.warning("closing connection from %s: %s", ("203.0.113.9", 40000 + i), "bad magic")
        logger.warning("refused control connection from pid %s uid %s", i, 65534, extra={"source": "uid 65534"})
    logger.warning("closing connection from %s: %s", ("198.51.100.1", 1), "bad magic")  # another source
    logger.error("an error is never dropped %s", ("203.0.113.9", 1))
    logger.warning("no remote source: never dropped")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 5 + 5 + 1 + 1 + 1 and limit.suppressed == 2 * 995
    clock.now = 61.0
    logger.warning("closing connection from %s: %s", ("203.0.113.9", 1), "bad magic")
    last = stream.getvalue().splitlines()[-1]
    assert last.endswith("bad magic [995 more such lines about 203.0.113.9 were dropped]"), last


def test_sources_remembered_are_bounded():
    limit = logs.SourceRateLimit(logs.WarningLimit(per_source=1, window_s=60.0, sources=100), Clock())
    logger, stream = logger_with(limit)
    for i in range(1000):
        logger.warning("closing connection from %s: %s", (f"10.0.{i // 256}.{i % 256}", 1), "x")
    assert len(limit._windows) == 100 and len(stream.getvalue().splitlines()) == 1000


def test_a_percent_in_a_source_does_not_break_the_line():
    clock = Clock()
    limit = logs.SourceRateLimit(logs.WarningLimit(per_source=1, window_s=1.0), clock)
    logger, stream = logger_with(limit)
    for _ in range(3):
        logger.warning("from %s", ("fe80::1%eth0", 1))
    clock.now = 2.0
    logger.warning("from %s", ("fe80::1%eth0", 1))
    assert stream.getvalue().splitlines()[-1].endswith("[2 more such lines about fe80::1%eth0 were dropped]")
