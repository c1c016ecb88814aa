"""A real swarm trains through every kind of peer failure one after another, on loopback.

Five `swarmd` processes (the trainer's daemon and two peers on each of two stages) train a small
byte-level LM while, at step thresholds, a stage peer is SIGKILLed and replaced, another is hung
with SIGSTOP and resumed with SIGCONT, a third is restarted with its state dir (same identity), and
a fourth is drained with `swarmctl drain`. The job must still commit every step with every sample
exactly once, its loss must fall, no daemon's memory may run away, and every daemon must exit 0
when drained at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import chaos_harness as ch  # noqa: E402

from swarmd.exitcodes import EXIT_OK  # noqa: E402
from swarmd.swarmproc import LocalSwarm, SwarmSettings  # noqa: E402

#: Steps take a fraction of a second with this model, so every disturbance lands mid-training
#: with hundreds of steps to spare on a loaded machine (each is checked to happen before the end).
#: The test does not wait for the job's end: it cancels the job LAST_STEPS after the last
#: disturbance (the ~300 steps left cost 45 s and asserted nothing the job-ending tests do not).
STEPS = 400
#: Steps the job must commit after each disturbance before the next one: the swarm has absorbed it.
SETTLE_STEPS = 10
#: Steps after the last disturbance before the cancel: the memory check's last fifth of samples
#: falls on a swarm that has run undisturbed for a while.
LAST_STEPS = 50


@pytest.mark.slow
def test_training_survives_kill_hang_restart_and_drain(tmp_path: Path) -> None:
    """1. Five daemons; peer0 trains, peer1+peer2 serve stage 0, peer3+peer4 stage 1.
       2. SIGKILL peer1; a fresh peer5 serves stage 0 in its place; the job goes on.
       3. SIGSTOP peer3 (hung: its sockets stay open, it answers nothing): steps still commit,
          routed around it, while it stays stopped.
       4. SIGCONT peer3: it announces, serving, a step past the job's step at the SIGCONT (it caught
          up from its mate and commits again).
       5. Restart peer4 (SIGKILL, same state dir and port): while it is down peer3 alone serves
          stage 1 and steps commit, which proves peer3 really serves again; peer4 comes back with
          the same peer id, serves stage 1 again and catches up.
       6. Drain peer2: it exits 0 by itself; peer5 carries stage 0 on.
       7. LAST_STEPS more steps, then cancel the job.
       Expected: every step up to the cancel committed, each stage's record covering global_samples
       exactly once, the loss lower at the end, every long-lived daemon's RSS bounded, every
       remaining daemon exits 0 when drained, and no process is left."""
    data = ch.write_corpus(tmp_path)
    raw = ch.spec("chaos-local", STEPS, 2, data)
    swarm = LocalSwarm(tmp_path / "swarm", SwarmSettings(log_level="info", env=ch.CHAOS_ENV))
    try:
        trainer, p1, p2, p3, p4 = swarm.start(5)
        run = ch.Run(swarm, trainer, ch.submit(swarm, trainer, raw, data), STEPS)
        for peer, stage in ((p1, 0), (p2, 0), (p3, 1), (p4, 1)):
            run.serve(peer, stage)
        run.wait_step(SETTLE_STEPS)
        kill_and_replace(run, swarm, p1)
        ch.hang_and_resume(run, swarm, p3, 1, SETTLE_STEPS)
        restart_in_place(run, swarm, p4)
        drain_then_cancel(run, swarm, trainer, p2)
        events = ch.check_steps(run, raw)
        memory = ch.check_memory(run)
        ch.dump(tmp_path / "chaos-local.json", run, events, memory)
        print({name: f"{e // 1024}->{late // 1024} MiB" for name, (e, late) in memory.items()})
        ch.drain_all(swarm)
    finally:
        swarm.close()
    assert ch.processes_mentioning(str(tmp_path)) == []


def kill_and_replace(run: ch.Run, swarm: LocalSwarm, victim) -> None:
    """Step 2: SIGKILL a stage-0 peer; a fresh one serves stage 0 in its place."""
    run.note("SIGKILL peer1 (stage 0)")
    swarm.kill(victim)
    fresh = swarm.add()
    run.serve(fresh, 0)
    run.note(f"{fresh.name} serves stage 0")
    run.wait_step(run.last_step + SETTLE_STEPS)


def restart_in_place(run: ch.Run, swarm: LocalSwarm, restarted) -> None:
    """Step 5: restart a stage-1 peer (same state dir and port): its mate alone carries the stage
    meanwhile; it comes back as the same peer and catches up."""
    peer_id = restarted.peer_id
    run.note("restart peer4 (stage 1)")
    swarm.restart(restarted, wait=False)
    alone_from = run.last_step
    run.wait_step(alone_from + SETTLE_STEPS)
    run.note(f"steps {alone_from}..{run.last_step} committed with peer3 alone on stage 1")
    swarm.wait_ready([restarted])
    assert restarted.peer_id == peer_id, "a restart with the same state dir is the same peer"
    run.serve(restarted, 1)
    back_at = run.last_step
    run.wait("peer4 to serve stage 1 past the step it rejoined at",
             lambda v: run.serving_past(v, restarted, 1, back_at))
    run.note("peer4 back and caught up")


def drain_then_cancel(run: ch.Run, swarm: LocalSwarm, trainer, drained) -> None:
    """Steps 6-7: drain a stage-0 peer (it exits 0 by itself), LAST_STEPS more steps, cancel the job."""
    run.note("drain peer2 (stage 0)")
    assert swarm.drain(drained) == EXIT_OK and not drained.alive
    drained_at = run.last_step
    assert drained_at + LAST_STEPS < STEPS, "every disturbance must land before the job's last step"
    run.wait_step(drained_at + LAST_STEPS)
    ch.cancel(run, trainer)
