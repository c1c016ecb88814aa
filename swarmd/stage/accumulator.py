"""Per-step gradient sums with the microbatch ids behind them (which ids are admitted at all is
the stage core's decision: `swarmd.stage.core.StageCore.admit`).

Compute threads add into it while the event loop claims ids and reads progress, and the stage's
auxiliary thread takes a step's sum for an all-reduce round and puts it back if the round fails.
Two locks keep the event loop from ever waiting on tensor arithmetic: `_lock` guards only the
bookkeeping (claims, ids, counts) and is held for microseconds; `_math` serialises the tensor
work (adding, taking, merging back) and is never taken on the event loop. A step's sum is taken
out (not copied) for a round: backward calls that land meanwhile start a fresh sum, which the
round either discards on success (its ids were covered by the round, so they are cross-peer
duplicates) or merges with the taken one on failure.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch


@dataclass
class StepSum:
    """Gradient sums (one per parameter, None where nothing arrived yet) and what produced them."""

    grads: list[torch.Tensor | None]
    ids: set[int] = field(default_factory=set)
    samples: int = 0

    def add_grads(self, grads: list[torch.Tensor | None]) -> None:
        for i, g in enumerate(grads):
            if g is None:
                continue
            if self.grads[i] is None:
                self.grads[i] = g
            else:
                self.grads[i].add_(g)


@dataclass(frozen=True)
class Progress:
    """What a peer tells its stage-mates about a step: the ids it holds gradients for."""

    ids: frozenset[int]
    samples: int


class Accumulator:
    def __init__(self, num_params: int) -> None:
        self._num_params = num_params
        self._lock = threading.Lock()  # bookkeeping only; taken on the event loop
        self._math = threading.Lock()  # tensor work; compute and aux threads only
        self._sums: dict[int, StepSum] = {}
        self._taken: dict[int, StepSum] = {}

    def add(self, step: int, mbs: list[int], samples: int, grads: list[torch.Tensor | None]) -> None:
        """Add the summed parameter gradients of microbatches `mbs`, each claimed by the stage core
        for this peer (compute thread)."""
        with self._math:
            with self._lock:
                total = self._sums.get(step)
                if total is None:
                    total = self._sums[step] = StepSum([None] * self._num_params)
            total.add_grads(grads)
            with self._lock:  # the ids become visible once their gradient is in
                total.ids.update(mbs)
                total.samples += samples

    def progress(self, step: int) -> Progress:
        with self._lock:
            ids: set[int] = set()
            samples = 0
            for part in (self._sums.get(step), self._taken.get(step)):
                if part is not None:
                    ids |= part.ids
                    samples += part.samples
            return Progress(frozenset(ids), samples)

    def take(self, step: int) -> StepSum:
        """Remove the step's sum for an all-reduce round, an empty one if nothing arrived (aux
        thread: it waits for an add in progress)."""
        with self._math, self._lock:
            if step in self._taken:
                raise RuntimeError(f"step {step} is already in a round")
            taken = self._sums.pop(step, None) or StepSum([None] * self._num_params)
            self._taken[step] = taken
            return taken

    def restore(self, step: int) -> None:
        """The round failed: merge what it took with whatever arrived meanwhile (aux thread). Both
        stay visible to `progress` throughout, so no id ever seems to vanish."""
        with self._math:
            with self._lock:
                taken, late = self._taken.get(step), self._sums.get(step)
            if taken is None:
                return
            if late is not None:
                taken.add_grads(late.grads)
            with self._lock:
                if late is not None:
                    taken.ids |= late.ids
                    taken.samples += late.samples
                self._sums[step] = taken
                del self._taken[step]

    def discard_taken(self, step: int) -> frozenset[int]:
        """A round left this peer's taken sum out for a conflict (its ids overlap a kept member's,
        and the step could not be covered): drop it for good, keep what arrived meanwhile. Returns
        the dropped ids, which this peer no longer holds (aux thread)."""
        with self._math, self._lock:
            taken = self._taken.pop(step, None)
            return frozenset(taken.ids) if taken is not None else frozenset()

    def finish(self, step: int) -> int:
        """The step is committed: drop everything for it and earlier steps; returns how many
        microbatches arrived after the round took the sum (the round's coverage proves a kept
        member's sum held them: harmless copies)."""
        with self._math, self._lock:
            late = self._sums.get(step)
            count = len(late.ids) if late is not None else 0
            for table in (self._sums, self._taken):
                for s in [s for s in table if s <= step]:
                    del table[s]
            return count

    def clear(self) -> None:
        """Forget everything (state was replaced by a download or a checkpoint)."""
        with self._math, self._lock:
            for table in (self._sums, self._taken):
                table.clear()
