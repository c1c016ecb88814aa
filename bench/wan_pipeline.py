"""The pipeline at latency: a real swarm whose every daemon sits behind its own delayed link,
samples/s against RTT and microbatches in flight, beside the overlap model's prediction.

    sudo .venv/bin/python bench/wan_pipeline.py [--quick] [--rtts 0,50,100,200] [--in-flight 1,4,16]

One trainer daemon and `--stages` stage daemons (one peer each), each in its own network namespace
of a bench/wan_link.py star: `--rate` Mb/s both ways on every link and the same round trip between
any two daemons. The round trip is changed in place between points (the delay line's ports), so
one warm swarm serves the whole sweep; each (RTT, in-flight) point is a job of its own (a tiny
byte-level transformer, `microbatches_in_flight` set), `--warmup-steps` steps and then
at least `--steps` (and at least MIN_WINDOW_S) measured from the trainer's step events: samples/s is
global samples × steps over the time between the first and the last measured commit.

The model (`step_seconds`) is square_cube.py's closed-pipeline overlap model widened to a whole
step: a microbatch is a chain of 2S-1 RPCs (forwards, the last stage's forward+backward, backwards),
each costing one RTT on top of its work; with k in flight, the step's microbatch phase is the larger
of ceil(M/k) chains and the busiest resource's M services plus the pipeline's fill (one chain); then
the commit (`commit_seconds`): the trainer long-polls every stage (stage.info with until_step), and
a peer answers when it commits, or at once when it committed before the poll reached it, so the
trainer sees the commit the larger of the stage's wait for its sync tick and one RTT after its
last reply. Its
three constants are measured in this run at RTT 0, where no latency hides anything: the
chain's work, the busiest resource's time per microbatch and the commit's, the values that fit
the RTT-0 steps at every k best (`calibrate`). Each RTT's points are measured right after a block
of RTT-0 points of their own and predicted from those: on a machine shared with other work the
load drifts in minutes, and one calibration at the start carried an early load spike into every
prediction (25% off in one run, against 7% in the next). For this tiny model the bytes' transfer time (a few KB
per call at 200 Mb/s, tens of microseconds) is inside the chain's work. The RTT-0 rows are therefore
the calibration; every other row is a prediction.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
sys.path.insert(0, str(BENCH.parent))

from swarmd.client import Client  # noqa: E402
from swarmd.swarmproc import FAST_ENV, LocalSwarm, SwarmSettings, follow_logs, install_signal_handlers  # noqa: E402


def _load_bench(name: str, filename: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


pipeline = _load_bench("swarmd_bench_pipeline", "pipeline.py")
wan_link = _load_bench("swarmd_bench_wan_link", "wan_link.py")

#: The job: small enough that two cores shared with other work keep up, so latency is what shows.
JOB = {"d_model": 32, "n_heads": 2, "layers_per_stage": 1, "seq_len": 16, "global_samples": 16,
       "microbatch_samples": 1, "codec": "fp16+lz4", "seed": 0}
RTTS_MS = (0, 50, 100, 200)
IN_FLIGHT = (1, 4, 16)
#: A lone stage peer commits at its first sync tick after the step's last gradient arrived
#: (StageLimits.sync_interval_s; the daemons here keep the default): the commit's wait, uniform over it.
SYNC_TICK_S = 0.1
#: Points per axis of the calibration's grid search (chain x commit).
CALIBRATION_GRID = 100
#: A point's measured window lasts at least `--steps` steps and at least this long: short steps
#: (RTT 0, 16 in flight: ~0.2 s) are noisy one by one on a shared machine, and 4 of them measured
#: 0.8-1.2x of each other's rate from run to run.
MIN_WINDOW_S = 10.0
#: How long a job may take to reach its last measured step before the point is given up.
POINT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Calibration:
    """What the model takes from the RTT-0 points: seconds per microbatch of the chain's serial work,
    of the busiest resource, and of a step's commit."""

    chain_s: float
    busy_s: float
    commit_s: float


def predict(cal: Calibration, rtt_s: float, in_flight: int, microbatches: int, stages: int,
            global_samples: int) -> float:
    """Samples/s at this RTT and in-flight count (see the module's docstring)."""
    return global_samples / step_seconds(cal, rtt_s, in_flight, microbatches, stages)


def step_seconds(cal: Calibration, rtt_s: float, in_flight: int, microbatches: int, stages: int) -> float:
    """A step: the microbatch phase, then the commit. In the phase, each of ceil(M/k) rounds of
    k microbatches costs a chain; and however many are in flight, the busiest resource serves the M
    microbatches one after another, the first of them only after a whole chain (the pipeline's fill),
    hence M×busy + chain - busy."""
    chain = cal.chain_s + (2 * stages - 1) * rtt_s
    fill_and_serve = microbatches * cal.busy_s + chain - cal.busy_s
    phase = max(fill_and_serve, math.ceil(microbatches / in_flight) * chain)
    return phase + commit_seconds(cal, rtt_s)


