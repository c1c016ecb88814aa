"""Real `swarmd` processes for the job tests, each with its own state dir, in a directory that the
unprivileged user of the permission test (`nobody`) may enter; always killed at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from swarmd.client import ControlError, DaemonUnavailable, SyncClient

#: A daemon imports torch before it listens: seconds on a busy 2-core box.
START_TIMEOUT_S = 90.0
#: Fast discovery, so a second daemon finds the first one's records within a second or two. The
#: tests pin stages by hand (`swarmctl serve`) unless they ask for automatic joining themselves.
FAST = {"SWARMD_PEERS_PING_INTERVAL_S": "0.5", "SWARMD_PEERS_DISCOVERY_INTERVAL_S": "1",
        "SWARMD_NETWORK_BOOTSTRAP_RETRY_INITIAL_S": "0.3", "SWARMD_NETWORK_BOOTSTRAP_RETRY_MAX_S": "1",
        "SWARMD_JOBS_SERVE": "none", "SWARMD_JOBS_JOIN_INTERVAL_S": "0.5"}


@dataclass
class JobDaemon:
    proc: subprocess.Popen
    socket: Path
    log: Path
    name: str = ""
    flags: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    status: dict = field(default_factory=dict)

    @property
    def client(self) -> SyncClient:
        return SyncClient(self.socket, timeout=20)

    def wait_ready(self) -> dict:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"swarmd exited with {self.proc.returncode}:\n{self.log.read_text()}")
            if self.socket.exists():
                try:
                    self.status = self.client.status()
                    if self.status["bootstrap"]["state"] != "bootstrapping":
                        return self.status
                except (DaemonUnavailable, ControlError):
                    pass
            time.sleep(0.2)
        raise AssertionError(f"swarmd not ready within {START_TIMEOUT_S} s:\n{self.log.read_text()}")


class Swarm:
    """start(name, *flags) starts a daemon under `root`; close() kills every one it started."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[JobDaemon] = []

    def start(self, name: str, *flags: str, env: dict[str, str] | None = None) -> JobDaemon:
        home = self.root / name
        home.mkdir(mode=0o755, exist_ok=True)
        sock, log = home / "swarmd.sock", home / "stderr.log"
        cmd = [sys.executable, "-m", "swarmd.cli", "--listen", "127.0.0.1:0", "--socket", str(sock),
               "--state-dir", str(home / "state"), "--device", "cpu", "--log-level", "debug", *flags]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **FAST, **(env or {})}
        if "PYTHONPATH" in os.environ:
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        with open(log, "wb") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        daemon = JobDaemon(proc, sock, log, name=name, flags=flags, env=dict(env or {}))
        self.started.append(daemon)
        daemon.wait_ready()
        return daemon

    def restart(self, daemon: JobDaemon) -> JobDaemon:
        """Start a stopped daemon again with its flags and state dir (so the same identity)."""
        assert daemon.proc.poll() is not None
        daemon.log.rename(daemon.log.with_suffix(f".{len(self.started)}.log"))
        return self.start(daemon.name, *daemon.flags, env=daemon.env)

    def close(self) -> None:
        for daemon in self.started:
            if daemon.proc.poll() is None:
                daemon.proc.send_signal(signal.SIGKILL)
            daemon.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def swarm_root() -> Iterator[Path]:
    """A directory `nobody` may enter (pytest's own tmp dirs are 0700)."""
    root = Path(tempfile.mkdtemp(prefix="swarmd-jobs-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)


@pytest.fixture(scope="module")
def swarm(swarm_root: Path) -> Iterator[Swarm]:
    daemons = Swarm(swarm_root)
    try:
        yield daemons
    finally:
        daemons.close()


def run_swarmctl(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run the real `swarmctl` console script from this venv."""
    exe = str(Path(sys.executable).parent / "swarmctl")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp", "NO_COLOR": "1"}
    return subprocess.run([*prefix, exe, *args], capture_output=True, text=True, timeout=90, env=env)


@pytest.fixture(scope="session")
def swarmctl():
    return run_swarmctl
