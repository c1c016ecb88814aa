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
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from swarmd.job.data import TrainingData
from swarmd.job.sources import open_training_data
from swarmd.job.errors import DataError, SpecError
from swarmd.job.spec import JobSpec, load_spec
from swarmd.model.export import ExportError
from swarmd.model.composed import ComposedModel
from swarmd.model.init import build_initial_stage
from swarmd.model.precision import LossScaler, Precision, PrecisionError
from swarmd.optim.stage_optimizer import NonFiniteGradient, StageOptimizer, StepReport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReferenceStep:
    step: int
    loss: float  # mean over the global batch, before this step's update
    reports: tuple[StepReport, ...]  # one per stage


class ReferenceTrainer:
    """`device` is where it computes (CPU unless `[compute] dtype` is fp16, which needs CUDA)."""

    def __init__(self, spec: JobSpec, data: TrainingData, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.data = data
        self.device = torch.device(device)
        self.precision = Precision(spec.compute.dtype)
        self.precision.check(self.device)
        n = spec.pipeline.stages
        self.model = ComposedModel([build_initial_stage(spec.model.config, i, n, spec.seed, self.device,
                                                        spec.model.init, spec.model.init_digest) for i in range(n)])
        # fp16: one scaler per stage, in its optimizer, exactly as each stage of the swarm keeps its own.
        self.optimizers = [StageOptimizer(stage, spec.optim, spec.steps, offload=spec.compute.optimizer_offload,
                                          scaler=LossScaler(spec.compute.loss_scale, spec.compute.growth_interval)
                                          if self.precision.scaled else None)
                           for stage in self.model.stages]
        self.scalers = [opt.scaler for opt in self.optimizers if opt.scaler is not None]
        self.step = 0

    @classmethod
    def from_spec(cls, spec: JobSpec, base_dir: str | Path, device: torch.device | str = "cpu") -> "ReferenceTrainer":
        data = open_training_data(spec.data, spec.batch, spec.model.config.vocab, spec.seed, base_dir,
                                  evaluation=spec.eval)
        return cls(spec, data, device)

    def train_step(self) -> ReferenceStep:
        loss_sum = 0.0
        for index in range(self.spec.batch.microbatches_per_step):
            mb = self.data.microbatch(self.step, index)
            inputs, targets = mb.inputs.to(self.device), mb.targets.to(self.device)
            if self.scalers:
                loss_sum += self._scaled_microbatch(inputs, targets)
                continue
            with self.precision.autocast(self.device):
                loss = self.model(inputs, targets)  # sample-summed: gradients add up across microbatches
            loss.backward()
            loss_sum += loss.item()
        samples = self.spec.batch.global_samples
        if self.scalers:
            reports = tuple(self._scaled_step(opt, samples) for opt in self.optimizers)
        else:
            reports = tuple(opt.step(samples) for opt in self.optimizers)
        result = ReferenceStep(self.step, loss_sum / samples, reports)
        self.step += 1
        return result

    @torch.no_grad()
    def evaluate(self) -> float:
        """The mean loss of the job's held-out samples ([eval]) on the parameters now: what a
        swarm trainer's evaluation after the same number of steps reports (swarmd/train/evaluation.py)."""
        loss_sum, samples = 0.0, 0
        for index in range(self.data.eval_batch_count()):
            batch = self.data.eval_batch(index)
            with self.precision.autocast(self.device):
                loss_sum += self.model(batch.inputs.to(self.device), batch.targets.to(self.device)).item()
            samples += len(batch.sample_indices)
        if not samples:
            raise ValueError("the job has no [eval] samples")
        return loss_sum / samples

    def _scaled_microbatch(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """fp16 as the swarm runs it: each stage's backward seeded with its incoming gradient times
        its own scale, the gradient it passes on unscaled, and zeros passed on where it overflowed
        (a stage refuses a non-finite gradient; the overflowing stage skips its step)."""
        stages, leaves, outputs = self.model.stages, [], []
        x = inputs
        with self.precision.autocast(self.device):
            for stage in stages:
                leaf = x.detach().requires_grad_(not stage.is_first)
                leaves.append(leaf)
                outputs.append(stage(leaf, targets) if stage.is_last else stage(leaf))
                x = outputs[-1]
        grad = torch.ones_like(outputs[-1])
        for stage, leaf, out, scaler in reversed(list(zip(stages, leaves, outputs, self.scalers))):
            out.backward(grad * scaler.scale)
            if stage.is_first:
                break
            grad = leaf.grad / scaler.scale
            if not bool(torch.isfinite(grad).all()):
                grad = torch.zeros_like(grad)
        return outputs[-1].item()

    def _scaled_step(self, opt: StageOptimizer, samples: int) -> StepReport:
        """The stage's step on gradient sums scaled by S (the optimizer divides by samples·S and
        moves S). An overflow skips the update but not the step, as a stage does
        (StageService._skip_step)."""
        try:
            return opt.step(samples)
        except NonFiniteGradient:
            report = StepReport(opt.step_count, opt.lr, math.inf, False)
            opt.optimizer.zero_grad(set_to_none=True)
            opt.step_count += 1
            return report

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
    except (SpecError, DataError, ExportError, PrecisionError) as exc:
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
