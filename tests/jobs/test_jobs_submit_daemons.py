"""`swarmctl submit/jobs/job/logs/cancel` against two real daemons on loopback: bad specs are refused
naming the field, data the submitting uid may not read is refused, and a submitted job is published
in the DHT so the other daemon lists it and reports which stages have no peers."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from jobspec import job_spec
from waiting import wait_for

from swarmd.exitcodes import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK

pytestmark = pytest.mark.slow

def write_spec(where: Path, name: str = "tiny", *, arch: str = "transformer-lm", files: tuple[str, ...] = ("data.txt",),
               global_samples: int = 4, stages: int = 3) -> Path:
    """TINY_JOB with swarmd's default optimizer (no [optim]), readable by every user."""
    path = where / f"{name}.toml"
    path.write_text(job_spec(name, seed=3, steps=5, files=list(files), model={"arch": arch},
                             batch={"global_samples": global_samples}, optim=None, pipeline={"stages": stages}))
    path.chmod(0o644)
    return path


@pytest.fixture(scope="module")
def pair(swarm, swarm_root: Path):
    a, b = swarm.together(["a", "b"])
    data = swarm_root / "data.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 200)
    data.chmod(0o644)
    return a, b


@pytest.mark.parametrize("bad, field", [
    ({"arch": "no-such-arch"}, "model.arch"),
    ({"stages": 0}, "pipeline.stages"),
    ({"global_samples": 5}, "batch.global_samples"),
    ({"files": ("missing-*.txt",)}, "data.files"),
])
def test_bad_specs_are_refused_naming_the_field(pair, swarmctl, swarm_root: Path, bad: dict, field: str) -> None:
    a, _ = pair
    spec = write_spec(swarm_root, "bad", **bad)
    result = swarmctl("--socket", str(a.socket), "submit", str(spec))
    print(result.stderr.strip())
    assert result.returncode == EXIT_FAILURE and result.stdout == ""
    assert result.stderr.startswith(f"swarmctl: bad_request: {field}: ")
    result = swarmctl("--socket", str(a.socket), "--json", "submit", str(spec))
    error = json.loads(result.stderr)["error"]
    assert result.returncode == EXIT_FAILURE and error["code"] == "bad_request" and error["message"].startswith(field)
    assert a.client.jobs() == [] or all(j["name"] != "bad" for j in a.client.jobs())


def test_unparsable_spec_file_is_a_usage_error(pair, swarmctl, swarm_root: Path) -> None:
    a, _ = pair
    spec = swarm_root / "broken.toml"
    spec.write_text("name = \n")  # by hand: the point is a file that is not TOML
    result = swarmctl("--socket", str(a.socket), "submit", str(spec))
    assert result.returncode == EXIT_CONFIG and "not valid TOML" in result.stderr


def test_data_the_submitting_user_cannot_read_is_refused(pair, swarmctl, swarm_root: Path) -> None:
    """`nobody` is admitted to the socket (through its group) but may not read a 0600 root file;
    the daemon, running as root, could: it must refuse on the submitter's behalf. The same user
    submitting a readable file is accepted."""
    a, _ = pair
    os.chown(a.socket, 0, 65534)  # group nogroup: nobody is admitted by its primary group
    secret = swarm_root / "secret.txt"
    secret.write_text("root only\n" * 100)
    secret.chmod(0o600)
    nobody = ("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups")
    spec = write_spec(swarm_root, "secret", files=(str(secret),))
    result = swarmctl("--socket", str(a.socket), "submit", str(spec), prefix=nobody)
    print(result.stderr.strip())
    assert result.returncode == EXIT_FAILURE
    assert result.stderr.startswith("swarmctl: forbidden: data: uid 65534 may not read ") and str(secret) in result.stderr
    assert all(j["name"] != "secret" for j in a.client.jobs())

    spec = write_spec(swarm_root, "public")
    result = swarmctl("--socket", str(a.socket), "--json", "submit", "--trainers", "0", str(spec), prefix=nobody)
    assert result.returncode == EXIT_OK, result.stderr
    assert json.loads(result.stdout)["name"] == "public"

    secret.chmod(0o640)
    os.chown(secret, 0, 65534)  # readable through the group now
    spec = write_spec(swarm_root, "grouped", files=(str(secret),))
    assert swarmctl("--socket", str(a.socket), "submit", "--trainers", "0", str(spec), prefix=nobody).returncode == EXIT_OK


def test_submitted_job_is_found_through_the_dht(pair, swarmctl, swarm_root: Path) -> None:
    a, b = pair
    spec = write_spec(swarm_root, "tiny")
    result = swarmctl("--socket", str(a.socket), "--json", "submit", "--trainers", "0", str(spec))
    assert result.returncode == EXIT_OK, result.stderr
    reply = json.loads(result.stdout)
    job_id = reply["job"]
    assert reply == {"job": job_id, "name": "tiny", "stages": 3} and len(bytes.fromhex(job_id)) == 32
    again = swarmctl("--socket", str(a.socket), "--json", "submit", "--trainers", "0", str(spec))
    assert json.loads(again.stdout)["job"] == job_id  # same spec, same submitter: same job

    listed: list[dict] = []

    def b_lists_it() -> list[dict]:
        listed[:] = json.loads(swarmctl("--socket", str(b.socket), "--json", "jobs").stdout)
        return [j for j in listed if j["job"] == job_id]

    (job,) = wait_for(b_lists_it, 30, f"b to list {job_id}", interval=0.5, detail=lambda: f"b lists {listed}")
    # The spec record is signed by a's identity: its peer id is the hash of the submitter key.
    assert hashlib.sha256(bytes.fromhex(job["submitter"])).hexdigest() == a.status["peer_id"]
    assert job["state"] == "waiting" and job["stages"] == 3

    result = swarmctl("--socket", str(b.socket), "job", "tiny")
    print(result.stdout)
    assert result.returncode == EXIT_OK, result.stderr
    assert "waiting: stage 0 has no peers, stage 1 has no peers, stage 2 has no peers" in result.stdout
    detail = json.loads(swarmctl("--socket", str(b.socket), "--json", "job", job_id).stdout)
    assert [s["peers"] for s in detail["stages"]] == [[], [], []] and detail["steps"] == 5

    assert swarmctl("--socket", str(b.socket), "cancel", job_id).returncode == EXIT_FAILURE  # not submitted there
    cancelled = json.loads(swarmctl("--socket", str(a.socket), "--json", "cancel", job_id).stdout)
    assert cancelled == {"job": job_id, "state": "cancelled"}
    events = [json.loads(line) for line in
              swarmctl("--socket", str(a.socket), "--json", "logs", job_id, "--follow").stdout.splitlines()]
    assert [e["kind"] for e in events] == ["info", "done"] and "cancelled" in events[-1]["message"]


def test_unknown_job_is_not_found(pair, swarmctl) -> None:
    a, _ = pair
    result = swarmctl("--socket", str(a.socket), "job", "nope")
    assert result.returncode == EXIT_FAILURE and result.stderr.startswith("swarmctl: not_found: job: ")
