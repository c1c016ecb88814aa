"""Every peer of one stage killed: the job waits, and `swarmctl job` says which stage has no peers;
the killed daemon restarts with its state dir, rejoins the stage it remembers on its own (restoring
its checkpoint: no live mate has newer state), takes up the step the other stages reached, and the
job finishes every step with the full global batch."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from swarmd.exitcodes import EXIT_OK

pytestmark = pytest.mark.slow

STEPS = 12
#: Stage 1's only checkpoint before the kill is step 6's, and the kill comes after step 7, so the
#: restarted stage is behind the others and must take up their step (StageService._resume_at).
EVERY = 6
#: Announcements refreshed every second and lapsing after three, so the dead peer's record is
#: gone from the stage's peers within seconds instead of the default 90 s.
SHORT_ANNOUNCE = {"SWARMD_DHT_REFRESH_INTERVAL": "1", "SWARMD_DHT_ANNOUNCE_TTL": "3"}
GLOBAL, MICRO = 4, 2



def test_wiped_stage_makes_the_job_wait_then_resumes_when_its_daemon_restarts(swarm, swarm_root: Path,
                                                                             swarmctl, kit) -> None:
    data, spec_path = kit.write_job(swarm_root, "wiped", seed=5, steps=STEPS, checkpoint={"every_steps": EVERY},
                                    batch={"global_samples": GLOBAL, "microbatch_samples": MICRO})
    a, c = swarm.together(["wa", "wc"], env=SHORT_ANNOUNCE)
    job_id = json.loads(swarmctl("--socket", str(a.socket), "--json", "submit", "--trainers", "0",
                                 str(spec_path)).stdout)["job"]
    for stage in (0, 2):
        assert swarmctl("--socket", str(a.socket), "serve", job_id, "--stage", str(stage)).returncode == EXIT_OK
    assert swarmctl("--socket", str(c.socket), "serve", job_id, "--stage", "1").returncode == EXIT_OK
    kit.wait_for(lambda: all(s["peers"] for s in a.client.job(job_id)["stages"]), 30, "a peer on every stage")
    assert swarmctl("--socket", str(a.socket), "train", job_id, "--data", str(data)).returncode == EXIT_OK

    kit.wait_for(lambda: a.client.job(job_id)["step"] >= EVERY + 1, 90, "a checkpoint, then one more step")
    c.proc.send_signal(signal.SIGKILL)
    c.proc.wait(timeout=30)
    stalled = kit.wait_for(lambda: (lambda j: j if "stage 1 has no peers" in j["status"] else None)(a.client.job(job_id)),
                           30, "the job to report stage 1 empty")
    shown = swarmctl("--socket", str(a.socket), "job", job_id)
    print(shown.stdout)
    assert stalled["state"] == "waiting" and "waiting: stage 1 has no peers" in shown.stdout
    assert "stage 1    no peers" in shown.stdout
    # The trainer keeps waiting (it never gives up on a job): it is alive and has not finished.
    waiting_at = a.client.job(job_id)["step"]
    assert a.client.job(job_id)["state"] == "waiting" and waiting_at < STEPS

    # No `swarmctl serve`: the restarted daemon rejoins the stage from its served-stages file.
    restarted = swarm.restart(c)
    kit.wait_for(lambda: restarted.client.status()["serving"]["stages"] == [f"{job_id[:16]}/1"], 60,
                 "the restarted daemon to rejoin stage 1")
    done = kit.wait_for(lambda: kit.finished(a, job_id), 180, "training to finish after the stage came back")
    events = kit.step_events(a, job_id)
    assert done["state"] == "done" and [e["step"] for e in events] == list(range(1, STEPS + 1)), events
    # Every stage reported each step it committed, and each holds the whole global batch.
    assert kit.whole_steps(events, GLOBAL, MICRO) == 3 * len(events), events
    log = restarted.log.read_text()
    resumed = [line for line in log.splitlines() if "restored checkpoint" in line or "resumed at step" in line]
    print(f"waiting at step {waiting_at};", *resumed, sep="\n")
    assert any(f"restored checkpoint of step {EVERY}" in line for line in resumed)
    assert any(f"with the state of step {EVERY}" in line for line in resumed)
