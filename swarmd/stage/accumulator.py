"""Per-step gradient sums with the microbatch ids behind them, so a retry never counts twice here.

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
        self._claimed: dict[int, set[int]] = {}
        self._repeats: dict[int, int] = {}

    def claim(self, step: int, mb: int) -> bool:
        """True when `mb` is new for `step` on this peer (its gradient will be added); False for a
        repeat, which is counted and must be computed without accumulating."""
        with self._lock:
            claimed = self._claimed.setdefault(step, set())
            if mb in claimed:
                self._repeats[step] = self._repeats.get(step, 0) + 1
                return False
            claimed.add(mb)
            return True

    def release(self, step: int, mbs: list[int]) -> None:
        """Forget claims whose compute never happened (cancelled, refused, failed)."""
        with self._lock:
            claimed = self._claimed.get(step)
            if claimed is not None:
                claimed.difference_update(mbs)

    def add(self, step: int, mbs: list[int], samples: int, grads: list[torch.Tensor | None]) -> None:
        """Add the summed parameter gradients of claimed microbatches `mbs` (compute thread)."""
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

    def finish(self, step: int) -> int:
        """The step is committed: drop everything for it and earlier steps; returns how many copies
        of microbatches this peer dropped (claims refused as repeats plus late arrivals, which the
        round's coverage check proves a mate's sum held)."""
        with self._math, self._lock:
            late = self._sums.get(step)
            repeats = self._repeats.get(step, 0) + (len(late.ids) if late is not None else 0)
            for table in (self._sums, self._taken, self._claimed, self._repeats):
                for s in [s for s in table if s <= step]:
                    del table[s]
            return repeats

    def repeats(self, step: int) -> int:
        """Claims refused as repeats so far for `step`."""
        with self._lock:
            return self._repeats.get(step, 0)

    def clear(self) -> None:
        """Forget everything (state was replaced by a download or a checkpoint)."""
        with self._math, self._lock:
            for table in (self._sums, self._taken, self._claimed, self._repeats):
                table.clear()
