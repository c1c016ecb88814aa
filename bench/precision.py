"""bf16 against fp32: the same job trained by the single-process reference in both, on CPU.

    .venv/bin/python bench/precision.py [--quick] [--spec examples/demo.toml] [--steps N] [--dtype bf16]

Same spec, data order, init and global batch on both sides; only `[compute] dtype` differs. Both
run in this process with one torch thread, one after the other. Prints ONE JSON object: each
side's final loss (mean of the last 10% of steps, as bench/convergence.py), their ratio, each side's
mean step time (the first 5% of steps, warm-up, left out) and that ratio, and `target_met`
(final-loss ratio within 2%). bf16 on a CPU without native bf16 matmuls (no AVX512-BF16/AMX) is
expected to be slower, not faster: the number is the point, not a target.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
# Run as a script, bench/ is first on sys.path and bench/transport.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]

import torch  # noqa: E402

from swarmd.job.spec import JobSpec, load_spec  # noqa: E402
from swarmd.reference import ReferenceTrainer  # noqa: E402

DEFAULT_SPEC = BENCH.parent / "examples" / "demo.toml"
TARGET_RATIO = 0.02
QUICK_STEPS = 60


def run(spec: JobSpec, base: Path, steps: int) -> dict:
    trainer = ReferenceTrainer.from_spec(spec, base)
    losses, times = [], []
    for _ in range(steps):
        started = time.perf_counter()
        losses.append(trainer.train_step().loss)
        times.append(time.perf_counter() - started)
    tail = losses[-max(1, steps // 10):]
    timed = times[max(1, steps // 20):] or times
    return {"final_loss": sum(tail) / len(tail), "first_loss": losses[0], "step_s": sum(timed) / len(timed)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", type=Path, default=DEFAULT_SPEC)
    p.add_argument("--steps", type=int, help="default: the spec's, or 60 with --quick")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dtype", default="bf16", choices=["bf16"], help="the low precision measured (fp16 needs CUDA)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    base = load_spec(args.spec)
    steps = args.steps or (QUICK_STEPS if args.quick else base.steps)
    raw = base.to_dict()
    raw["steps"] = steps
    fp32 = JobSpec.from_dict({**raw, "compute": {"dtype": "fp32"}})
    low = JobSpec.from_dict({**raw, "compute": {"dtype": args.dtype}})
    a, b = run(fp32, args.spec.parent, steps), run(low, args.spec.parent, steps)
    ratio = b["final_loss"] / a["final_loss"]
    print(json.dumps({
        "bench": "precision", "spec": str(args.spec), "steps": steps, "device": "cpu", "torch_threads": 1,
        "fp32": a, args.dtype: b, "final_loss_ratio": ratio, "step_time_ratio": b["step_s"] / a["step_s"],
        "target": f"|final_loss_ratio - 1| <= {TARGET_RATIO}", "target_met": abs(ratio - 1) <= TARGET_RATIO,
        "quick": args.quick,
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
