"""Convergence parity under preemption: a swarm that loses peers reaches the loss one process reaches.

    .venv/bin/python bench/convergence.py [--quick] [--stages 3] [--peers-per-stage 2]
                                          [--preempt-every 15] [--steps N] [--out bench/out]

Same spec, same data order, same global batch on both sides (examples/demo.toml unless --spec):

- baseline: `swarmd.reference` in this process, one torch thread, timed;
- swarm: a `swarmd.swarmproc.LocalSwarm` on loopback, one daemon whose trainer drives the job and
  `stages × peers-per-stage` daemons serving its stages; every `--preempt-every` seconds a random
  stage peer (from a stage that keeps another) is SIGKILLed and a fresh peer joins (swarmd.demo's
  loop, shared so the demo shows what this measures).

Prints ONE JSON object: both final losses (mean of the last 10% of steps) and their ratio, the
preemptions survived, retries, duplicate samples, steps short of `global_samples`, samples/s of
each side, and `target_met` (ratio <= 1.03, >= 10 preemptions, no short step; --quick runs are too
short to count). The curves against samples seen go to OUT/convergence.png. Retries, duplicates and
short steps come from the job's step events; a field the daemon does not report is null, never 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any, Iterable

BENCH = Path(__file__).resolve().parent
# Run as a script, bench/ is first on sys.path and bench/transport.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]

import torch  # noqa: E402

from swarmd.client import ControlError, DaemonUnavailable  # noqa: E402
from swarmd.demo import DEFAULT_SPEC, Bar, Plan, Progress, preemption_marks, run_job  # noqa: E402
from swarmd.job.spec import JobSpec  # noqa: E402
from swarmd.plot import LossCurve, baseline_curve, curve_from_events, render, step_events, step_index, write_events  # noqa: E402
from swarmd.swarmproc import LocalSwarm, SwarmError, SwarmSettings, install_signal_handlers  # noqa: E402

TARGET_RATIO = 1.03
TARGET_PREEMPTIONS = 10
# Full: about five minutes of swarm training on 2 cores, long enough for well over 10 preemptions.
QUICK = {"steps": 60, "preempt_every": 5.0}
FULL = {"steps": 1000, "preempt_every": 15.0}


def swarm_counters(events: Iterable[dict[str, Any]], global_samples: int, microbatch_samples: int,
                   steps: int) -> dict[str, Any]:
    """Retries, duplicates and short steps from the step events (the last report of each step), each
    None when no event carries the field.

    A step is short when some stage reports fewer samples summed than `global_samples` (-1 means the
    stage did not report, which counts neither way); a step with no event at all is missing."""
    by_step = {step_index(e): e for e in events if e.get("kind") == "step"}
    reports = list(by_step.values())

    def carried(key: str) -> list[Any]:
        return [e[key] for e in reports if e.get(key) is not None]

    retries, resent, duplicates, stage_samples = (carried(k) for k in ("retries", "resent", "duplicates",
                                                                       "stage_samples"))
    duplicate_microbatches = sum(max(n, 0) for per_stage in duplicates for n in per_stage) if duplicates else None
    return {
        "retries": sum(retries) if retries else None,
        "resent": sum(resent) if resent else None,
        "duplicate_microbatches": duplicate_microbatches,
        "duplicate_samples": None if duplicate_microbatches is None else duplicate_microbatches * microbatch_samples,
        "short_steps": (sum(1 for per_stage in stage_samples if any(0 <= n < global_samples for n in per_stage))
                        if stage_samples else None),
        "missing_steps": sum(1 for s in range(steps) if s not in by_step),
    }


def run_baseline(spec: JobSpec, base_dir: Path) -> tuple[LossCurve, float]:
    started = time.monotonic()
    curve = baseline_curve(spec, base_dir)
    return curve, time.monotonic() - started


def run_swarm(plan: Plan, root: Path, progress: Progress) -> tuple[dict[str, Any], float]:
    bar = Bar(sys.stderr, live=False)
    with LocalSwarm(root, SwarmSettings(log_level="warning")) as swarm:
        trainer, *_ = swarm.start(plan.peers + 1)
        started = time.monotonic()
        progress.started = time.time()
        final = asyncio.run(run_job(swarm, trainer, plan, progress, bar))
        return final, time.monotonic() - started


def bench(args: argparse.Namespace) -> dict[str, Any]:
    preset = QUICK if args.quick else FULL
    raw = tomllib.loads(args.spec.read_text())
    raw["steps"] = args.steps or preset["steps"]
    raw.setdefault("pipeline", {})["stages"] = args.stages
    spec = JobSpec.from_dict(raw)
    base_dir = args.spec.resolve().parent
    gs = spec.batch.global_samples
    preempt_every = preset["preempt_every"] if args.preempt_every is None else args.preempt_every

    torch.set_num_threads(1)
    baseline, baseline_s = run_baseline(spec, base_dir)

    peers = args.stages * args.peers_per_stage
    plan = Plan(spec, raw, base_dir, peers, preempt_every, args.timeout, random.Random(args.seed))
    progress = Progress(spec.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="swarmd-convergence-") as tmp:
        try:
            final, swarm_s = run_swarm(plan, Path(tmp), progress)
        except (SwarmError, ControlError, DaemonUnavailable, TimeoutError) as exc:
            # The baseline is still a measurement; say exactly what the swarm side could not do.
            return {"bench": "convergence", "quick": args.quick, "spec": spec.name, "steps": spec.steps,
                    "error": f"swarm: {type(exc).__name__}: {exc}", "swarm_steps": len(step_events(progress.events)),
                    "baseline_final_loss": baseline.final_loss(), "swarm_final_loss": None,
                    "final_loss_ratio": None, "preemptions": 0, "short_steps": None, "duplicate_samples": None,
                    "swarm_samples_per_s": None, "baseline_samples_per_s": len(baseline.steps) * gs / baseline_s,
                    "target_met": False}
        finally:
            write_events(progress.events, args.out / "convergence-events.jsonl")

    swarm = curve_from_events(progress.events, gs, "swarm (with preemptions)")
    counters = swarm_counters(progress.events, gs, spec.batch.microbatch_samples, spec.steps)
    plot = render([swarm, baseline], args.out / "convergence.png",
                  f"{spec.name}: {args.stages} stages x {args.peers_per_stage} peers, "
                  f"{len(progress.preemptions)} preemptions vs one process",
                  marks=preemption_marks(progress.preemptions, gs))
    ratio = swarm.final_loss() / baseline.final_loss()
    survived = len(progress.preemptions) if final.get("state") == "done" else 0
    rejoins = [p.rejoin_s for p in progress.preemptions if p.rejoin_s is not None]
    return {
        "bench": "convergence", "quick": args.quick, "spec": spec.name, "steps": spec.steps,
        "global_samples": gs, "stages": args.stages, "peers_per_stage": args.peers_per_stage,
        "preempt_every_s": preempt_every, "job_state": final.get("state"),
        "baseline_final_loss": baseline.final_loss(), "swarm_final_loss": swarm.final_loss(),
        "final_loss_ratio": ratio, "preemptions": survived, "preemptions_attempted": len(progress.preemptions),
        "mean_rejoin_s": sum(rejoins) / len(rejoins) if rejoins else None,
        **counters,
        "swarm_steps": len(swarm.steps), "swarm_wall_s": swarm_s, "baseline_wall_s": baseline_s,
        "swarm_samples_per_s": len(swarm.steps) * gs / swarm_s,
        "baseline_samples_per_s": len(baseline.steps) * gs / baseline_s,
        "baseline_losses": list(baseline.losses), "swarm_losses": list(swarm.losses),
        "target_met": (not args.quick and ratio <= TARGET_RATIO and survived >= TARGET_PREEMPTIONS
                       and counters["short_steps"] == 0 and counters["missing_steps"] == 0),
        "plot": str(plot),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"{QUICK['steps']} steps, a preemption every "
                                                        f"{QUICK['preempt_every']:g} s (a smoke run; no target)")
    p.add_argument("--spec", type=Path, default=DEFAULT_SPEC, help="job spec (default: %(default)s)")
    p.add_argument("--steps", type=int, help=f"optimizer steps (default {FULL['steps']}, quick {QUICK['steps']})")
    p.add_argument("--stages", type=int, default=3, choices=(3, 4))
    p.add_argument("--peers-per-stage", type=int, default=2, choices=(2, 3))
    p.add_argument("--preempt-every", type=float, help=f"seconds (default {FULL['preempt_every']:g})")
    p.add_argument("--seed", type=int, default=0, help="which peers get preempted")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up on the swarm after this long")
    p.add_argument("--out", type=Path, default=BENCH / "out")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    install_signal_handlers()
    result = bench(args)
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
