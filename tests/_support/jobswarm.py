"""Real `swarmd` processes for the job, rebalance and security tests, each with its own state dir, in
a directory that the unprivileged user of the permission test (`nobody`) may enter; always killed at
the end. The fixtures (`swarm_root`, `swarm`, `swarmctl`, `kit`) are imported by those folders'
conftests; `kit` carries the small job they train, waiting, submitting a job and placing its stages,
and the check that every committed step holds the whole global batch."""

from __future__ import annotations

import functools
import json
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator

import pytest
from daemons import DaemonProcess, Spawner, run_swarmctl
from jobspec import TINY_JOB, job_spec, write_job
from waiting import wait_for

from swarmd.exitcodes import EXIT_OK

#: Fast discovery, so a second daemon finds the first one's records within a second or two. The
#: tests pin stages by hand (`swarmctl serve`) unless they ask for automatic joining themselves.
FAST = {"SWARMD_PEERS_PING_INTERVAL_S": "0.5", "SWARMD_PEERS_DISCOVERY_INTERVAL_S": "1",
        "SWARMD_NETWORK_BOOTSTRAP_RETRY_INITIAL_S": "0.3", "SWARMD_NETWORK_BOOTSTRAP_RETRY_MAX_S": "1",
        "SWARMD_JOBS_SERVE": "none", "SWARMD_JOBS_JOIN_INTERVAL_S": "0.5"}
JobDaemon = DaemonProcess


class Swarm(Spawner):
    """The shared daemon harness with FAST discovery, in directories `nobody` may enter."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, defaults=FAST, dir_mode=0o755)


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


@pytest.fixture(scope="session")
def swarmctl():
    """swarmctl(*args, prefix=...) as a user with no home of its own would run it."""
    return functools.partial(run_swarmctl, env={"HOME": "/tmp", "NO_COLOR": "1"})


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


Ctl = Callable[..., "subprocess.CompletedProcess[str]"]


def on_socket(swarmctl: Ctl) -> Ctl:
    """`swarmctl` (the fixture) as `ctl(daemon, *args)`: run against that daemon's control socket."""
    return lambda daemon, *args: swarmctl("--socket", str(daemon.socket), *args)


def submit_and_serve(ctl: Ctl, spec_path: Path, placement: list[tuple[JobDaemon, int]]) -> str:
    """Submit the job with no trainers on the first daemon of `placement`, wait until every other
    daemon there has learned it from the DHT, then have each (daemon, stage) pair serve that stage,
    in order; return the job id. `ctl(daemon, *args)` runs swarmctl against that daemon."""
    submitter = placement[0][0]
    submitted = ctl(submitter, "--json", "submit", "--trainers", "0", str(spec_path))
    assert submitted.returncode == EXIT_OK, submitted.stderr
    job_id = json.loads(submitted.stdout)["job"]
    for daemon in {d.name: d for d, _ in placement if d is not submitter}.values():
        wait_for(lambda: any(j["job"] == job_id for j in daemon.client.jobs()), 30, f"{daemon.name} to learn the job",
                 interval=0.5)
    for daemon, stage in placement:
        done = ctl(daemon, "serve", job_id, "--stage", str(stage))
        assert done.returncode == EXIT_OK, done.stderr
    return job_id


@pytest.fixture(scope="session")
def kit() -> SimpleNamespace:
    """The helpers above (pytest's importlib mode cannot import conftest from a test module)."""
    return SimpleNamespace(FAST=FAST, TINY_JOB=TINY_JOB, job_spec=job_spec, write_job=write_job, wait_for=wait_for,
                           finished=finished, step_events=step_events, whole_steps=whole_steps,
                           on_socket=on_socket, submit_and_serve=submit_and_serve)
