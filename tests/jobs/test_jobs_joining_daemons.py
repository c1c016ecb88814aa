"""Automatic joining with real daemons: `jobs.serve = "all"` daemons notice a job in the DHT and
serve every stage of it with no `swarmctl serve`; a `serve = "none"` daemon serves nothing (it only
trains); a daemon SIGKILLed mid-job and restarted with its state dir rejoins the stage it served."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import tty
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

#: Enough steps that the job still trains while a killed server restarts (seconds: it imports
#: torch) and rejoins: an ended job's stages are left by every daemon and forgotten.
STEPS = 80
#: Serve every job (the fixture's daemons look at the jobs index twice a second).
AUTO = {"SWARMD_JOBS_SERVE": "all"}


def on_a_terminal(*args: str, no_color: bool) -> str:
    """Run swarmctl with its stdout on a pseudo-terminal and return what it drew."""
    exe = str(Path(sys.executable).parent / "swarmctl")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp", "TERM": "xterm",
           **({"NO_COLOR": "1"} if no_color else {})}
    master, slave = pty.openpty()
    tty.setraw(slave)  # no \n -> \r\n translation: what we read is what swarmctl wrote
    proc = subprocess.Popen([exe, *args], stdout=slave, stderr=subprocess.PIPE, env=env)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    return out.decode()


def check_follow_output(daemon, job_id: str) -> None:
    """`logs --follow` of the finished job: a redrawn bar on a terminal (coloured unless NO_COLOR),
    one plain line per event through a pipe."""
    drawn = on_a_terminal("--socket", str(daemon.socket), "logs", job_id, "--follow", no_color=False)
    last = drawn.rstrip("\n").rsplit("\r", 1)[-1]
    print(repr(last))
    assert f"step {STEPS}/{STEPS}" in last and "loss " in last and "tokens/s " in last and re.search(r"peers/stage [1-3]·[1-3]·[1-3]", last)
    assert "\x1b[32m" + "#" * 24 in last  # full bar, green
    assert f"trained {STEPS} steps" in drawn  # the final event, printed above the bar
    plain = on_a_terminal("--socket", str(daemon.socket), "logs", job_id, "--follow", no_color=True)
    assert "\r[" + "#" * 24 + "]" in plain and "\x1b[3" not in plain  # a bar, no colour
    piped = subprocess.run([str(Path(sys.executable).parent / "swarmctl"), "--socket", str(daemon.socket), "logs",
                            job_id, "--follow"], capture_output=True, text=True, timeout=60,
                           env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp", "TERM": "xterm"})
    assert piped.returncode == 0 and "\r" not in piped.stdout and "\x1b" not in piped.stdout
    lines = piped.stdout.splitlines()
    # step events only ("shard 0: step 7 committed"), not a warning that a stage "has not committed step 7"
    assert sum(bool(re.search(r": step \d+ committed", line)) for line in lines) == STEPS
    assert f"trained {STEPS} steps" in lines[-1]


def test_serve_all_daemons_join_every_stage_and_a_restarted_one_rejoins(swarm, swarm_root: Path, swarmctl,
                                                                         kit) -> None:
    _, spec_path = kit.write_job(swarm_root, "joining", seed=3, steps=STEPS)
    trainer = swarm.start("jt")  # serve = "none" (the fixture's default): it only trains
    servers = [swarm.start(f"j{i}", "--bootstrap", trainer.status["announce"], env=AUTO, ready=False) for i in range(3)]
    for server in servers:  # started at once: one wait for their starts, not three in turn
        server.wait_ready()
    submitted = swarmctl("--socket", str(trainer.socket), "--json", "submit", str(spec_path))
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["job"]

    running = kit.wait_for(lambda: (lambda j: j if j["step"] >= 1 else None)(trainer.client.job(job_id)), 240,
                           "training to commit a step with automatically joined stages")
    # Watched from a daemon that did not submit the job: the submitter's progress (before: `waiting`,
    # step 0, loss None while it trained).
    seen = kit.wait_for(lambda: (lambda j: j if j["step"] >= 1 and j["loss"] is not None else None)(
        servers[0].client.job(job_id)), 60, "a daemon that did not submit the job to show its step and loss")
    assert seen["samples_per_s"] > 0  # its state may say "waiting" while a stage's peer misses a probe
    served = {d.name: d.client.status()["serving"]["stages"] for d in servers}
    print("served:", served)
    # Usually one stage each; two daemons that decided at the same moment may share one, and then
    # one of them also takes the stage left empty.
    assert {s for stages in served.values() for s in stages} == {f"{job_id[:16]}/{i}" for i in range(3)}
    assert all(served.values())
    assert trainer.client.status()["serving"]["stages"] == []
    peers = {p["peer_id"] for stage in running["stages"] for p in stage["peers"]}
    assert trainer.status["peer_id"] not in peers
    assert all(stage["peers"] for stage in running["stages"])

    victim = servers[1]
    before = served[victim.name]
    remembered = json.loads((swarm_root / victim.name / "state" / "served-stages.json").read_text())
    assert [f"{e['job'][:16]}/{e['stage']}" for e in remembered["stages"]] == before
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(timeout=30)
    restarted = swarm.restart(victim)
    kit.wait_for(lambda: restarted.client.status()["serving"]["stages"] == before, 60,
                 "the restarted daemon to rejoin its remembered stage")
    for stage in (int(s.split("/")[1]) for s in before):
        kit.wait_for(lambda: [p for p in restarted.client.job(job_id)["stages"][stage]["peers"]
                              if p["peer_id"] == restarted.status["peer_id"] and p["state"] == "serving"], 30,
                     "the rejoined stage's announcement")
    # Still under way (running, or waiting while the rejoined stage's announcement spreads): the
    # rejoin was of a live job, not of one that had ended meanwhile.
    assert trainer.client.job(job_id)["state"] in ("running", "waiting"), "the job ended before the rejoin"

    done = kit.wait_for(lambda: kit.finished(trainer, job_id), 240, "training to finish")
    assert done["state"] == "done" and done["step"] == STEPS, trainer.client.logs(job_id)
    assert done["samples_per_s"] > 0  # measured from the trainer's step commits
    check_follow_output(trainer, job_id)


def test_a_restarted_daemon_forgets_a_cancelled_job(swarm, swarm_root: Path, swarmctl, kit) -> None:
    """Steps: a daemon pins stage 0 of a job by hand (remembered) and is SIGKILLed, the submitter
    cancels the job, the daemon is restarted. Expected: it does not rejoin, and after
    `jobs.rejoin_wait_s` its served-stages file no longer lists it. (Killed before the cancel: killed
    after it, the daemon could learn the end at a join tick in between and leave the stage itself,
    with nothing left to forget after the restart.)"""
    _, spec_path = kit.write_job(swarm_root, "cancelled", copies=1, seed=3, steps=STEPS)
    submitter = swarm.start("cs")
    server = swarm.start("cv", "--bootstrap", submitter.status["announce"], env={"SWARMD_JOBS_REJOIN_WAIT_S": "3"})
    job_id = json.loads(swarmctl("--socket", str(submitter.socket), "--json", "submit", "--trainers", "0",
                                 str(spec_path)).stdout)["job"]
    assert swarmctl("--socket", str(server.socket), "serve", job_id, "--stage", "0").returncode == 0
    memory = swarm_root / "cv" / "state" / "served-stages.json"
    kit.wait_for(lambda: memory.exists() and json.loads(memory.read_text())["stages"], 10, "the stage remembered")
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=30)
    assert swarmctl("--socket", str(submitter.socket), "cancel", job_id).returncode == 0
    restarted = swarm.restart(server)
    kit.wait_for(lambda: json.loads(memory.read_text())["stages"] == [], 60, "the cancelled job to be forgotten")
    assert restarted.client.status()["serving"]["stages"] == []
    assert "forgetting stage 0" in restarted.log.read_text()
