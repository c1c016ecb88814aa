"""Log lines: `<N>` priorities without timestamps on the journald stream, timestamps elsewhere, JSON."""

from __future__ import annotations

import io
import json
import logging
import os
import re

import pytest

from swarmd import logs


@pytest.fixture(autouse=True)
def restore_loggers():
    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level, logging.getLogger(n).propagate)
             for n in logs.PACKAGE_LOGGERS}
    yield
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


def journal_stream_of(fd: int) -> str:
    info = os.fstat(fd)
    return f"{info.st_dev}:{info.st_ino}"


def test_journald_stream_gets_priority_prefixes_and_no_timestamp(tmp_path) -> None:
    with open(tmp_path / "journal", "w+") as stream:
        logs.configure("debug", "text", stream=stream, env={"JOURNAL_STREAM": journal_stream_of(stream.fileno())})
        log = logging.getLogger("swarmd.test")
        log.debug("d")
        log.info("i")
        log.warning("w")
        log.error("two\nlines")
        stream.flush()
        stream.seek(0)
        assert stream.read().splitlines() == [
            "<7>swarmd.test: d", "<6>swarmd.test: i", "<4>swarmd.test: w", "<3>swarmd.test: two", "<3>lines",
        ]


def test_journal_stream_naming_another_file_is_ignored(tmp_path) -> None:
    """JOURNAL_STREAM inherited by a process whose stderr was redirected elsewhere: plain lines."""
    with open(tmp_path / "a", "w+") as stream, open(tmp_path / "b", "w") as other:
        logs.configure("info", "text", stream=stream, env={"JOURNAL_STREAM": journal_stream_of(other.fileno())})
        logging.getLogger("transport.x").info("hello")
        stream.flush()
        stream.seek(0)
        line = stream.read().strip()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO transport\.x: hello", line), line


def test_json_lines() -> None:
    stream = io.StringIO()
    logs.configure("info", "json", stream=stream, env={})
    logging.getLogger("swarmd.t").debug("hidden")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("swarmd.t").exception("failed %s", 3)
    (entry,) = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert entry["level"] == "error" and entry["logger"] == "swarmd.t" and entry["msg"] == "failed 3"
    assert "ValueError: boom" in entry["exc"] and isinstance(entry["ts"], float)


def test_set_level_changes_only_the_threshold() -> None:
    stream = io.StringIO()
    logs.configure("warning", "json", stream=stream, env={})
    logging.getLogger("swarmd.t").info("before")
    logs.set_level("info")
    logging.getLogger("swarmd.t").info("after")
    assert [json.loads(line)["msg"] for line in stream.getvalue().splitlines()] == ["after"]
