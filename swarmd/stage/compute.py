"""The arithmetic of one batch of stage work, run in a compute thread, never on the event loop.

Several compatible microbatches (same kind, step and shapes) are concatenated into one call and
each answer is split back out. Parameter gradients are taken with `torch.autograd.grad` rather than
left in `.grad`, so concurrent batches never race on the module, and are handed to the accumulator
only for microbatches this peer has not seen before; a repeat is recomputed for its input gradient
alone. Reads of the parameters hold a shared guard that the optimizer step takes exclusively, so a
batch sees one parameter version from its first kernel to its last.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Iterator

import torch

from swarmd.model import Stage
from swarmd.stage.accumulator import Accumulator
from swarmd.stage.errors import StaleStep

FORWARD, BACKWARD, FORWARD_BACKWARD = "forward", "backward", "forward_backward"
# `stage.evaluate`: forward only, no gradient anywhere; the last stage answers the loss sum.
EVALUATE = "evaluate"


class ParamGuard:
    """Many readers (compute batches) or one writer (the optimizer step, a state load)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
            self._writing = True  # from here no new reader enters
            self._cond.wait_for(lambda: self._readers == 0)
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


@dataclass(eq=False)
class Work:
    """One microbatch waiting for compute, with the future its RPC handler awaits."""

    kind: str
    step: int
    mb: int
    x: torch.Tensor
    other: torch.Tensor | None  # grad_y for backward, targets for forward_backward
    accumulate: bool  # the stage core admitted it (StageCore.admit); False: compute, answer, add nothing
    future: asyncio.Future
    epoch: int = 0  # the core's state epoch at admission: a state replaced since then adds nothing
    solo: bool = False  # never batched (an architecture without per-sample losses)
    started: bool = False  # set on the loop when a worker takes it
    added: bool = False  # set in the compute thread once its gradient is in the accumulator
    abandoned: bool = False  # its caller left: a worker that has not taken it yet skips it
    # Its caller's deadline (loop time): past it the caller is gone even if its cancel has not
    # reached us yet, so a worker that has not taken it skips it too.
    deadline: float | None = None
    replay: bool = False  # a call for the step just committed: computed on its parameters, adds nothing
    # The parameter version (commits behind them) its caller asks for: the one its forward ran on,
    # so a backward's recompute sees the same parameters (honoured while this peer still has them).
    version: int | None = None
    used: int = -1  # the version it was computed on (set in the compute thread; every reply says it)

    @property
    def key(self) -> tuple:
        other = None if self.other is None else (self.other.dtype, tuple(self.other.shape[1:]))
        alone = id(self) if self.solo or self.replay else None
        return (self.kind, self.step, self.accumulate, self.x.dtype, tuple(self.x.shape[1:]), other, alone,
                self.version)


@dataclass
class Answer:
    tensor: torch.Tensor | None = None  # output (forward) or input gradient
    loss_sum: float | None = None


@dataclass
class Lane:
    """Where tensors go and come back: identity on CPU, streams and pinned copies on CUDA."""

    upload: Callable[[list[torch.Tensor]], list[torch.Tensor]] = field(default=lambda ts: ts)
    download: Callable[[list[torch.Tensor]], list[torch.Tensor]] = field(default=lambda ts: ts)
    stream: Callable[[], object] = field(default=nullcontext)
    finish: Callable[[], None] = field(default=lambda: None)


