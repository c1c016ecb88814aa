"""Never trust a reply: every tensor a stage peer returns is checked before the trainer uses it.

A peer with a broken GPU, a bug or bad intentions could return the wrong shape, the wrong dtype or
NaNs; passing that on would poison the next stage or every peer's gradients. A reply that fails
these checks bans its peer and the call goes elsewhere, exactly like a connection error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from swarmd.job.spec import JobSpec
from swarmd.model import TensorSpec, build_stage
from transport.rpc import Message


@dataclass(frozen=True)
class StageShapes:
    """What stage i takes and returns for one microbatch."""

    input: TensorSpec
    output: TensorSpec  # a () loss on the last stage


def stage_shapes(spec: JobSpec) -> list[StageShapes]:
    """Each stage's shapes, asked of the architecture itself. Builds one stage at a time and drops
    it (the registry has no shape-only call), so this costs one stage's memory briefly: run it in a
    worker thread."""
    B, T = spec.batch.microbatch_samples, spec.data.seq_len
    shapes = []
    for i in range(spec.pipeline.stages):
        stage = build_stage(spec.model.config, i, spec.pipeline.stages, spec.seed)
        shapes.append(StageShapes(stage.input_spec(B, T), stage.output_spec(B, T)))
        del stage
    return shapes


def _tensor_problem(tensor: torch.Tensor, expected: TensorSpec, what: str) -> str | None:
    reason = expected.mismatch(tensor)
    if reason is not None:
        return f"{what}: {reason}"
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        return f"{what} is not finite"
    return None


def _count_problem(reply: Message, count: int, what: str) -> str | None:
    if len(reply.tensors) != count:
        return f"{what}: expected {count} tensor(s), got {len(reply.tensors)}"
    return None


def check_forward(reply: Message, expected: TensorSpec) -> str | None:
    """Why a `stage.forward` reply is unusable, or None."""
    return _count_problem(reply, 1, "forward reply") or _tensor_problem(reply.tensors[0], expected, "activations")


def check_backward(reply: Message, x: torch.Tensor, first: bool) -> str | None:
    """Why a `stage.backward` reply is unusable: the input gradient must look like the input (the
    first stage's input is token ids, so it returns nothing)."""
    if first:
        return _count_problem(reply, 0, "backward reply of the first stage")
    return _count_problem(reply, 1, "backward reply") or _tensor_problem(
        reply.tensors[0], TensorSpec(tuple(x.shape), x.dtype), "input gradient")


def check_forward_backward(reply: Message, x: torch.Tensor, first: bool) -> str | None:
    """Why a `stage.forward_backward` reply is unusable: a finite `loss_sum`, and the input gradient
    unless the last stage is also the first."""
    loss = reply.meta.get("loss_sum")
    if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return f"loss_sum is {loss!r}, not a finite number"
    return check_backward(reply, x, first)


def disagreement(a: torch.Tensor, b: torch.Tensor, rtol: float) -> str | None:
    """Why two stage-mates' answers to the same forward cannot both be right, or None. Relative to
    the larger norm, so a lossy activation codec's rounding (well under `rtol`) passes while a
    peer returning another microbatch's or random activations does not."""
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} and {tuple(b.shape)} differ"
    a, b = a.float(), b.float()
    scale = max(float(a.norm()), float(b.norm()))
    gap = float((a - b).norm())
    if gap > rtol * scale:
        return f"answers differ by {gap / max(scale, 1e-30):.3g} relative (tolerance {rtol:g})"
    return None