def commit_seconds(cal: Calibration, rtt_s: float, tick_s: float = SYNC_TICK_S) -> float:
    """From the trainer's last reply of a step to its seeing every stage's commit. Stage 0 commits
    last, w after its last backward arrived: at its next sync tick (w uniform over `tick_s`), plus a
    little work. That backward arrived half an RTT before the trainer had its reply; the trainer's
    long-poll then reaches stage 0 half an RTT after the reply, is answered at the commit or, if the
    commit came first, at once, and takes half an RTT back: max(w, RTT) after the reply.
    E[max(U(0, T), r)] is (T² + r²) / 2T below T, r above; `commit_s` (measured at RTT 0) is its
    value at r = 0, T/2, plus the commit's fixed work."""
    spread = rtt_s if rtt_s >= tick_s else (tick_s ** 2 + rtt_s ** 2) / (2 * tick_s)
    return cal.commit_s + spread - tick_s / 2


def calibrate(zero: dict[int, float], microbatches: int, stages: int, global_samples: int) -> Calibration:
    """The three constants that make the model meet the RTT-0 steps best, worst relative error
    first. The largest k pins the busiest resource given the other two; the chain and the commit
    are searched on a grid (the RTT-0 runs are the noisiest here: every hop of a lone microbatch
    waits for a busy core, so the fit spreads that noise instead of trusting k = 1 alone)."""
    step = {k: global_samples / rate for k, rate in sorted(zero.items())}
    hi = max(step)
    chain_top = 1.5 * step[min(step)] / math.ceil(microbatches / min(step))

    def solve(chain: float, commit: float) -> Calibration:
        busy = max(0.0, (step[hi] - commit - chain) / max(1, microbatches - 1))
        return Calibration(chain_s=chain, busy_s=busy, commit_s=commit)

    def error(cal: Calibration) -> float:
        return max(abs(step_seconds(cal, 0.0, k, microbatches, stages) / step[k] - 1) for k in step)

    grid = [solve(chain_top * i / CALIBRATION_GRID, step[hi] * j / CALIBRATION_GRID)
            for i in range(1, CALIBRATION_GRID + 1) for j in range(CALIBRATION_GRID)]
    return min(grid, key=error)


# ------------------------------------------------------------------------------------- the run


def job_args(stages: int, in_flight: int) -> argparse.Namespace:
    return argparse.Namespace(**JOB, stages=stages, in_flight=in_flight)


async def measure_point(trainer, servers, stages: int, rtt_ms: float, in_flight: int, warmup: int,
                        steps: int, block: int) -> dict[str, Any]:
    # A job's id is its spec's hash: the name keeps each point's job apart from the cancelled ones.
    raw = {**pipeline.job_dict(job_args(stages, in_flight), warmup + steps + 1000),
           "name": f"wan-b{block}-rtt{rtt_ms:g}-k{in_flight}"}
    async with Client(trainer.socket) as client:
        job = (await client.submit(raw, [], trainers=1))["job"]
    run = pipeline.SwarmRun()
    await asyncio.gather(*(pipeline.serve_stage(peer, job, i) for i, peer in enumerate(servers)))
    async with asyncio.TaskGroup() as tg:
        follower = tg.create_task(follow_logs(trainer, job, run.events))
        try:
            await pipeline.wait_steps(run, warmup, POINT_TIMEOUT_S)
            window_start = time.time()
            await pipeline.wait_steps(run, warmup + steps, POINT_TIMEOUT_S)
            await asyncio.sleep(max(0.0, window_start + MIN_WINDOW_S - time.time()))
            last = run.committed_by(time.time())
            await pipeline.wait_steps(run, last + 1, POINT_TIMEOUT_S)  # the window ends on a commit
        finally:
            follower.cancel()
    async with Client(trainer.socket) as client:
        await client.cancel(job)
    commits = dict(sorted((int(e["step"]), float(e["ts"])) for e in run.events if e.get("kind") == "step"))
    times = [commits[s] for s in range(warmup, max(commits) + 1)]
    steps = len(times) - 1
    rate = steps * JOB["global_samples"] / (times[-1] - times[0])
    return {"in_flight": in_flight, "measured_samples_per_s": round(rate, 3),
            "step_s": [round(b - a, 3) for a, b in zip(times, times[1:])]}


