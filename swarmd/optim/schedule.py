"""Learning rate as a pure function of the step, so every peer of a stage and the reference agree.

Linear warmup from lr/(warmup+1) (never zero: a zero first step wastes a global batch), then cosine
or linear decay from `lr` to `min_lr` at the job's last step, or constant.
"""

from __future__ import annotations

import math

from swarmd.job.spec import OptimSpec


def lr_at(optim: OptimSpec, total_steps: int, step: int) -> float:
    """The learning rate for optimizer step `step` (0-based) of a job of `total_steps` steps."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / (optim.warmup_steps + 1)
    if optim.schedule == "constant":
        return optim.lr
    progress = min(1.0, (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps))
    if optim.schedule == "cosine":
        return optim.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (optim.lr - optim.min_lr)
    return optim.lr - progress * (optim.lr - optim.min_lr)
