"""The demo tests' `procs` fixture: is a process still running, and which ones mention a path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from procfs import processes_mentioning, running


@pytest.fixture
def procs():
    return SimpleNamespace(running=running, processes_mentioning=processes_mentioning)
