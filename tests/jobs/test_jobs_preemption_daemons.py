"""A stage peer SIGKILLed mid-training: the job goes on, no step counts a sample twice or misses one,
and the restarted daemon (same state dir) downloads the stage's state and serves again."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from swarmd.exitcodes import EXIT_OK

STEPS = 12
SPEC = f"""name = "preempt"
seed = 11
steps = {STEPS}
[model]
arch = "transformer-lm"
d_model = 32
n_heads = 2
layers_per_stage = 1
vocab = 256
[data]
files = ["{{data}}"]
seq_len = 16
[batch]
global_samples = 8
microbatch_samples = 2
[optim]
name = "sgd"
lr = 0.05
schedule = "constant"
[pipeline]
stages = 3
"""


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def test_killed_stage_peer_restarts_and_training_completes(swarm, swarm_root: Path, swarmctl) -> None:
    data = swarm_root / "preempt.txt"
    data.write_text(Path(json.__file__).read_text() * 4)
    spec_path = swarm_root / "preempt.toml"
    spec_path.write_text(SPEC.format(data=data))
    a = swarm.start("pa")
    c = swarm.start("pc", "--bootstrap", a.status["announce"])
    job_id = json.loads(swarmctl("--socket", str(a.socket), "--json", "submit", "--trainers", "0",
                                 str(spec_path)).stdout)["job"]
    for stage in range(3):
        assert swarmctl("--socket", str(a.socket), "serve", job_id, "--stage", str(stage)).returncode == EXIT_OK
    assert swarmctl("--socket", str(c.socket), "serve", job_id, "--stage", "1").returncode == EXIT_OK
    wait_for(lambda: len(a.client.job(job_id)["stages"][1]["peers"]) == 2, 30, "two peers on stage 1")
    assert swarmctl("--socket", str(a.socket), "train", job_id, "--data", str(data)).returncode == EXIT_OK

    wait_for(lambda: a.client.job(job_id)["step"] >= 2, 90, "two steps before the kill")
    c.proc.send_signal(signal.SIGKILL)  # mid-step: the trainer is pushing step 2 or 3 through stage 1
    c.proc.wait(timeout=30)
    killed_at = a.client.job(job_id)["step"]

    restarted = swarm.restart(c)
    result = swarmctl("--socket", str(restarted.socket), "--json", "serve", job_id, "--stage", "1")
    assert result.returncode == EXIT_OK, result.stderr

    wait_for(lambda: a.client.job(job_id)["state"] in ("done", "failed"), 150, "training to finish")
    events = [e for e in a.client.logs(job_id) if e["kind"] == "step"]
    assert a.client.job(job_id)["state"] == "done" and [e["step"] for e in events] == list(range(1, STEPS + 1))
    for event in events:
        print(f"step {event['step']}: stage samples {event['stage_samples']}, duplicates {event['duplicates']}, "
              f"retries {event['retries']}")
        for samples, dups in zip(event["stage_samples"], event["duplicates"]):
            if samples >= 0 and dups >= 0:
                assert samples - dups * 2 == 8, event
    print(f"killed after step {killed_at}")
    # The restarted peer caught up from its mate and serves the stage at the job's last step.
    wait_for(lambda: [p for p in restarted.client.job(job_id)["stages"][1]["peers"]
                      if p["peer_id"] == restarted.status["peer_id"] and p["step"] == STEPS], 30,
             "the restarted peer to announce the final step")
