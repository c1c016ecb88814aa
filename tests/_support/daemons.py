"""Real `swarmd` processes for tests: each with its own state dir, socket and stderr log under one
root, ports from the OS (`--listen 127.0.0.1:0`, read back through `status`), always killed at the end.
The daemon, job, rebalance and security tests all start theirs through `Spawner`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from waiting import wait_for

from swarmd.client import ControlError, DaemonUnavailable, SyncClient
from swarmd.swarmproc import free_port

#: A daemon imports torch (through the transport) before it listens: seconds on a busy 2-core box.
START_TIMEOUT_S = 90.0


def base_env(**extra: str) -> dict[str, str]:
    """A clean environment: one torch thread, unbuffered logs, and this tree first on the path."""
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
    name: str = ""
    flags: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
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
        """Poll `status` until the daemon answers and has bootstrapped, or fail with its log."""
        try:
            self.status = wait_for(self._bootstrapped, timeout, f"swarmd {self.name!r} to be ready")
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{self.logs()}") from None
        return self.status

    def _bootstrapped(self) -> dict | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"swarmd exited with {self.proc.returncode}:\n{self.logs()}")
        if not self.socket.exists():
            return None
        try:
            status = self.client.status()
        except (DaemonUnavailable, ControlError):
            return None
        return status if status["bootstrap"]["state"] != "bootstrapping" else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


class Spawner:
    """`spawner(name, *flags, env={...}, ready=True, socket=None, log_level="debug", journal=False)`
    starts a daemon in `root/name` with `defaults` under its own environment; `restart` starts a
    stopped one again (same flags, state dir, identity); `close()` kills every one it started."""

    def __init__(self, root: Path, defaults: dict[str, str] | None = None, dir_mode: int = 0o777) -> None:
        self.root = root
        self.defaults = dict(defaults or {})
        self.dir_mode = dir_mode
        self.started: list[DaemonProcess] = []

    def __call__(self, name: str, *flags: str, env: dict[str, str] | None = None, ready: bool = True,
                 socket: Path | None = None, log_level: str | None = "debug",
                 journal: bool = False) -> DaemonProcess:
        home = self.root / name
        home.mkdir(mode=self.dir_mode, exist_ok=True)
        sock = socket or home / "swarmd.sock"
        log = home / "stderr.log"
        cmd = [sys.executable, "-m", "swarmd.cli", "--listen", "127.0.0.1:0", "--socket", str(sock),
               "--state-dir", str(home / "state"), "--device", "cpu", *flags]
        if log_level is not None:
            cmd += ["--log-level", log_level]
        extra = {**self.defaults, **(env or {})}
        with open(log, "wb") as err:
            if journal:  # as systemd does: JOURNAL_STREAM names the stderr it connected
                info = os.fstat(err.fileno())
                extra["JOURNAL_STREAM"] = f"{info.st_dev}:{info.st_ino}"
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=base_env(**extra))
        daemon = DaemonProcess(proc, sock, home / "state", log, name=name, flags=flags, env=dict(env or {}))
        self.started.append(daemon)
        if ready:
            daemon.wait_ready()
        return daemon

    start = __call__

    def together(self, names: list[str], *flags: str, env: dict[str, str] | None = None) -> list[DaemonProcess]:
        """Daemons started at once, the first on a port chosen here and the others bootstrapping
        through it (their bootstrap retry bridges its start): a test waits for one start, not one
        start per daemon in turn."""
        first = f"127.0.0.1:{free_port()}"
        daemons = [self(name, *flags, *(("--listen", first) if i == 0 else ("--bootstrap", first)), env=env,
                        ready=False) for i, name in enumerate(names)]
        for daemon in daemons:
            daemon.wait_ready()
        return daemons

    def restart(self, daemon: DaemonProcess) -> DaemonProcess:
        """Start a stopped daemon again with its flags and state dir (so the same identity)."""
        assert daemon.proc.poll() is not None
        daemon.log.rename(daemon.log.with_suffix(f".{len(self.started)}.log"))
        return self(daemon.name, *daemon.flags, env=daemon.env)

    def close(self) -> None:
        for daemon in self.started:
            daemon.stop()


def run_swarmctl(*args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = (),
                 timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """Run the real `swarmctl` console script (from this venv), output captured."""
    exe = str(Path(sys.executable).parent / "swarmctl")
    return subprocess.run([*prefix, exe, *args], capture_output=True, text=True, timeout=timeout,
                          env=base_env(**(env or {})))
