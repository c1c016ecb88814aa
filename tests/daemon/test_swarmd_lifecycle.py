"""A daemon under a systemd-like supervisor: sd_notify, watchdog, drain on SIGTERM, bootstrap
failures, socket activation, SIGHUP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procfs import process_state
from waiting import wait_for

from swarmd.client import SyncClient
from swarmd.exitcodes import EXIT_BOOTSTRAP, EXIT_FORCED, EXIT_OK

pytestmark = pytest.mark.slow

WATCHDOG_USEC = 1_000_000  # pings every 0.5 s
DRAIN_TIMEOUT_S = 5.0


def fields(datagram: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in datagram.decode().splitlines())


def test_notify_ready_watchdog_stopping_and_clean_exit(spawn, tmp_path: Path, free_port) -> None:
    """1. Bind a datagram socket, start swarmd with NOTIFY_SOCKET pointing at it, WATCHDOG_USEC=1 s,
          and a bootstrap peer nobody listens on.
       2. READY=1 arrives (the daemon runs alone rather than waiting for the swarm) and the log
          names the unreachable peer and the retry.
       3. Over 3 s, WATCHDOG=1 arrives every 0.5 s (6 pings, 4..7 on a loaded machine).
       4. SIGTERM: STOPPING=1 arrives and the process exits 0 within the drain timeout."""
    notify_path = tmp_path / "notify.sock"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(notify_path))
    receiver.settimeout(120)
    nowhere = f"127.0.0.1:{free_port()}"
    with receiver:
        d = spawn("n", "--bootstrap", nowhere, "--drain-timeout", str(DRAIN_TIMEOUT_S), ready=False,
                  env={"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": str(WATCHDOG_USEC)})
        while "READY" not in (ready := fields(receiver.recv(4096))):
            pass
        assert ready["READY"] == "1" and ready["MAINPID"] == str(d.proc.pid)
        assert "no bootstrap peer answers" in ready["STATUS"]
        wait_for(lambda: f"none of {nowhere} answered; running alone, retrying" in d.logs(), 30,
                 "the daemon to say it runs alone", interval=0.05, detail=d.logs)

        receiver.settimeout(0.2)
        pings, started = 0, time.monotonic()
        while time.monotonic() - started < 3.0:
            try:
                pings += fields(receiver.recv(4096)).get("WATCHDOG") == "1"
            except TimeoutError:
                pass
        print(f"{pings} watchdog pings in 3 s at WATCHDOG_USEC={WATCHDOG_USEC}")
        assert 4 <= pings <= 7, pings  # 6 expected; one late turn of a loaded loop may cost one

        receiver.settimeout(30)
        stopped_at = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        while "STOPPING" not in (msg := fields(receiver.recv(4096))):
            pass
        assert msg["STOPPING"] == "1"
        assert d.proc.wait(timeout=DRAIN_TIMEOUT_S + 5) == EXIT_OK
        print(f"drained and exited in {time.monotonic() - stopped_at:.2f} s")
        assert time.monotonic() - stopped_at < DRAIN_TIMEOUT_S
        assert not d.socket.exists()


def test_require_bootstrap_gives_up_with_its_own_status(spawn, free_port) -> None:
    """With --require-bootstrap and no peer answering, the daemon retries, then exits 3. Its stderr
    is the stream JOURNAL_STREAM names, so every line carries a syslog priority and no timestamp."""
    d = spawn("r", "--bootstrap", f"127.0.0.1:{free_port()}", "--require-bootstrap", ready=False,
              log_level="info", journal=True,
              env={"SWARMD_NETWORK_REQUIRE_BOOTSTRAP_TIMEOUT_S": "1.5",
                   "SWARMD_NETWORK_BOOTSTRAP_RETRY_INITIAL_S": "0.2"})
    assert d.proc.wait(timeout=120) == EXIT_BOOTSTRAP
    lines = d.logs().splitlines()
    assert "<3>swarmd.daemon: no bootstrap peer answered within 1.5 s and network.require_bootstrap is set" in lines
    assert any(line.startswith("<4>swarmd.daemon: bootstrap: none of") for line in lines)
    assert all(line[:3] in ("<6>", "<4>", "<3>") for line in lines), lines


def test_socket_activation_serves_on_the_passed_socket(tmp_path: Path) -> None:
    """systemd-socket-activate binds the control socket and starts swarmd with LISTEN_FDS=1 on the
    first connection; the daemon serves on fd 3 and leaves the file to its owner on exit."""
    path = tmp_path / "activated.sock"
    passed_env = [f"{k}={os.environ[k]}" for k in ("PATH", "HOME", "PYTHONPATH") if k in os.environ]
    cmd = ["systemd-socket-activate", "-l", str(path), "-E", "OMP_NUM_THREADS=1",
           *(arg for pair in passed_env for arg in ("-E", pair)), sys.executable, "-m", "swarmd.cli", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "st"),
           "--socket", str(tmp_path / "unused.sock"), "--device", "cpu"]
    log = tmp_path / "stderr.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    try:
        def listening() -> bool:
            assert proc.poll() is None, log.read_text()
            return path.exists()

        wait_for(listening, 30, "systemd-socket-activate to bind the socket", interval=0.05, detail=log.read_text)
        status = SyncClient(path, timeout=120).status()  # this connection starts the daemon
        assert status["control_socket"] == str(path)
        assert not (tmp_path / "unused.sock").exists()
        assert "using the control socket passed by systemd" in log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == EXIT_OK, log.read_text()


def test_sighup_reloads_the_log_level_and_a_second_signal_exits_at_once(spawn, tmp_path: Path) -> None:
    """1. Start at level warning from the file; rewrite the file with level info and a new bootstrap
          list; SIGHUP: the new level applies at once (info lines appear), the [network] change is
          reported as waiting for a restart, and the daemon keeps serving.
       2. Stop the process, queue SIGTERM and SIGINT, continue it: the loop sees both signals in one
          turn, so the second arrives before the drain has begun, and the daemon leaves at once with
          EXIT_FORCED instead of draining."""
    config = tmp_path / "swarmd.toml"
    config.write_text('[log]\nlevel = "warning"\n')
    d = spawn("h", "--config", str(config), log_level=None)
    assert " INFO " not in d.logs()
    config.write_text('[log]\nlevel = "info"\n[network]\nbootstrap = ["127.0.0.1:1"]\n')
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "take effect at the next restart" in d.logs(), 30, "the SIGHUP to be handled", interval=0.1,
             detail=d.logs)
    assert "SIGHUP: log level is now info" in d.logs() and "[network]" in d.logs()
    assert d.client.status()["pid"] == d.proc.pid

    d.proc.send_signal(signal.SIGSTOP)
    # kill() returns before the stop takes effect; a signal sent to a still-running process would
    # be handled on its own, one loop turn apart from the next.
    wait_for(lambda: process_state(d.proc.pid) == "T", 30, "the daemon to stop", interval=0.01)
    d.proc.send_signal(signal.SIGTERM)
    d.proc.send_signal(signal.SIGINT)
    d.proc.send_signal(signal.SIGCONT)
    assert d.proc.wait(timeout=30) == EXIT_FORCED
    assert "exiting now without finishing the drain" in d.logs()
    assert "stopped (exit status" not in d.logs()
