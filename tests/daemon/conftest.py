"""Real `swarmd` processes for the daemon tests: each with its own state dir and socket, ports from
the OS (`--listen 127.0.0.1:0`, read back through `status`), and always killed at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pytest

from swarmd.client import ControlError, DaemonUnavailable, SyncClient
# Below the ephemeral range: an OS-assigned port can be taken by an outgoing connection before the
# daemon that was told it binds it.
from swarmd.swarmproc import free_port

#: A daemon imports torch (through the transport) before it listens: seconds on a busy 2-core box.
START_TIMEOUT_S = 90.0


def base_env(**extra: str) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    env.update(extra)
    return env


@dataclass
class DaemonProcess:
    proc: subprocess.Popen
    socket: Path
    state_dir: Path
    log: Path
    status: dict = field(default_factory=dict)

    @property
    def client(self) -> SyncClient:
        return SyncClient(self.socket, timeout=20)

    @property
    def address(self) -> str:
        return self.status["announce"]

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> dict:
        """Poll `status` until the daemon answers (and has bootstrapped), or fail with its log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"swarmd exited with {self.proc.returncode}:\n{self.logs()}")
            if self.socket.exists():
                try:
                    self.status = self.client.status()
                    if self.status["bootstrap"]["state"] != "bootstrapping":
                        return self.status
                except (DaemonUnavailable, ControlError):
                    pass
            time.sleep(0.2)
        raise AssertionError(f"swarmd not ready within {timeout} s:\n{self.logs()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


class Spawner:
    """start(name, *flags, env={...}, ready=True, socket=None, log_level="debug", journal=False)
    starts a daemon under `root`; close() kills every one it started."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[DaemonProcess] = []

    def __call__(self, name: str, *flags: str, env: dict[str, str] | None = None, ready: bool = True,
                 socket: Path | None = None, log_level: str | None = "debug",
                 journal: bool = False) -> DaemonProcess:
        home = self.root / name
        home.mkdir(exist_ok=True)
        sock = socket or home / "swarmd.sock"
        log = home / "stderr.log"
        cmd = [sys.executable, "-m", "swarmd.cli", "--listen", "127.0.0.1:0", "--socket", str(sock),
               "--state-dir", str(home / "state"), "--device", "cpu", *flags]
        if log_level is not None:
            cmd += ["--log-level", log_level]
        env = dict(env or {})
        with open(log, "wb") as err:
            if journal:  # as systemd does: JOURNAL_STREAM names the stderr it connected
                info = os.fstat(err.fileno())
                env["JOURNAL_STREAM"] = f"{info.st_dev}:{info.st_ino}"
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=base_env(**env))
        daemon = DaemonProcess(proc, sock, home / "state", log)
        self.started.append(daemon)
        if ready:
            daemon.wait_ready()
        return daemon

    def close(self) -> None:
        for daemon in self.started:
            daemon.stop()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawner]:
    spawner = Spawner(tmp_path)
    try:
        yield spawner
    finally:
        spawner.close()


@pytest.fixture(scope="module")
def spawn_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Spawner]:
    """Like `spawn`, for daemons shared by the tests of one module."""
    spawner = Spawner(tmp_path_factory.mktemp("daemons"))
    try:
        yield spawner
    finally:
        spawner.close()


def run_swarmctl(*args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = (),
                 timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """Run the real `swarmctl` console script (from this venv)."""
    exe = str(Path(sys.executable).parent / "swarmctl")
    return subprocess.run([*prefix, exe, *args], capture_output=True, text=True, timeout=timeout,
                          env=base_env(**(env or {})))


@pytest.fixture(name="free_port")
def free_port_fixture() -> Callable[[], int]:
    return free_port


@pytest.fixture
def swarmctl() -> Callable[..., subprocess.CompletedProcess[str]]:
    """swarmctl(*args, env=..., prefix=("setpriv", ...)) runs the console script, output captured."""
    return run_swarmctl
