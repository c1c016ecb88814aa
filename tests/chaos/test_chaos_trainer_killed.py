"""A trainer SIGKILLed mid-step while another trainer runs: its share is taken over, the job finishes.

Four `swarmd` processes on loopback: peer0 runs trainer 0 of 2 (and submits the job), peer1 serves
stage 0, peer2 stage 1, peer3 runs trainer 1 of 2 and is SIGKILLed while the job trains. Trainers
have no fixed shards (docs/trainer.md, "Invariants"): peer0's trainer sees peer3's microbatches
stay undone, takes them over (after its takeover bound once, then at once: peer3 is a suspect), and
the job finishes with every step's stage records holding exactly `global_samples`, none summed
twice (one peer per stage: a takeover's repeat of a microbatch peer3 had already sent lands on the
peer holding it, which adds it once). The per-step loss of every step peer0 did alone equals the
single-process reference's, unless one of peer3's in-flight microbatches had its answer committed
past (answers_lost, which the stage's replay of committed steps would make exact).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import chaos_harness as ch  # noqa: E402

from swarmd.client import ControlError  # noqa: E402
from swarmd.job import JobSpec  # noqa: E402
from swarmd.reference import ReferenceTrainer  # noqa: E402
from swarmd.swarmproc import LocalSwarm, SwarmSettings  # noqa: E402

STEPS = 30
KILL_AT = 6  # job steps committed before peer3 is killed
GLOBAL, MICRO = 16, 2


def exact_spec(data: Path) -> dict:
    raw = ch.spec("trainer-killed", STEPS, 2, data)
    raw["optim"] = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "schedule": "constant", "clip_norm": 0.0}
    raw["batch"] = {"global_samples": GLOBAL, "microbatch_samples": MICRO}
    # fp32 everywhere; one peer per stage all-reduces with nobody, but the reference comparison
    # must not rest on that: the stage all-reduce is fp32 too.
    raw["wire"] = {"activations": "none", "gradients": "none", "allreduce": "none"}
    raw["pipeline"]["microbatches_in_flight"] = 1
    return raw


def start_trainer(run: ch.Run, peer, data: Path, shard: int) -> None:
    """`job.train` shard `shard` of 2 on that peer; retried while it has not yet seen the job."""
    deadline = time.monotonic() + ch.SERVE_TIMEOUT_S
    while True:
        try:
            peer.client().train(run.job, [str(data)], shard, 2)
            return
        except ControlError as exc:
            if exc.code != "not_found" or time.monotonic() > deadline:
                raise
        time.sleep(0.3)


@pytest.mark.slow
def test_a_trainer_killed_mid_step_has_its_share_taken_over(tmp_path: Path) -> None:
    data = ch.write_corpus(tmp_path)
    raw = exact_spec(data)
    swarm = LocalSwarm(tmp_path / "swarm", SwarmSettings(log_level="info", env=ch.CHAOS_ENV))
    try:
        p0, p1, p2, p3 = swarm.start(4)
        run = ch.Run(swarm, p0, p0.client().submit(raw, [str(data)], trainers=0)["job"], STEPS)
        run.serve(p1, 0)
        run.serve(p2, 1)
        start_trainer(run, p3, data, 1)
        start_trainer(run, p0, data, 0)
        run.wait_step(KILL_AT)
        run.note("SIGKILL peer3 (trainer 1 of 2)")
        swarm.signal(p3, signal.SIGKILL)
        # On a loaded machine the job may be a step or two past KILL_AT by the time the kill lands.
        killed_at = run.view()["step"]
        run.wait("the job to finish", lambda v: v["state"] == "done", timeout=300)
        events = [e for e in p0.client().logs(run.job) if e["kind"] == "step"]
    finally:
        swarm.close()

    assert [e["step"] for e in events] == list(range(1, STEPS + 1))
    for e in events:
        print(f"step {e['step']}: samples {e['samples']}, taken over {e['taken_over']}, answers lost "
              f"{e['answers_lost']}, stage samples {e['stage_samples']}, duplicates {e['duplicates']}")
        assert all(s in (GLOBAL, -1) for s in e["stage_samples"]) and all(d in (0, -1) for d in e["duplicates"]), e
    alone = [e for e in events if e["samples"] == GLOBAL]
    # Every step after the kill but the one it interrupted and the next (the takeover bound) is peer0's alone.
    assert len(alone) >= STEPS - killed_at - 2, f"peer0's trainer did not take over peer3's share (killed at step {killed_at})"
    assert sum(e["taken_over"] for e in events) >= (STEPS - killed_at - 2) * GLOBAL // MICRO // 2
    lost = sum(e["answers_lost"] for e in events)
    assert lost <= raw["pipeline"]["microbatches_in_flight"]
    reference = ReferenceTrainer.from_spec(JobSpec.from_dict(raw), tmp_path)
    ref = [r.loss for r in reference.train(STEPS)]
    worst = max(abs(e["loss"] - ref[e["step"] - 1]) / ref[e["step"] - 1] for e in alone)
    print(f"{len(alone)} steps done by peer0 alone; {lost} answers lost; worst loss difference {worst:.2e}")
    if not lost:
        assert worst <= 1e-5
