"""Goodput of a local swarm under repeated stage-peer kills and with one slow peer, against no faults.

    .venv/bin/python bench/chaos_goodput.py [--quick] [--window 120] [--kill-every 60,30,15]
                                            [--slow-stopped 0.75] [--png FILE] [--json FILE]

One job trains on a `swarmd.swarmproc.LocalSwarm` of real `swarmd` processes on loopback: one daemon
runs the trainer, `stages x peers-per-stage` daemons each serve one stage. After a warm-up, windows
follow one another on the same job and the same warm processes:

- `no_faults` (half a window), then one window per kill period P (`kill_60s`, `kill_30s`,
  `kill_15s`): a stage peer (from a stage whose peers are all up) is SIGKILLed at the window's start
  and every P s after, and at once restarted (same state dir, identity and port: it downloads its
  stage's state from a mate and serves again); restarts still under way when a window closes are
  waited for outside it, and so is the job's next committed step (`settle`): no window pays for
  the one before;
- `slow_peer`: one stage peer in four is slowed, alive but stopped (SIGSTOP) for `--slow-stopped`
  of every `--slow-period` and running (SIGCONT) the rest: its compute, its replies and its part of
  its stage's all-reduce all slow down about 1 / (1 - stopped) times;
- `no_faults` again (half a window): the two no-fault halves together are the baseline, so load
  that drifts during the run (the machine may be shared) hits both sides.

Goodput is committed samples per second: steps committed in a window (from the trainer's step
events) times `global_samples`, over the window's length. ONE JSON object is printed (and written
to `--json`), with a bar chart in `--png`:

    {"no_faults": {"samples_per_s": ...},
     "scenarios": {"kill_60s": {"ratio": ..., "exact": true, "samples_per_s": ..., "steps": ...,
                                "kills": ..., "answers_lost": ..., "unknown_records": ...}, ...,
                   "slow_peer": {...}},
     "goals": {"kill_60s": 0.85, "slow_peer": 0.7}, "config": {...}}

`exact`: every step committed in the window summed each microbatch once on every stage (its stage
records hold exactly `global_samples`, no microbatch summed twice) and no answer was committed past
(`answers_lost` 0); records a stage had not published when the trainer asked are counted apart.
It counts samples and duplicates, not bits: the job's stages all-reduce at the default codec, fp16
(`[wire] allreduce`, docs/stage-rpc.md "The codec"), so the parameters are within fp16's rounding
of an fp32 run's, which this bench does not compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import tempfile
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
# Run as a script, bench/ is first on sys.path and bench/transport.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]

from swarmd.client import Client, ControlError, DaemonUnavailable  # noqa: E402
from swarmd.swarmproc import (FAST_ENV, LocalSwarm, PeerProcess, SwarmError, SwarmSettings,  # noqa: E402
                              follow_logs, serve_when_known)

#: Stages are placed by the bench alone, and a restarted victim rejoins its remembered stage.
PINNED_ENV = {"SWARMD_JOBS_SERVE": "none", "SWARMD_REBALANCE_ENABLED": "false",
              "SWARMD_DHT_REFRESH_INTERVAL": "2", "SWARMD_DHT_ANNOUNCE_TTL": "8"}
#: A daemon that just started may not have read the job's record from the DHT yet.
JOB_DISCOVERY_S = 60.0
#: `job.serve` builds the stage and downloads its state before it answers: slow on a loaded machine.
SERVE_CALL_S = 180.0
GOALS = {"kill_60s": 0.85, "slow_peer": 0.7}
#: `--quick`: every part at its smallest (five daemons, 6 s windows: one kill per kill window, at
#: its start), for the test.
QUICK = {"window": 6.0, "warmup_steps": 2, "d_model": 32, "seq_len": 16}


@dataclass
class Served:
    peer: PeerProcess
    stage: int
    up: bool = True


@dataclass
class Run:
    events: list[dict[str, Any]] = field(default_factory=list)
    windows: dict[str, tuple[float, float]] = field(default_factory=dict)
    kills: dict[str, int] = field(default_factory=dict)

    def steps_in(self, name: str) -> list[dict[str, Any]]:
        start, end = self.windows[name]
        return [e for e in self.events if e.get("kind") == "step" and start < e["ts"] <= end]


def job_dict(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "name": "chaos-goodput", "seed": args.seed, "steps": 1_000_000,
        "model": {"arch": "transformer-lm", "d_model": args.d_model, "n_heads": 2, "layers_per_stage": 1,
                  "vocab": 256, "dropout": 0.0},
        "data": {"files": ["{stdlib}/*.py"], "seq_len": args.seq_len},
        "batch": {"global_samples": args.global_samples, "microbatch_samples": args.microbatch_samples},
        "optim": {"name": "adamw", "lr": 1e-3, "schedule": "constant", "clip_norm": 1.0},
        "wire": {"activations": "fp16", "gradients": "fp16"},
        "pipeline": {"stages": args.stages, "microbatches_in_flight": args.in_flight},
        "checkpoint": {"every_steps": 0},
    }


async def serve_stage(peer: PeerProcess, job: str, stage: int) -> None:
    """`swarmctl serve JOB --stage I` on that daemon, retried while it has not read the job yet."""
    await serve_when_known(peer, job, stage, discovery_s=JOB_DISCOVERY_S, timeout=SERVE_CALL_S)


async def restart(swarm: LocalSwarm, target: Served, job: str) -> None:
    """Bring a victim back on its stage; one that fails to come back leaves its stage a peer short
    (and that stage is not chosen again)."""
    try:
        swarm.restart(target.peer, wait=False)
        await swarm.wait_ready_async([target.peer])
        await serve_stage(target.peer, job, target.stage)
    except (SwarmError, ControlError, DaemonUnavailable) as exc:
        print(f"{target.peer.name} did not come back: {exc}", file=sys.stderr)
        return
    target.up = True


async def kill_window(name: str, every: float, seconds: float, swarm: LocalSwarm, peers: list[Served], job: str,
                      run: Run, rng: random.Random) -> None:
    start, end = time.time(), time.monotonic() + seconds
    run.kills[name] = 0
    async with asyncio.TaskGroup() as restarts:
        tick = time.monotonic()
        while tick < end:
            await asyncio.sleep(max(0.0, tick - time.monotonic()))
            tick += every
            whole = {p.stage for p in peers if all(q.up for q in peers if q.stage == p.stage)}
            choices = [p for p in peers if p.stage in whole]
            if not choices:
                continue
            target = rng.choice(choices)
            swarm.kill(target.peer)
            target.up = False
            run.kills[name] += 1
            restarts.create_task(restart(swarm, target, job), name=f"restart {target.peer.name}")
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        run.windows[name] = (start, time.time())


async def slow_window(seconds: float, victim: PeerProcess, stopped: float, period: float, run: Run) -> None:
    """Stop the victim for `stopped` of every `period`, run it the rest; always leave it running."""
    start, end = time.time(), time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            victim.proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(period * stopped)
            victim.proc.send_signal(signal.SIGCONT)
            await asyncio.sleep(period * (1 - stopped))
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    run.windows["slow_peer"] = (start, time.time())


async def quiet_window(name: str, seconds: float, run: Run) -> None:
    start = time.time()
    await asyncio.sleep(seconds)
    run.windows[name] = (start, time.time())


async def wait_steps(run: Run, steps: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while sum(e.get("kind") == "step" for e in run.events) < steps:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {steps} warm-up steps in {timeout:g} s")
        await asyncio.sleep(0.2)


async def settle(run: Run, timeout: float) -> None:
    """Between windows: wait for a step committed after the last one ended (its restarts done), so
    no window pays for the one before. A kill of the only peer holding a stage's newest state
    stalls the job for the lost-step recovery (`resume_after_s`, 10 s, docs/stage-rpc.md): with
    the quick run's 6 s windows that stall once ran through two more windows, the no-fault half
    among them, and read as zero goodput there."""
    ended = time.time()
    deadline = time.monotonic() + timeout
    while not any(e.get("kind") == "step" and e["ts"] > ended for e in run.events):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no step committed in {timeout:g} s after a window ended")
        await asyncio.sleep(0.1)


async def drive(swarm: LocalSwarm, trainer: PeerProcess, servers: list[PeerProcess], args: argparse.Namespace,
                run: Run) -> None:
    async with Client(trainer.socket) as client:
        job = (await client.submit(job_dict(args), [], trainers=1))["job"]
    peers = [Served(peer, i % args.stages) for i, peer in enumerate(servers)]
    await asyncio.gather(*(serve_stage(p.peer, job, p.stage) for p in peers))
    rng = random.Random(args.seed)
    async with asyncio.TaskGroup() as tasks:
        follower = tasks.create_task(follow_logs(trainer, job, run.events), name="follow job.logs")
        try:
            await wait_steps(run, args.warmup_steps, args.timeout)
            await quiet_window("no_faults_before", args.window / 2, run)
            for every in args.kill_periods:
                await kill_window(f"kill_{every:g}s", every, args.window, swarm, peers, job, run, rng)
                await settle(run, args.timeout)
            await slow_window(args.window, peers[-1].peer, args.slow_stopped, args.slow_period, run)
            await settle(run, args.timeout)
            await quiet_window("no_faults_after", args.window / 2, run)
            await asyncio.sleep(1.0)  # the window's last step events reach us
        finally:
            follower.cancel()
    async with Client(trainer.socket) as client:
        await client.cancel(job)


def window_figures(run: Run, name: str, global_samples: int) -> dict[str, Any]:
    steps = run.steps_in(name)
    start, end = run.windows[name]
    records = [(s, d) for e in steps for s, d in zip(e["stage_samples"], e["duplicates"])]
    known = [(s, d) for s, d in records if s >= 0 and d >= 0]
    lost = sum(e.get("answers_lost", 0) for e in steps)
    once = all(s == global_samples and d == 0 for s, d in known)
    # `from`/`to`: the window in wall-clock seconds, to read the daemons' logs by (e.g. the slow
    # peer's downloads in its window, docs/chaos.md).
    return {"samples_per_s": len(steps) * global_samples / (end - start), "steps": len(steps),
            "window_s": round(end - start, 2), "from": round(start, 3), "to": round(end, 3),
            "exact": once and lost == 0 and bool(steps),
            "answers_lost": lost, "duplicates": sum(d for _, d in known),
            "unknown_records": len(records) - len(known), "retries": sum(e.get("retries", 0) for e in steps),
            "taken_over": sum(e.get("taken_over", 0) for e in steps)}


def summarize(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    g = args.global_samples
    quiet = [window_figures(run, n, g) for n in ("no_faults_before", "no_faults_after")]
    seconds = sum(q["window_s"] for q in quiet)
    baseline = sum(q["steps"] for q in quiet) * g / seconds
    scenarios = {}
    for name in [f"kill_{p:g}s" for p in args.kill_periods] + ["slow_peer"]:
        figures = window_figures(run, name, g)
        scenarios[name] = {"ratio": figures["samples_per_s"] / baseline if baseline else 0.0, **figures}
        if name in run.kills:
            scenarios[name]["kills"] = run.kills[name]
    config = {k: getattr(args, k) for k in ("stages", "peers_per_stage", "d_model", "seq_len", "global_samples",
                                            "microbatch_samples", "in_flight", "window", "slow_stopped",
                                            "slow_period", "seed")}
    # The halves apart too: how far the machine's load drifted between the start and the end.
    return {"no_faults": {"samples_per_s": baseline, "steps": sum(q["steps"] for q in quiet),
                          "window_s": round(seconds, 2), "exact": all(q["exact"] for q in quiet),
                          "halves_samples_per_s": [q["samples_per_s"] for q in quiet]},
            "scenarios": scenarios, "goals": GOALS, "config": config}


def draw(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["scenarios"])
    ratios = [result["scenarios"][n]["ratio"] for n in names]
    colors = ["tab:green" if result["scenarios"][n]["exact"] else "tab:red" for n in names]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, ratios, color=colors)
    for i, name in enumerate(names):
        if name in GOALS:
            ax.hlines(GOALS[name], i - 0.4, i + 0.4, colors="black", linestyles="dashed")
        ax.text(i, ratios[i] + 0.02, f"{ratios[i]:.2f}", ha="center")
    ax.axhline(0.82, color="tab:gray", linestyle=":", label="torchft: 82% of steps committed, 1 failure/min")
    ax.set_ylim(0, max(1.15, max(ratios, default=0) + 0.15))
    ax.set_ylabel("goodput / no-fault goodput")
    ax.set_title(f"swarmd goodput under faults (no faults: {result['no_faults']['samples_per_s']:.1f} samples/s)")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    run = Run()
    settings = SwarmSettings(log_level=args.log_level, env={**FAST_ENV, **PINNED_ENV})
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="chaos-goodput-"))
    with LocalSwarm(root, settings) as swarm:
        trainer, *servers = swarm.start(1 + args.stages * args.peers_per_stage)
        try:
            asyncio.run(drive(swarm, trainer, servers, args, run))
        except ExceptionGroup as group:
            raise group.exceptions[0] from None
    result = summarize(run, args)
    if args.png:
        draw(result, Path(args.png))
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="every part at its smallest, for a test")
    parser.add_argument("--window", type=float, default=120.0, help="seconds per fault window")
    parser.add_argument("--kill-every", default="60,30,15",
                        help="kill periods in seconds, one window each ('' for none: the slow-peer window alone)")
    parser.add_argument("--slow-stopped", type=float, default=0.75, help="fraction of time the slow peer is stopped")
    parser.add_argument("--slow-period", type=float, default=0.4, help="seconds of one stop/run cycle")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--peers-per-stage", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-samples", type=int, default=16)
    parser.add_argument("--microbatch-samples", type=int, default=2)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds the warm-up may take")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--root", help="where the daemons live (default: a new temp dir)")
    parser.add_argument("--log-level", default="warning", help="the daemons' (stderr.log under --root)")
    parser.add_argument("--json", help="also write the JSON here")
    parser.add_argument("--png", help="draw the ratios here")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    args.kill_periods = [float(p) for p in str(args.kill_every).split(",") if p.strip()]
    if args.stages * args.peers_per_stage < 4 or args.peers_per_stage < 2:
        parser.error("the slow-peer window needs 4+ stage peers, 2+ per stage")
    if not 0 <= args.slow_stopped < 1 or args.window <= 0 or min(args.kill_periods, default=1) <= 0:
        parser.error("--slow-stopped must be in [0, 1), --window and the kill periods positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = bench(args)
    text = json.dumps(result)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
