"""A local user may only train on what they could read: data path tricks against a real daemon.

The daemon runs as root; `nobody`, admitted to its control socket through the socket's group,
submits through the control API (`job.submit` with `data`) paths that a check reasoning about path text let
through (issue 13, hole 2): a symlink followed by `..` next to a readable decoy, a symlink into a
0700 directory, `/proc/self/...` (which in the daemon names the daemon's own process), and a hard
link to a root-only file. Each must be refused with `forbidden`, and no job published; the same
user's readable file is accepted. The descriptor-level cases (a link swapped between the check
and the read) are tests/job/test_job_opening.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
NOBODY = ("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups")


@pytest.fixture(scope="module")
def tree(swarm_root: Path) -> Path:
    """swarm_root/att: a decoy `shadow`, `lnk -> /etc/ssl`, priv/ (0700) holding pub/f.txt,
    `inlink -> priv/pub/f.txt`, a 0600 `secret` and its hard link `hard`, a readable `ok.txt`."""
    att = swarm_root / "att"
    att.mkdir(mode=0o755)
    for name, text in (("shadow", "decoy\n"), ("ok.txt", "def f(x):\n    return x\n" * 100)):
        (att / name).write_text(text * 50)
        (att / name).chmod(0o644)
    (att / "lnk").symlink_to("/etc/ssl")
    (att / "priv" / "pub").mkdir(parents=True)
    (att / "priv").chmod(0o700)
    (att / "priv" / "pub").chmod(0o755)
    (att / "priv" / "pub" / "f.txt").write_text("behind a 0700 directory\n" * 100)
    (att / "priv" / "pub" / "f.txt").chmod(0o644)
    (att / "inlink").symlink_to(att / "priv" / "pub" / "f.txt")
    (att / "secret").write_text("root only\n" * 100)
    (att / "secret").chmod(0o600)
    os.link(att / "secret", att / "hard")
    return att


@pytest.fixture(scope="module")
def daemon(daemons, tree: Path):
    """One daemon whose working directory is tree/priv/pub, behind the 0700 step: what
    `/proc/self/cwd` leads to inside it."""
    here = os.getcwd()
    os.chdir(tree / "priv" / "pub")
    try:
        started = daemons.start("paths")
    finally:
        os.chdir(here)
    os.chown(started.socket, 0, 65534)  # group nogroup: nobody is admitted by its primary group
    return started


#: What nobody runs: the control API itself, not swarmctl, which would resolve `/proc/self` in
#: its own process before sending (an attacker sends any path text it likes).
SUBMIT = """
import json, sys
from swarmd.client import ControlError, SyncClient
socket, spec, data = sys.argv[1:]
try:
    print(json.dumps(SyncClient(socket).submit(json.loads(spec), [data], trainers=0)))
except ControlError as exc:
    print(json.dumps({"error": {"code": exc.code, "message": exc.message}}))
"""


def submit_as_nobody(daemon, name: str, data: str) -> dict:
    spec = {"name": name, "steps": 2, "data": {"files": ["unused.txt"], "seq_len": 16},
            "model": {"arch": "transformer-lm", "d_model": 32, "n_heads": 2, "layers_per_stage": 1, "vocab": 256},
            "batch": {"global_samples": 4, "microbatch_samples": 2}}
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp", "OMP_NUM_THREADS": "1",
           **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})}
    result = subprocess.run([*NOBODY, sys.executable, "-c", SUBMIT, str(daemon.socket), json.dumps(spec), data],
                            capture_output=True, text=True, timeout=90, env=env, cwd="/")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("name, data, refusal", [
    ("dotdot", "att/lnk/../shadow", "may not read /etc/shadow"),
    ("inlink", "att/inlink", "may not enter directory {att}/priv"),
    ("proccwd", "/proc/self/cwd/f.txt", "may not enter directory {att}/priv"),
    ("procenv", "/proc/self/environ", "may not read /proc/"),
    ("hardlink", "att/hard", "may not read {att}/hard"),
])
def test_a_path_nobody_could_not_open_is_refused(daemon, tree: Path, name: str, data: str, refusal: str) -> None:
    path = data if data.startswith("/") else str(tree.parent / data)
    reply = submit_as_nobody(daemon, name, path)
    print(reply)
    assert "error" in reply, f"{path} was accepted: {reply}"
    error = reply["error"]
    assert error["code"] == "forbidden"
    assert error["message"].startswith("data: uid 65534 " + refusal.format(att=tree)), error
    assert all(j["name"] != name for j in daemon.client.jobs())


def test_the_same_user_may_train_on_what_they_can_read(daemon, tree: Path) -> None:
    assert submit_as_nobody(daemon, "readable", str(tree / "ok.txt"))["name"] == "readable"
