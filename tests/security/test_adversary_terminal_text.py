"""A remote peer's words reaching an operator's terminal through the control API, in one process
over a real Unix socket.

A trainer bans a peer with the peer's own error text as the reason (`RemoteError` carries a code
and message the remote chose, up to 4 KiB of any characters), and a trainer that fails says why
in the job's events (InputRefused quotes the refusing peer's message). `swarmctl job` and
`swarmctl logs` print them as they come, so a stranger's `\\x1b]0;...\\x07\\x1b[2J` rewrote the
operator's window title and cleared the screen, and a newline forged whole lines of output.
`job.get` and `job.logs` now escape every character that is not printable (the way `repr` does)
in what they answer; the end record's `by` was already refused unless printable
(swarmd/values.py), for the same reason.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from controlsock import serve_control

from swarmd.client import Client
from swarmd.train.trainer import BanRecord

HOSTILE = "busy: \x1b]0;owned\x07\x1b[2J\nbanned     stage 0 peer 0000 (127.0.0.1:1): forged line"
JOB_ID = b"j" * 32


class Jobs:
    job = SimpleNamespace(job_id=JOB_ID)

    async def find(self, name_or_id):
        return self.job

    async def describe(self, job) -> dict:
        return {"job": JOB_ID.hex(), "status": "waiting: every stage has peers", "stages": []}

    async def events(self, job, follow: bool):
        yield {"ts": 1.0, "kind": "done", "step": 0, "loss": None,
               "message": f"trainer 0 failed: 3 peers of stage 1 refused microbatch 1: {HOSTILE}"}


class View:
    jobs = Jobs()
    training = SimpleNamespace(bans=lambda job_id: [BanRecord(1, "ab" * 16, "127.0.0.1:9", HOSTILE, 1.0)])
    serving = SimpleNamespace(outliers=lambda job_id: [])


@pytest.fixture
async def served(tmp_path: Path):
    async with serve_control(tmp_path / "c.sock", View()) as path:
        yield path


def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


async def test_a_peers_text_reaches_job_get_and_job_logs_escaped(served: Path) -> None:
    async with Client(served, timeout=10) as client:
        job = await client.call("job.get", job=JOB_ID.hex())
        events = [event async for event in client.stream("job.logs", job=JOB_ID.hex(), follow=False)]
    for text in [*strings(job), *strings(events)]:
        assert text.isprintable(), repr(text)
    assert "\\x1b]0;owned\\x07" in job["banned"][0]["reason"] and "\\n" in events[0]["message"]


def test_the_text_and_journal_logs_escape_a_peers_control_characters() -> None:
    """The same reason in a log line: no ESC or BEL reaches the output, a traceback keeps its lines."""
    from swarmd.logs import JournalFormatter, TextFormatter

    record = logging.LogRecord("swarmd.train.trainer", logging.WARNING, __file__, 1, "banned stage %d peer %s: %s",
                               (1, "127.0.0.1:9", "busy: \x1b]0;owned\x07\x1b[2J\rgone"), None)
    for formatter in (TextFormatter(), JournalFormatter()):
        line = formatter.format(record)
        assert "\x1b" not in line and "\x07" not in line and "\r" not in line and "\\x1b]0;owned\\x07" in line
    traceback = logging.LogRecord("swarmd.supervisor", logging.ERROR, __file__, 1, "%s failed:\n%s",
                                  ("sync", "Traceback (most recent call last):\n  ValueError"), None)
    assert len(TextFormatter().format(traceback).splitlines()) == 3
