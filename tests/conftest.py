"""The one place tests/_support joins sys.path: pytest's importlib mode gives a test module no way to
import a conftest, so the shared daemon harness, spec builder and `wait_for` live there as plain
modules (`from daemons import Spawner`, `from waiting import wait_for`, `from jobspec import write_job`).

Rules checked around every test: one that starts swarmd code in a process is marked `slow`; one
leaves neither tracemalloc tracing nor a thread running (`threads.left_running`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest

SUPPORT = str(Path(__file__).parent / "_support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)

from threads import left_running  # noqa: E402 - importable once SUPPORT is on sys.path


#: What a test starts when it starts swarmd code: a daemon, swarmctl, a Python helper script (also
#: behind `setpriv` or `systemd-socket-activate`). A library's own helper (matplotlib's fc-list,
#: ctypes' ldconfig) is not the test's doing.
SWARMD_PROGRAMS = ("python", "swarmd", "swarmctl")

_running: pytest.Item | None = None  # the test being set up, run or torn down


def _runs_swarmd_code(args: object) -> bool:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)  # type: ignore[call-overload]
    names = (Path(os.fsdecode(arg)).name for arg in argv if isinstance(arg, (str, bytes, os.PathLike)))
    return any(name.startswith(SWARMD_PROGRAMS) for name in names)


def pytest_configure(config: pytest.Config) -> None:
    """A test that starts a process running swarmd code (in its body or in a fixture of any scope)
    must carry the `slow` marker, so `make test-fast` stays the quick inner loop; one that forgets
    fails, naming the command."""
    real_init = subprocess.Popen.__init__

    def guarded(self: subprocess.Popen, args: object, *rest: object, **kwargs: object) -> None:
        item = _running
        if item is not None and item.get_closest_marker("slow") is None and _runs_swarmd_code(args):
            raise AssertionError(f"{item.nodeid} starts a process ({args!r}) but is not marked slow")
        real_init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = guarded  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    global _running
    _running = item
    try:
        return (yield)
    finally:
        _running = None


@pytest.fixture(autouse=True)
def _tracemalloc_left_off() -> object:
    """A test that leaves tracemalloc tracing slows every later test several-fold and makes every later
    allocation bound measure the whole session's peak (a fuzz oracle once did both): stop it, and fail."""
    tracing_before = tracemalloc.is_tracing()
    yield
    if tracemalloc.is_tracing() and not tracing_before:
        tracemalloc.stop()
        pytest.fail("the test left tracemalloc tracing; stop what you start")



@pytest.fixture(autouse=True)
def _threads_joined() -> object:
    """A test that leaves a non-daemon thread, or a swarmd worker thread, running (a stage stopped
    without joining its compute threads, a pool never shut down) fails: such a thread keeps the
    process from exiting and runs on into later tests. Set up before and torn down after every
    other function fixture, so what the test's fixtures close is closed by then."""
    before = set(threading.enumerate())
    yield
    left = left_running(before)
    if left:
        pytest.fail(f"the test left threads running: {', '.join(sorted(t.name for t in left))}")
