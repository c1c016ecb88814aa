"""A stage peer SIGKILLed mid-training: the job goes on, no step counts a sample twice or misses one,
and the restarted daemon (same state dir) downloads the stage's state and serves again, to the end:
when the job ends every daemon leaves its stages, and the restarted one's final checkpoint is of the
job's last step."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from swarmd.exitcodes import EXIT_OK
from swarmd.stage.checkpoint import checkpoint_dir

pytestmark = pytest.mark.slow

#: Enough steps that the job is still training when the killed daemon is back (a restart imports
#: torch: seconds), since an ended job's stages are left and a `serve` of it is refused.
STEPS = 60
GLOBAL, MICRO = 8, 2


def test_killed_stage_peer_restarts_and_training_completes(swarm, swarm_root: Path, swarmctl, kit) -> None:
    data, spec_path = kit.write_job(swarm_root, "preempt", seed=11, steps=STEPS,
                                    batch={"global_samples": GLOBAL, "microbatch_samples": MICRO})
    a, c = swarm.together(["pa", "pc"])
    job_id = json.loads(swarmctl("--socket", str(a.socket), "--json", "submit", "--trainers", "0",
                                 str(spec_path)).stdout)["job"]
    for stage in range(3):
        assert swarmctl("--socket", str(a.socket), "serve", job_id, "--stage", str(stage)).returncode == EXIT_OK
    assert swarmctl("--socket", str(c.socket), "serve", job_id, "--stage", "1").returncode == EXIT_OK
    kit.wait_for(lambda: len(a.client.job(job_id)["stages"][1]["peers"]) == 2, 30, "two peers on stage 1")
    assert swarmctl("--socket", str(a.socket), "train", job_id, "--data", str(data)).returncode == EXIT_OK

    kit.wait_for(lambda: a.client.job(job_id)["step"] >= 2, 90, "two steps before the kill")
    c.proc.send_signal(signal.SIGKILL)  # mid-step: the trainer is pushing step 2 or 3 through stage 1
    c.proc.wait(timeout=30)
    killed_at = a.client.job(job_id)["step"]

    restarted = swarm.restart(c)
    result = swarmctl("--socket", str(restarted.socket), "--json", "serve", job_id, "--stage", "1")
    assert result.returncode == EXIT_OK, result.stderr

    kit.wait_for(lambda: [p for p in a.client.job(job_id)["stages"][1]["peers"]
                          if p["peer_id"] == restarted.status["peer_id"] and p["state"] == "serving"], 30,
                 "the restarted peer to serve stage 1 again")
    kit.wait_for(lambda: kit.finished(a, job_id), 240, "training to finish")
    events = kit.step_events(a, job_id)
    assert a.client.job(job_id)["state"] == "done" and [e["step"] for e in events] == list(range(1, STEPS + 1))
    kit.whole_steps(events, GLOBAL, MICRO)
    print(f"killed after step {killed_at}")
    # The restarted peer caught up from its mate and served the stage to the job's last step: the
    # final checkpoint it wrote when it left the ended job is of that step.
    final = checkpoint_dir(restarted.socket.parent / "state", bytes.fromhex(job_id), 1) / f"step-{STEPS:010d}.pt"
    kit.wait_for(final.exists, 30, f"the restarted peer's final checkpoint {final.name}")
