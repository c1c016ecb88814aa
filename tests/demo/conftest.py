"""Helpers for the demo tests: is a process still running, and which ones mention a path."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest


def running(pid: int) -> bool:
    """True while the process exists and is not a zombie (a zombie holds a pid, not resources)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def processes_mentioning(text: str) -> list[int]:
    """Live processes (not ourselves) whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and running(int(entry.name)):
            found.append(int(entry.name))
    return found


@pytest.fixture
def procs():
    return SimpleNamespace(running=running, processes_mentioning=processes_mentioning)
