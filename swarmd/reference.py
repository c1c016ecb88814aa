"""The single-process reference trainer: what SWARM training of a job must reproduce.

Same spec, same stage modules (built by the same registry calls, so the same initial bits), same
data order, same global batch; each stage has its own `StageOptimizer`, exactly as each stage of
the swarm does, fed the gradient *sum* over the step's microbatches and the step's sample count.
Equivalence tests, `make demo`'s baseline curve and bench/convergence.py all compare against it.

    python -m swarmd.reference job.toml --steps N --out losses.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from swarmd.job.data import TrainingData, open_training_data
from swarmd.job.errors import DataError, SpecError
from swarmd.job.spec import JobSpec, load_spec
from swarmd.model.export import ExportError
from swarmd.model.composed import ComposedModel
from swarmd.model.init import build_initial_stage
from swarmd.optim.stage_optimizer import StageOptimizer, StepReport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReferenceStep:
    step: int
    loss: float  # mean over the global batch, before this step's update
    reports: tuple[StepReport, ...]  # one per stage


class ReferenceTrainer:
    def __init__(self, spec: JobSpec, data: TrainingData) -> None:
        self.spec = spec
        self.data = data
        n = spec.pipeline.stages
        self.model = ComposedModel([build_initial_stage(spec.model.config, i, n, spec.seed, "cpu", spec.model.init,
                                                        spec.model.init_digest) for i in range(n)])
        self.optimizers = [StageOptimizer(stage, spec.optim, spec.steps) for stage in self.model.stages]
        self.step = 0

    @classmethod
    def from_spec(cls, spec: JobSpec, base_dir: str | Path) -> "ReferenceTrainer":
        data = open_training_data(spec.data, spec.batch, spec.model.config.vocab, spec.seed, base_dir)
        return cls(spec, data)

    def train_step(self) -> ReferenceStep:
        loss_sum = 0.0
        for index in range(self.spec.batch.microbatches_per_step):
            mb = self.data.microbatch(self.step, index)
            loss = self.model(mb.inputs, mb.targets)  # sample-summed: gradients add up across microbatches
            loss.backward()
            loss_sum += loss.item()
        samples = self.spec.batch.global_samples
        reports = tuple(opt.step(samples) for opt in self.optimizers)
        result = ReferenceStep(self.step, loss_sum / samples, reports)
        self.step += 1
        return result

    def train(self, steps: int) -> list[ReferenceStep]:
        results = []
        for _ in range(steps):
            results.append(self.train_step())
            log.info("step %d loss %.4f lr %.3g", results[-1].step, results[-1].loss, results[-1].reports[0].lr)
        return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swarmd.reference", description=__doc__.splitlines()[0])
    parser.add_argument("spec", type=Path, help="job spec (TOML)")
    parser.add_argument("--steps", type=int, help="steps to train (default: the spec's steps)")
    parser.add_argument("--out", type=Path, help="write per-step losses and learning rates as JSON here")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        spec = load_spec(args.spec)
        trainer = ReferenceTrainer.from_spec(spec, args.spec.parent)
        steps = spec.steps if args.steps is None else args.steps
        results = []
        for _ in range(steps):
            results.append(trainer.train_step())
            print(f"step {results[-1].step} loss {results[-1].loss:.4f}", flush=True)
    except (SpecError, DataError, ExportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        summary = {"job": spec.name, "steps": steps, "losses": [r.loss for r in results],
                   "lrs": [r.reports[0].lr for r in results],
                   "grad_norms": [[rep.grad_norm for rep in r.reports] for r in results]}
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
