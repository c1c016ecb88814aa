"""Processes as /proc shows them: is one still running, its state letter, and which ones mention a
path (how the demo and chaos tests check that no daemon outlives its test)."""

from __future__ import annotations

import os
from pathlib import Path


def process_state(pid: int) -> str:
    """The kernel's one-letter state of a process ("T": stopped, "Z": zombie)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def running(pid: int) -> bool:
    """True while the process exists and is not a zombie (a zombie holds a pid, not resources)."""
    try:
        return process_state(pid) != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def processes_mentioning(text: str) -> list[int]:
    """Live processes (not this one, not zombies) whose command line contains `text`."""
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
