"""Real `swarmd` processes for the job tests, each with its own state dir, in a directory that the
unprivileged user of the permission test (`nobody`) may enter; always killed at the end. The `kit`
fixture carries what the daemon tests share besides: the small job they train, waiting, and the
check that every committed step holds the whole global batch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator, TypeVar

import pytest

from swarmd.client import ControlError, DaemonUnavailable, SyncClient

#: A daemon imports torch before it listens: seconds on a busy 2-core box.
START_TIMEOUT_S = 90.0
#: Fast discovery, so a second daemon finds the first one's records within a second or two. The
#: tests pin stages by hand (`swarmctl serve`) unless they ask for automatic joining themselves.
FAST = {"SWARMD_PEERS_PING_INTERVAL_S": "0.5", "SWARMD_PEERS_DISCOVERY_INTERVAL_S": "1",
        "SWARMD_NETWORK_BOOTSTRAP_RETRY_INITIAL_S": "0.3", "SWARMD_NETWORK_BOOTSTRAP_RETRY_MAX_S": "1",
        "SWARMD_JOBS_SERVE": "none", "SWARMD_JOBS_JOIN_INTERVAL_S": "0.5"}
#: The job most daemon tests train: three one-layer stages of a 32-wide transformer, plain SGD;
#: small enough that a step takes well under a second on a busy box. `job_spec` merges a test's
#: own settings over it.
TINY_JOB: dict[str, dict] = {
    "model": {"arch": "transformer-lm", "d_model": 32, "n_heads": 2, "layers_per_stage": 1, "vocab": 256},
    "data": {"seq_len": 16},
    "batch": {"global_samples": 4, "microbatch_samples": 2},
    "optim": {"name": "sgd", "lr": 0.05, "schedule": "constant"},
    "pipeline": {"stages": 3},
}
T = TypeVar("T")


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


def job_spec(name: str, *, seed: int, steps: int, corpus: Path, **sections: dict) -> str:
    """TOML of TINY_JOB training on `corpus`, each of `sections` merged key by key over its section
    (or added, when TINY_JOB has no such section)."""
    merged = {section: dict(values) for section, values in TINY_JOB.items()}
    for section, values in sections.items():
        merged.setdefault(section, {}).update(values)
    merged["data"]["files"] = [str(corpus)]
    lines = [f"name = {_toml(name)}", f"seed = {seed}", f"steps = {steps}"]
    for section, values in merged.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(map(_toml, value)) + "]"
    raise TypeError(f"no TOML form for {value!r} in a test job spec")


def write_job(where: Path, name: str, *, copies: int = 4, file: str | None = None, **spec) -> tuple[Path, Path]:
    """Write a corpus (the stdlib's json module source, `copies` times: real text, always there)
    and the job's spec under `where`, both named `file` (default: the job's name); return both."""
    stem = file or name
    data, spec_path = where / f"{stem}.txt", where / f"{stem}.toml"
    data.write_text(Path(json.__file__).read_text() * copies)
    spec_path.write_text(job_spec(name, corpus=data, **spec))
    return data, spec_path


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.3) -> T:
    """Poll until `predicate` returns something truthy and return it; fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(interval)


def finished(daemon: JobDaemon, job_id: str) -> dict | None:
    """The job as `daemon` reports it once done or failed; None while it still trains or waits."""
    job = daemon.client.job(job_id)
    return job if job["state"] in ("done", "failed") else None


def step_events(daemon: JobDaemon, job_id: str) -> list[dict]:
    return [e for e in daemon.client.logs(job_id) if e["kind"] == "step"]


def whole_steps(events: list[dict], global_samples: int, microbatch_samples: int) -> int:
    """Assert that every stage record read back holds the whole global batch (re-sent microbatches
    counted apart as duplicates); return how many records were read back (-1: not in time)."""
    known = 0
    for event in events:
        print(f"step {event['step']}: stage samples {event['stage_samples']}, duplicates {event['duplicates']}, "
              f"retries {event['retries']}")
        for samples, duplicates in zip(event["stage_samples"], event["duplicates"]):
            if samples >= 0 and duplicates >= 0:
                known += 1
                assert samples - duplicates * microbatch_samples == global_samples, event
    return known


@pytest.fixture(scope="session")
def kit() -> SimpleNamespace:
    """The helpers above (pytest's importlib mode cannot import conftest from a test module)."""
    return SimpleNamespace(FAST=FAST, TINY_JOB=TINY_JOB, job_spec=job_spec, write_job=write_job, wait_for=wait_for,
                           finished=finished, step_events=step_events, whole_steps=whole_steps)
