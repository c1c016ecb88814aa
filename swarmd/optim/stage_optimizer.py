"""One stage's optimizer step on a gradient sum: divide by the samples, clip, schedule, step.

Stage peers sum parameter gradients over the microbatches they served, all-reduce those sums, and
then call `StageOptimizer.step(total_samples)`; the single-process reference calls the very same
method on its own sums, so the two can only differ by floating-point summation order. Clipping is
per stage, on the averaged gradient: a global norm across stages would need a cross-stage exchange
every step, and SWARM's stages step independently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from swarmd.errors import SwarmdError
from swarmd.job.spec import OptimSpec
from swarmd.model.precision import LossScaler
from swarmd.optim.lamb import Lamb
from swarmd.optim.schedule import lr_at

CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_: keeps the scale finite for a zero norm


class NonFiniteGradient(SwarmdError, ArithmeticError):
    """The averaged gradient holds inf or nan; the step was not taken and parameters are unchanged."""


@dataclass(frozen=True)
class StepReport:
    step: int  # the step just taken (0-based)
    lr: float
    grad_norm: float  # of the averaged gradient, before clipping
    clipped: bool


def param_groups(named_parameters: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Matrices and embeddings decay; norms and biases (every tensor under 2-D) do not: decaying a
    LayerNorm gain toward 0 or a bias toward 0 only fights the model."""
    decay, no_decay = [], []
    for _, p in named_parameters:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(named_parameters: Iterable[tuple[str, nn.Parameter]], optim: OptimSpec) -> torch.optim.Optimizer:
    groups = param_groups(named_parameters, optim.weight_decay)
    if optim.name == "adamw":
        # foreach=False: one code path on every peer and in the reference, whatever the device.
        return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, foreach=False)
    if optim.name == "lamb":
        return Lamb(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps)
    return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum, foreach=False)


class StageOptimizer:
    """The optimizer, its LR schedule and clipping for one stage module; `step_count` steps taken.

    `offload` (`[compute] optimizer_offload`, the paper's setting): the optimizer's state (AdamW's
    two moments: twice the parameters) lives in host memory, pinned when the parameters are on a
    GPU, so the device holds only parameters, gradients and activations. The optimizer steps host
    copies of the parameters: each step copies the parameters and gradients to the host, steps
    there and copies the parameters back. The host copies are refreshed from the module every step
    rather than kept as the truth, so whatever loads parameters into the module (a downloaded state,
    a checkpoint) needs no hook here. The arithmetic is the same either way (bitwise on one
    device), and the state's layout too: a snapshot moves between offloading and other peers.

    `scaler` (fp16): the stage's dynamic loss scale S. Its gradient sums are S times the true ones,
    so a step divides by samples x S; every step, taken or skipped for a non-finite gradient,
    updates S once. It lives here because it is optimizer state: it travels with a snapshot to
    joiners and checkpoints, and every mate, stepping on the same all-reduced sum, moves it alike."""

    def __init__(self, module: nn.Module, optim: OptimSpec, total_steps: int, offload: bool = False,
                 scaler: LossScaler | None = None) -> None:
        self.module = module
        self.spec = optim
        self.total_steps = total_steps
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.offload = offload
        if offload:
            self.host = {id(p): _host_copy(p) for p in self.params}
            named = [(name, self.host[id(p)]) for name, p in module.named_parameters() if p.requires_grad]
            self.optimizer = build_optimizer(named, optim)
        else:
            self.optimizer = build_optimizer(module.named_parameters(), optim)
        self.scaler = scaler
        self.step_count = 0

    @property
    def loss_scale(self) -> float:
        """What the stage's backward seeds are multiplied by: S under fp16, else 1."""
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return lr_at(self.spec, self.total_steps, self.step_count)

    @torch.no_grad()
    def step(self, sample_count: int) -> StepReport:
        """Turn the accumulated gradient *sums* into the mean over `sample_count` samples, clip,
        step, and clear the gradients; a non-finite gradient raises before anything but the loss
        scale changes (an overflow halves it)."""
        if sample_count < 1:
            raise ValueError(f"sample_count must be at least 1, got {sample_count}")
        if not any(p.grad is not None for p in self.params):
            raise ValueError("no gradients accumulated for this step")
        if self.offload:
            self._to_host()
            stepped = [self.host[id(p)] for p in self.params]
        else:
            stepped = self.params
        grads = [p.grad for p in stepped if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
        if not math.isfinite(norm):
            if self.offload:
                for p in stepped:
                    p.grad = None  # the module's own gradients stay, as without offload
            if self.scaler is not None:
                self.scaler.update(True)
            raise NonFiniteGradient(f"gradient norm is {norm} at step {self.step_count}")
        divisor = sample_count * self.loss_scale
        norm /= divisor
        scale = 1.0 / divisor
        clipped = bool(self.spec.clip_norm) and norm > self.spec.clip_norm
        if clipped:
            scale *= self.spec.clip_norm / (norm + CLIP_EPS)
        for g in grads:
            g.mul_(scale)
        lr = self.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.offload:
            for p in self.params:
                p.copy_(self.host[id(p)])  # blocking: the next batch computes with these
                p.grad = None
        if self.scaler is not None:
            self.scaler.update(False)
        report = StepReport(self.step_count, lr, norm, clipped)
        self.step_count += 1
        return report

    def _to_host(self) -> None:
        """The module's parameters and gradients into the host copies the optimizer steps."""
        for p in self.params:
            host = self.host[id(p)]
            host.copy_(p.detach())
            host.grad = None if p.grad is None else p.grad.detach().to(host.device, copy=True)


def _host_copy(param: torch.Tensor) -> torch.Tensor:
    """A host tensor for `param`, pinned when it lives on a GPU (page-locked: copies at full bus
    speed); a leaf that requires grad, as the parameter, so the optimizer's groups take it."""
    host = torch.empty(param.shape, dtype=param.dtype, device="cpu", pin_memory=param.is_cuda)
    host.copy_(param.detach())
    return host.requires_grad_(param.requires_grad)