def sweep(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    rows, started = [], time.monotonic()
    settings = SwarmSettings(log_level="warning", env={**FAST_ENV, **pipeline.PINNED_ENV})
    with wan_link.wan_star(peers=1 + args.stages, rtt_ms=0, rate_mbit=args.rate) as star:
        with LocalSwarm(root, settings) as swarm:
            trainer = swarm.spawn(host=star.addr(0), netns=star.namespaces[0])
            servers = [swarm.spawn(bootstrap=(trainer.address,), host=star.addr(i), netns=star.namespaces[i])
                       for i in range(1, 1 + args.stages)]
            swarm.wait_ready([trainer, *servers])
            startup_s = time.monotonic() - started
            for block, rtt in enumerate(r for r in args.rtts if r != 0):
                for point_rtt in (0, rtt):  # each RTT right after its own calibration: load drifts
                    star.set_rtt(point_rtt)
                    for k in args.in_flight:
                        row = asyncio.run(measure_point(trainer, servers, args.stages, point_rtt, k,
                                                        args.warmup_steps, args.steps, block))
                        rows.append({"block": block, "rtt_ms": point_rtt, **row})
                        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {"rows": rows, "startup_s": round(startup_s, 1), "delay_line": star.delay_stats}


def with_predictions(rows: list[dict], stages: int) -> tuple[list[dict], list[dict]]:
    """Each block's rows predicted from that block's own RTT-0 points (measured just before)."""
    gs = JOB["global_samples"]
    microbatches = gs // JOB["microbatch_samples"]
    calibrations = []
    for block in sorted({r["block"] for r in rows}):
        mine = [r for r in rows if r["block"] == block]
        zero = {r["in_flight"]: r["measured_samples_per_s"] for r in mine if r["rtt_ms"] == 0}
        cal = calibrate(zero, microbatches, stages, gs)
        calibrations.append({"block": block, **{k: round(v, 5) for k, v in vars(cal).items()}})
        for r in mine:
            r["predicted_samples_per_s"] = round(predict(cal, r["rtt_ms"] / 1000, r["in_flight"], microbatches,
                                                        stages, gs), 3)
            r["predicted_over_measured"] = round(r["predicted_samples_per_s"] / r["measured_samples_per_s"], 3)
    return rows, calibrations


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k in sorted({r["in_flight"] for r in rows}):
        xs = sorted({r["rtt_ms"] for r in rows if r["in_flight"] == k})

        def mean(key: str, rtt: float) -> float:  # RTT 0 was measured once per block
            values = [r[key] for r in rows if r["in_flight"] == k and r["rtt_ms"] == rtt]
            return sum(values) / len(values)

        line, = ax.plot(xs, [mean("measured_samples_per_s", x) for x in xs], "o-", label=f"measured, {k} in flight")
        ax.plot(xs, [mean("predicted_samples_per_s", x) for x in xs], "x--", color=line.get_color(),
                label=f"model, {k} in flight")
    ax.set_xlabel("round trip between daemons (ms)")
    ax.set_ylabel("samples/s")
    ax.set_yscale("log")
    ax.set_title("swarm behind delayed links: measured vs overlap model")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(","))
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated non-negative integers, got {text!r}")
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="RTT 0 and 100 only, 3 measured steps")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--rate", type=float, default=200.0, help="Mb/s of every link, each way")
    parser.add_argument("--rtts", type=_ints, default=RTTS_MS, help="ms, comma-separated; must include 0")
    parser.add_argument("--in-flight", type=_ints, default=IN_FLIGHT)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per point")
    parser.add_argument("--png", type=Path, default=BENCH / "out" / "wan_pipeline.png")
    args = parser.parse_args()
    if args.quick:
        args.rtts, args.steps = (0, 100), 3
    if 0 not in args.rtts or len(args.rtts) < 2 or min(args.in_flight) < 1 or args.stages < 2 or args.steps < 2:
        parser.error("--rtts must include 0 (the calibration) and another; in-flight >= 1; steps, stages >= 2")
    reason = wan_link.unavailable_reason()
    if reason is not None:
        print(json.dumps({"bench": "wan_pipeline", "skipped": reason}))
        return 0
    install_signal_handlers()
    with tempfile.TemporaryDirectory(prefix="swarmd-wan-pipeline-") as tmp:
        result = sweep(args, Path(tmp))
    rows, calibrations = with_predictions(result["rows"], args.stages)
    worst = max(abs(r["predicted_over_measured"] - 1) for r in rows)
    report = {"bench": "wan_pipeline", "stages": args.stages, "rate_mbps": args.rate, "job": JOB,
              "calibrations": calibrations, "latency": rows, "worst_prediction_error": round(worst, 3),
              "png": str(plot(rows, args.png)), "startup_s": result["startup_s"],
              "delay_line": result["delay_line"], "load_average_1m": round(os.getloadavg()[0], 2)}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
