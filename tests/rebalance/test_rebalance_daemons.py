"""Real daemons rebalance: 3 stages, 5 peers starting 3/1/1, the lone stage-2 peer held to a tenth
of a core. Within two short periods a stage-0 peer moves to stage 2, the job's samples/s rises, and
training goes on with every step whole (each stage's step counts exactly the global batch).

Speeds are real: each stage daemon runs under a CFS quota (conftest.CpuQuotas), not a mock. The
batch is large next to the model so that compute, not the stage-wide all-reduce a second stage-mate
brings, is what the quota limits (with 16 samples of 32 tokens the move *halved* the rate: the slow
peer's share of each round cost more than the compute it gave away).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from swarmd.exitcodes import EXIT_OK

STEPS = 1000  # more than the test waits for: it stops the swarm itself
GLOBAL, MICRO = 64, 8
#: Wider and deeper than the job tests' TINY_JOB, with a large batch of long samples.
BIG = {"model": {"d_model": 64, "layers_per_stage": 2}, "data": {"seq_len": 64},
       "batch": {"global_samples": GLOBAL, "microbatch_samples": MICRO}}
# When a move may start is pinned by the confirmation, not left to the checks' phase: a check
# before training sees no speeds and plans nothing, and a check that finds the move only marks it
# pending; the move starts when a check CONFIRM_S later agrees. So at least CONFIRM_S of measured
# training (with the step that measured the first speeds before it) precede any move, however the
# serves, the layout and the trainer's start fell on a loaded box. (Pinning by a long period alone,
# 30 s with a 2 s confirmation, once left 2 steps before a move 6.8 s into training.) The period is
# short, so the move comes soon after that.
PERIOD_S, JITTER, CONFIRM_S = 10.0, 0.2, 20.0
REBALANCE = {
    "SWARMD_REBALANCE_PERIOD_S": str(PERIOD_S), "SWARMD_REBALANCE_JITTER": str(JITTER),
    "SWARMD_REBALANCE_CONFIRM_AFTER_S": str(CONFIRM_S), "SWARMD_REBALANCE_GOSSIP_INTERVAL_S": "1",
    "SWARMD_REBALANCE_MEMBERSHIP_TTL_S": "2",
    # 3x is what the move buys here; a quarter keeps noisy speed readings from adding moves of a few %.
    "SWARMD_REBALANCE_MARGIN": "0.25",
}
FAST_CORES, SLOW_CORES = 0.4, 0.1
#: Steps averaged for each throughput figure (after warm-up, and after the move settled).
WINDOW = 5


def layout_of(daemon, job_id: str) -> list[int]:
    """Serving peers per stage, as the DHT directory tells `daemon`."""
    stages = daemon.client.job(job_id)["stages"]
    print("layout:", [[p["state"] for p in s["peers"]] for s in stages])
    return [sum(p["state"] == "serving" for p in s["peers"]) for s in stages]


def samples_per_s(events: list[dict]) -> float:
    """Samples committed per second over consecutive step events (first one only starts the clock)."""
    return GLOBAL * (len(events) - 1) / (events[-1]["ts"] - events[0]["ts"])


def moves_of(daemon) -> list[dict]:
    return [m for m in daemon.client.status()["rebalance"]["moves"] if not m["error"]]


@pytest.mark.slow
@pytest.mark.serial  # samples/s before and after the move, under CPU quotas a second worker would crowd
@pytest.mark.timeout(900)
def test_a_peer_moves_to_the_bottleneck_and_throughput_rises(swarm, swarm_root: Path, swarmctl, cpu_quotas,
                                                              kit) -> None:
    layout = [0, 0, 0, 1, 2]
    trainer, peers, job_id, data = start_layout(swarm, swarm_root, swarmctl, kit, layout)
    for i, peer in enumerate(peers):
        cpu_quotas.limit(peer.proc.pid, f"p{i}", SLOW_CORES if layout[i] == 2 else FAST_CORES)

    assert swarmctl("--socket", str(trainer.socket), "train", job_id, "--data", str(data)).returncode == EXIT_OK
    kit.wait_for(lambda: len(kit.step_events(trainer, job_id)) >= 2, 180, "training to commit two steps")
    trained_at = time.time()

    # Two periods at their longest, the confirming check, and the drain and download of the move
    # itself; the generous rest is for a loaded machine (gossip rounds, directory refreshes).
    budget = 2 * PERIOD_S * (1 + JITTER) + CONFIRM_S + 90
    moved = kit.wait_for(lambda: [(i, m) for i, p in enumerate(peers) for m in moves_of(p)], budget,
                     "a peer to move")
    (mover, move), = moved
    move_started = move["at"] - move["total_s"]
    print(f"p{mover} moved stage {move['source']} -> {move['target']} {move_started - trained_at:.1f} s after "
          f"training began (period {PERIOD_S:g} s): {move['total_s']:.1f} s moving, {move['drain_s']:.1f} s of "
          f"it draining, joined at step {move['step']}")
    assert (layout[mover], move["target"]) == (0, 2)
    status = peers[mover].client.status()["rebalance"]
    assert status["jobs"][0]["moves"] == 1 and status["jobs"][0]["moving_s"] >= move["total_s"] * 0.9
    metrics_job = status["jobs"][0]
    print(f"mover status: {metrics_job}")

    kit.wait_for(lambda: layout_of(trainer, job_id) == [2, 1, 2], 120, "the 2/1/2 layout in the directory")
    kit.wait_for(lambda: len([e for e in kit.step_events(trainer, job_id) if e["ts"] > move["at"]]) >= WINDOW + 2, 300,
             f"{WINDOW + 2} steps after the move")

    events = kit.step_events(trainer, job_id)
    check_throughput_rose(events, move)

    # No step lost or counted short: consecutive, and every stage's step holds the whole global
    # batch (re-sent microbatches of the drained peer included, duplicates counted apart).
    assert [e["step"] for e in events] == list(range(1, len(events) + 1))
    known = kit.whole_steps(events, GLOBAL, MICRO)
    assert known >= 0.9 * 3 * len(events), f"only {known} stage records of {3 * len(events)} read back"
    resent = sum(e["retries"] for e in events)
    print(f"{len(events)} steps, all whole; {resent} retried calls in all")
    everyone = {f"p{i}": p.client.status()["rebalance"] for i, p in enumerate(peers)}
    others = {name: (r["moves"], [j["last_decision"] for j in r["jobs"]]) for name, r in everyone.items()
              if r["moves"] and name != f"p{mover}"}
    assert not others, f"exactly one peer moved; also: {others}"


def start_layout(swarm, swarm_root: Path, swarmctl, kit, layout: list[int]):
    """A trainer daemon and a peer daemon per `layout` entry serving that stage (each stage's first
    peer starts it; later ones join by download), as the directory shows; returns (trainer,
    peers, job id, data path)."""
    data, spec_path = kit.write_job(swarm_root, "rebalance", seed=5, steps=STEPS, **BIG)
    trainer = swarm.start("trainer", env=REBALANCE)
    boot = trainer.status["announce"]
    with ThreadPoolExecutor(len(layout)) as starting:
        peers = list(starting.map(lambda i: swarm.start(f"p{i}", "--bootstrap", boot, env=REBALANCE),
                                  range(len(layout))))
    job_id = json.loads(swarmctl("--socket", str(trainer.socket), "--json", "submit", "--trainers", "0",
                                 str(spec_path)).stdout)["job"]
    firsts = [layout.index(stage) for stage in sorted(set(layout))]
    for i in firsts + [i for i in range(len(layout)) if i not in firsts]:
        result = swarmctl("--socket", str(peers[i].socket), "serve", job_id, "--stage", str(layout[i]))
        assert result.returncode == EXIT_OK, result.stderr
    counts = [layout.count(stage) for stage in sorted(set(layout))]
    kit.wait_for(lambda: layout_of(trainer, job_id) == counts, 120, f"the {counts} layout in the directory")
    return trainer, peers, job_id, data


def check_throughput_rose(events: list[dict], move: dict) -> None:
    """Samples/s over WINDOW steps after the move beat the WINDOW steps before it by 20%."""
    move_started = move["at"] - move["total_s"]
    before = [e for e in events if e["ts"] < move_started][1:]  # the first step pays for connections
    after = [e for e in events if e["ts"] > move["at"]][1:WINDOW + 2]
    assert len(before) >= 3, f"only {len(before)} steps before the move: too few to measure"
    before_rate, after_rate = samples_per_s(before[-WINDOW:]), samples_per_s(after)
    print(f"samples/s: {before_rate:.1f} before the move ({len(before[-WINDOW:])} steps), "
          f"{after_rate:.1f} after ({len(after)} steps): x{after_rate / before_rate:.2f}")
    assert after_rate > 1.2 * before_rate
