"""The precision policy of a job (`[compute] dtype`): what runs in low precision, and loss scaling.

Parameters, gradient sums, the all-reduce and the optimizer state stay fp32 in every mode ("master
weights"): only a stage's forward and backward arithmetic runs under autocast, so what crosses the
network and what a checkpoint holds do not depend on the dtype, and an fp32 peer's state is a bf16
peer's state.

- `fp32`: no autocast.
- `bf16`: autocast to bfloat16 on CPU and CUDA. bf16 has fp32's exponent range, so gradients
  neither overflow nor underflow where fp32's would not: no loss scaling.
- `fp16`: autocast to float16, CUDA only (CPU fp16 kernels are slow or missing), with dynamic loss
  scaling per stage (`LossScaler`): fp16 gradients below ~6e-8 would flush to zero, so the
  backward of each stage starts from its incoming gradient (the last stage: its loss) times the
  stage's scale S, and the scaled gradient sums are divided by S at the step.

Overflow is decided per stage, not swarm-wide (docs/models.md): when a stage's all-reduced gradient
sum is not finite, every member of that stage (they all reduced the same sum) skips the update,
commits the step, and halves S; after `growth_interval` clean steps S doubles. Stages never talk to
each other, only through trainers' microbatches, so skipping swarm-wide would need a new agreement
round across all stages on every step; and a stage's overflow is a fact of its own scaled backward
(the gradient it passes back is unscaled, so it is not what overflows the stage before). Each
stage's S is a function of its committed history, which every mate shares, and travels with the
optimizer state to a joiner.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager, Literal

import torch

from swarmd.errors import LocalError

Dtype = Literal["fp32", "bf16", "fp16"]
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# torch's GradScaler defaults: a scale where fp16 gradients start well above underflow, doubled
# after this many clean steps; halving on overflow finds the right scale within a few steps.
INITIAL_SCALE = 2.0 ** 16
GROWTH_INTERVAL = 2000
MIN_SCALE = 1.0  # below 1 scaling only shrinks gradients: an overflow at S = 1 is a real one
MAX_SCALE = 2.0 ** 24  # a scaled fp32 loss past this loses fp16's whole range for no gain


class PrecisionError(LocalError):
    """This dtype cannot run on this device: the job's `[compute] dtype` or the daemon's device is
    what to change."""


@dataclass(frozen=True)
class Precision:
    dtype: Dtype = "fp32"

    def check(self, device: torch.device | str) -> None:
        """Refuse a combination that cannot run, before any work is accepted."""
        kind = torch.device(device).type
        if self.dtype == "fp16" and kind != "cuda":
            raise PrecisionError(f"compute.dtype fp16 needs a CUDA device (this peer computes on {kind}); "
                                 "use bf16 on CPU")

    def autocast(self, device: torch.device | str) -> ContextManager:
        """The context a stage's forward (and the recomputed forward of its backward) runs in."""
        if self.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device).type, dtype=AUTOCAST_DTYPES[self.dtype])

    @property
    def scaled(self) -> bool:
        """Whether stages scale their backward (fp16 only)."""
        return self.dtype == "fp16"


class LossScaler:
    """One stage's dynamic loss scale. `scale` multiplies the stage's backward seed; `update` is
    called once per committed step with whether its reduced gradient overflowed."""

    def __init__(self, initial: float = INITIAL_SCALE, growth_interval: int = GROWTH_INTERVAL) -> None:
        if not MIN_SCALE <= initial <= MAX_SCALE or growth_interval < 1:
            raise ValueError(f"loss scale must be in [{MIN_SCALE}, {MAX_SCALE}] and growth_interval >= 1")
        self.scale = float(initial)
        self.growth_interval = growth_interval
        self.good_steps = 0

    def update(self, overflowed: bool) -> None:
        if overflowed:
            self.scale = max(MIN_SCALE, self.scale / 2)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale = min(MAX_SCALE, self.scale * 2)
            self.good_steps = 0

    def state(self) -> dict[str, Any]:
        """msgpack-able, for the optimizer state's meta (joiners and checkpoints)."""
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load(self, state: Any) -> None:
        """Take a mate's scale, refusing anything a correct mate could not have sent."""
        if not isinstance(state, dict):
            raise ValueError("loss scale state must be a map")
        scale, good = state.get("scale"), state.get("good_steps")
        if not (isinstance(scale, float) and MIN_SCALE <= scale <= MAX_SCALE):
            raise ValueError(f"loss scale {scale!r} is outside [{MIN_SCALE}, {MAX_SCALE}]")
        if isinstance(good, bool) or not isinstance(good, int) or not 0 <= good < self.growth_interval:
            raise ValueError(f"good_steps {good!r} is outside [0, {self.growth_interval})")
        self.scale, self.good_steps = scale, good
