"""The one place tests/_support joins sys.path: pytest's importlib mode gives a test module no way to
import a conftest, so the shared daemon harness, spec builder and `wait_for` live there as plain
modules (`from daemons import Spawner`, `from waiting import wait_for`, `from jobspec import write_job`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SUPPORT = str(Path(__file__).parent / "_support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)


#: What a test starts when it starts swarmd code: a daemon, swarmctl, a Python helper script. A
#: library's own helper (matplotlib's fc-list, ctypes' ldconfig) is not the test's doing.
SWARMD_PROGRAMS = ("python", "swarmd", "swarmctl")


def _runs_swarmd_code(args: object) -> bool:
    program = args if isinstance(args, (str, bytes, Path)) else next(iter(args), "")  # type: ignore[call-overload]
    name = Path(os.fsdecode(program).split()[0] if program else "").name
    return name.startswith(SWARMD_PROGRAMS)


@pytest.fixture(autouse=True)
def _a_process_makes_a_test_slow(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that starts a process running swarmd code must carry the `slow` marker, so
    `make test-fast` stays the quick inner loop; one that forgets fails here, naming the command."""
    if request.node.get_closest_marker("slow") is not None:
        return
    real_init = subprocess.Popen.__init__

    def guarded(self: subprocess.Popen, args: object, *rest: object, **kwargs: object) -> None:
        if _runs_swarmd_code(args):
            raise AssertionError(f"{request.node.nodeid} starts a process ({args!r}) but is not marked slow")
        real_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
