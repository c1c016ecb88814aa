"""No daemon outlives a program that started a LocalSwarm: Ctrl-C, SIGTERM, even SIGKILL of the parent.

Each test runs a demo-like parent process (real `swarmd` daemons, real signals) and then looks for
every daemon's pid, and for any process whose command line mentions the test's directory."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PARENT = """
import json, sys, time
from swarmd.swarmproc import LocalSwarm, install_signal_handlers
install_signal_handlers()
swarm = LocalSwarm(sys.argv[1])
wait = sys.argv[2] == "ready"
peers = swarm.start(2, wait=wait)
print(json.dumps([p.pid for p in peers]), flush=True)
while True:
    time.sleep(0.1)
"""


def as_in_the_foreground() -> None:
    """A child as a shell starts a foreground command: SIGINT at its default. Run in the background
    (`make test &`), this test's process and its children inherit SIGINT ignored, which
    `install_signal_handlers` then leaves ignored (tested below)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_parent(root: Path, when: str, preexec=as_in_the_foreground) -> tuple[subprocess.Popen, list[int]]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(root), when], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, preexec_fn=preexec)
    line = parent.stdout.readline()
    assert line, f"the parent printed nothing; stderr:\n{parent.stderr.read()}"
    return parent, json.loads(line)


def wait_gone(pids: list[int], procs, timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [pid for pid in pids if procs.running(pid)]
        if not left:
            return []
        time.sleep(0.1)
    return [pid for pid in pids if procs.running(pid)]


@pytest.mark.parametrize("sig, when", [(signal.SIGINT, "ready"), (signal.SIGTERM, "starting")])
def test_signal_to_the_parent_stops_every_daemon(tmp_path: Path, procs, sig: int, when: str) -> None:
    """1. The parent starts two daemons (waiting until both joined, or not at all) and prints their pids.
       2. Send it SIGINT (Ctrl-C) or SIGTERM.
       Expected: the parent exits by that signal's usual route (KeyboardInterrupt, or killed by the
       signal), both daemons are gone, and no process mentions the test's directory."""
    parent, pids = start_parent(tmp_path, when)
    assert all(procs.running(pid) for pid in pids)
    parent.send_signal(sig)
    parent.wait(timeout=30)
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in parent.stderr.read()
    else:
        assert parent.returncode == -sig
    assert wait_gone(pids, procs) == []
    assert procs.processes_mentioning(str(tmp_path)) == []


def test_sigkill_of_the_parent_takes_its_daemons_along(tmp_path: Path, procs) -> None:
    """1. The parent starts two daemons and waits until both joined.
       2. SIGKILL the parent: no handler, no atexit runs.
       Expected: the kernel kills both daemons (PR_SET_PDEATHSIG set by the trampoline) within seconds."""
    parent, pids = start_parent(tmp_path, "ready")
    parent.kill()
    parent.wait(timeout=30)
    assert wait_gone(pids, procs) == []
    assert procs.processes_mentioning(str(tmp_path)) == []


def test_ctrl_c_of_the_demo_itself_leaves_nothing(tmp_path: Path, procs) -> None:
    """1. Run `python -m swarmd.demo` (four daemons) and wait until its first daemon writes a log.
       2. Send it SIGINT while the swarm is starting.
       Expected: exit status 130, a line saying every peer was stopped, and no process left that
       mentions the demo's output directory."""
    out = tmp_path / "out"
    demo = subprocess.Popen([sys.executable, "-m", "swarmd.demo", "--peers", "3", "--out", str(out), "--no-baseline"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=as_in_the_foreground)
    deadline = time.monotonic() + 60
    while not (out / "swarm" / "peer3" / "stderr.log").exists():
        assert demo.poll() is None and time.monotonic() < deadline, demo.communicate()
        time.sleep(0.05)
    assert procs.processes_mentioning(str(out)) != []
    demo.send_signal(signal.SIGINT)
    _, err = demo.communicate(timeout=30)
    assert demo.returncode == 130, err
    assert "every peer it started has been stopped" in err
    time.sleep(0.5)
    assert procs.processes_mentioning(str(out)) == []


def test_a_parent_started_with_sigint_ignored_keeps_it_ignored(tmp_path: Path, procs) -> None:
    """1. Start the parent as a shell starts a background job: SIGINT ignored.
       2. Send it SIGINT, then SIGTERM.
       Expected: SIGINT changes nothing (before: the handler tore both daemons down and the
       parent went on without them); SIGTERM still stops the parent and both daemons."""
    parent, pids = start_parent(tmp_path, "ready", preexec=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    parent.send_signal(signal.SIGINT)
    with pytest.raises(subprocess.TimeoutExpired):
        parent.wait(timeout=1.0)  # the only way to see "nothing happened" is to give it a moment
    assert all(procs.running(pid) for pid in pids)
    parent.send_signal(signal.SIGTERM)
    parent.wait(timeout=30)
    assert parent.returncode == -signal.SIGTERM
    assert wait_gone(pids, procs) == []