@dataclass(frozen=True)
class Previous:
    """The parameters step `step` was computed on, kept after its commit (`StageLimits.replay_previous`):
    a call for that step that arrives late (its caller's first attempt timed out, but the stage
    committed with it) is answered on them, so the stages below still get the exact input gradient."""

    step: int
    params: dict[str, torch.Tensor]
    _built: list[Stage] = field(default_factory=list, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def module(self, stage: Stage) -> Stage:
        """A copy of `stage` on these parameters (sharing their storage; buffers copied), built once.
        The live module is never touched: `torch.func.functional_call` swapped the live module's
        parameters in place for the call's duration, so a batch on the live parameters in the other
        compute thread ran on these, or a mix, and summed a wrong gradient (issue 14: a trainer
        cancelled mid-step left the parameters 0.92 off the reference about one run in four)."""
        with self._lock:
            if not self._built:
                memo = {id(p): torch.nn.Parameter(self.params[name], requires_grad=False)
                        for name, p in stage.named_parameters()}
                self._built.append(copy.deepcopy(stage, memo))
            return self._built[0]


class StageCompute:
    def __init__(self, stage: Stage, params: list[torch.nn.Parameter], accumulator: Accumulator,
                 guard: ParamGuard, committed: Callable[[], int], epoch: Callable[[], int], lane: Lane,
                 previous: Callable[[], "Previous | None"] = lambda: None,
                 autocast: Callable[[], AbstractContextManager] = nullcontext,
                 loss_scale: Callable[[], float] = lambda: 1.0) -> None:
        self.stage, self.params, self.accumulator = stage, params, accumulator
        self.guard, self.committed, self.epoch, self.lane = guard, committed, epoch, lane
        self.previous = previous
        # The seam for mixed precision: every forward of the stage (and the recomputed one of a
        # backward) runs inside it, the gradients are taken outside; parameters, sums, all-reduce
        # and optimizer stay fp32, and answers go back fp32 (the wire specs say so).
        self.autocast = autocast
        # fp16's S (StageOptimizer.scaler): read under the guard, so a batch's gradients are all
        # scaled by the S its step divides by (S moves only at a commit, under the write side).
        self.loss_scale = loss_scale

    def run(self, batch: list[Work]) -> list[Answer]:
        """Compute one batch (all of one `Work.key`); raises StaleStep if its step is committed."""
        head = batch[0]
        with self.guard.read():
            committed = self.committed()
            kept = self.previous()
            if head.step < committed and not (head.replay and kept is not None and kept.step == head.step):
                raise StaleStep(head.step, committed)
            # A replay wants its step's parameters, a tagged call the version its forward ran on; a
            # version this peer no longer holds (or not yet: a download rewound it) gets the live ones.
            wanted = head.step if head.replay else head.version
            previous = kept if kept is not None and wanted == kept.step and wanted < committed else None
            for w in batch:
                w.used = committed if previous is None else previous.step
            if head.accumulate and head.epoch != self.epoch():
                for w in batch:  # admitted before the state was replaced: nothing it held counts now
                    w.accumulate = False
            with self.lane.stream():
                xs = self.lane.upload([w.x for w in batch])
                others = self.lane.upload([w.other for w in batch]) if head.other is not None else []
                answers = self._dispatch(head, batch, xs, others, previous)
            self.lane.finish()
        return answers

    def _dispatch(self, head: Work, batch: list[Work], xs: list, others: list,
                  previous: "Previous | None" = None) -> list[Answer]:
        sizes = [x.shape[0] for x in xs]
        x = xs[0] if len(xs) == 1 else torch.cat(xs)
        stage = self.stage if previous is None else previous.module(self.stage)
        if head.kind == EVALUATE:
            return self._evaluate(stage, xs, others)
        if head.kind == FORWARD:
            with torch.no_grad(), self.autocast():
                y = stage(x)  # (B, T, C)
            return [Answer(t) for t in self.lane.download(list(y.float().split(sizes)))]
        other = others[0] if len(others) == 1 else torch.cat(others)
        if head.kind == BACKWARD:
            with torch.enable_grad():
                x = self._input(x)
                with self.autocast():
                    out = stage(x)  # (B, T, C)
                grad_x = self._gradients(batch, out, other, x, sizes)
            return self._answers(grad_x, sizes, [None] * len(batch))
        with torch.enable_grad():
            x = self._input(x)
            with self.autocast():
                if len(batch) == 1:
                    total = stage(x, other)  # the sample-summed loss, exactly as a direct call
                    loss_sums = [total]
                else:
                    per_sample = stage.sample_losses(x, other)  # (B,)
                    total = per_sample.sum()
                    loss_sums = [part.sum() for part in per_sample.split(sizes)]
            grad_x = self._gradients(batch, total, None, x, sizes)
            losses = [float(v.detach()) for v in loss_sums]
        return self._answers(grad_x, sizes, losses)

    def _evaluate(self, stage: Callable, xs: list, others: list) -> list[Answer]:
        """Held-out samples forward, one call alone (`Work.replay`: never batched): activations, or
        at the last stage the sample-summed loss the training call computes, with no graph built."""
        (x,) = xs
        with torch.no_grad(), self.autocast():
            if self.stage.is_last:
                return [Answer(None, float(stage(x, others[0])))]
            y = stage(x)  # (B, T, C)
        return [Answer(t) for t in self.lane.download([y.float()])]

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        """A leaf to differentiate against (token ids of the first stage take no gradient)."""
        x = x.detach()
        return x if self.stage.is_first else x.requires_grad_(True)

    def _gradients(self, batch: list[Work], out: torch.Tensor, grad_out: torch.Tensor | None,
                   x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        head = batch[0]
        inputs = (list(self.params) if head.accumulate else []) + ([] if self.stage.is_first else [x])
        if not inputs:  # a repeat on the first stage: nothing to return, nothing to add
            return None
        scale = self.loss_scale()
        if scale != 1.0:  # fp16: the backward seeded with S x the incoming gradient (the loss's is 1)
            grad_out = (torch.ones_like(out) if grad_out is None else grad_out) * scale
        grads = torch.autograd.grad(out, inputs, grad_outputs=grad_out, allow_unused=True)
        if head.accumulate:
            self.accumulator.add(head.step, [w.mb for w in batch], sum(sizes), list(grads[: len(self.params)]))
            for w in batch:
                w.added = True
        if self.stage.is_first:
            return None
        grad_x = grads[-1]
        if scale != 1.0:
            # Passed on unscaled, and as zeros for a microbatch whose gradient overflowed: the stage
            # before would refuse a non-finite gradient, and this stage's own sum holds the
            # overflow, so its step is skipped and S halved (as the reference, swarmd/reference.py).
            parts = (grad_x / scale).split(sizes)
            grad_x = torch.cat([g if bool(torch.isfinite(g).all()) else torch.zeros_like(g) for g in parts])
        return grad_x

    def _answers(self, grad_x: torch.Tensor | None, sizes: list[int], losses: list) -> list[Answer]:
        if grad_x is None:
            return [Answer(None, loss) for loss in losses]
        parts = self.lane.download(list(grad_x.split(sizes)))
        return [Answer(part, loss) for part, loss in zip(parts, losses)]
