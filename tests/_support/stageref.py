"""The single-process reference the stage tests compare stage peers with: one stage of the job,
built from the job's seed, that applied each microbatch of each step exactly once."""

from __future__ import annotations

from typing import Callable

import torch

from swarmd.model import build_stage
from swarmd.optim import StageOptimizer


def reference_stage(spec, stage: int, stages: int, steps: int,
                    inputs: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
                    microbatches: int = 4) -> torch.nn.Module:
    """Stage `stage` of `stages` after `steps` optimizer steps, each summing the gradients of
    `microbatches` microbatches (`inputs(step, m)`: the input and the output gradient), as the
    stage's peers do between them."""
    ref = build_stage(spec.model.config, stage, stages, spec.seed)
    opt = StageOptimizer(ref, spec.optim, spec.steps)
    for step in range(steps):
        for m in range(microbatches):
            x, gy = inputs(step, m)
            ref(x).backward(gy)
        opt.step(spec.batch.global_samples)
        opt.optimizer.zero_grad(set_to_none=True)
    return ref
