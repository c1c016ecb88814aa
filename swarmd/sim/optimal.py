"""The yardstick: the best stage assignment of the live peers, moves free.

Maximising the weakest stage's summed speed is multiway number partitioning (max-min), NP-hard in
general. Equal speeds have a closed form; tiny mixed cases are searched exhaustively; otherwise
longest-processing-time first plus move/swap improvement (400 peers on 32 stages: ~10 ms, within
1e-4 of `upper_bound`). Along a trace the reference for mixed speeds is the bound itself, checked
against the search at regular events, so a weak search can never flatter a policy.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from swarmd.sim.trace import JOIN, TraceEvent

# Mixed-speed instances up to this many peers are solved exactly (S^n leaves, pruned); beyond it the
# search is heuristic and its gap is reported.
EXACT_PEERS = 10
# A step must lift the weakest stage by this fraction of it, so the search does not crawl.
MIN_STEP = 1e-5


def upper_bound(speeds: list[float], stages: int) -> float:
    """No assignment beats this: for any k < stages, the k fastest peers sit in at most k stages,
    so the other stages share what remains."""
    if len(speeds) < stages:
        return 0.0
    ordered = sorted(speeds, reverse=True)
    remaining = sum(ordered)
    bound = remaining / stages
    for k in range(1, stages):
        remaining -= ordered[k - 1]
        bound = min(bound, remaining / (stages - k))
    return bound


def best_min(speeds: list[float], stages: int) -> tuple[float, list[int]]:
    """(weakest stage's speed, stage of each peer) of the best assignment found."""
    n = len(speeds)
    if n < stages:
        return 0.0, [i % stages for i in range(n)]
    if min(speeds) == max(speeds):
        return (n // stages) * speeds[0], [i % stages for i in range(n)]
    if n <= EXACT_PEERS:
        return _exact(speeds, stages)
    bins = _Bins(stages)
    for i in sorted(range(n), key=lambda i: -speeds[i]):
        bins.add(i, speeds[i], bins.weakest())
    bins.improve()
    assignment = [0] * n
    for stage, members in enumerate(bins.members):
        for _, i in members:
            assignment[i] = stage
    return min(bins.sums), assignment


def _exact(speeds: list[float], stages: int) -> tuple[float, list[int]]:
    order = sorted(range(len(speeds)), key=lambda i: -speeds[i])
    bound = upper_bound(speeds, stages)
    best = [-1.0, None]
    sums = [0.0] * stages
    chosen = [0] * len(speeds)

    def descend(depth: int, used: int) -> None:
        if best[0] >= bound:
            return
        if depth == len(order):
            if min(sums) > best[0]:
                best[0], best[1] = min(sums), list(chosen)
            return
        i = order[depth]
        for stage in range(min(used + 1, stages)):  # empty stages are interchangeable
            sums[stage] += speeds[i]
            chosen[i] = stage
            descend(depth + 1, max(used, stage + 1))
            sums[stage] -= speeds[i]

    descend(0, 0)
    return best[0], best[1]


class _Bins:
    """Stages as bins of peers kept sorted by speed, with sums, and the local search over them.

    Sorted bins let a step find the move or swap closest to half the gap by bisection instead of
    trying every pair: a full search of 400 peers on 32 stages takes ~10 ms.
    """

    def __init__(self, stages: int):
        self.sums = [0.0] * stages
        self.members: list[list[tuple]] = [[] for _ in range(stages)]
        self.where: dict = {}

    def weakest(self) -> int:
        return min(range(len(self.sums)), key=self.sums.__getitem__)

    def add(self, key, speed: float, stage: int) -> None:
        bisect.insort(self.members[stage], (speed, key))
        self.sums[stage] += speed
        self.where[key] = (stage, speed)

    def remove(self, key) -> None:
        stage, speed = self.where.pop(key)
        row = self.members[stage]
        del row[bisect.bisect_left(row, (speed, key))]
        self.sums[stage] = self.sums[stage] - speed if row else 0.0

    def improve(self, max_steps: int = 100_000) -> None:
        """Lift the weakest bin by a move or a swap from a stronger bin while one helps.

        Every step raises the weakest bin and leaves its partner above the old minimum, so the sorted
        sums rise lexicographically and the loop ends.
        """
        for _ in range(max_steps):
            low = self.weakest()
            strong = sorted(range(len(self.sums)), key=self.sums.__getitem__, reverse=True)
            if not any(self._lift(low, d) for d in strong if d != low):
                return

    def _lift(self, low: int, donor: int) -> bool:
        """Apply the move or swap from `donor` that best lifts `low`; False when none lifts it."""
        base = self.sums[low]
        gap = self.sums[donor] - base
        row = self.members[donor]
        best, best_gain = None, max(MIN_STEP * base, 1e-12)
        offers = [(0.0, None)] + self.members[low] if len(row) > 1 else self.members[low]
        for slow, key_low in offers:
            at = bisect.bisect_left(row, (slow + gap / 2.0,))
            for speed, key in row[max(0, at - 1) : at + 1]:
                delta = speed - slow
                gain = min(delta, gap - delta)
                if gain > best_gain:
                    best, best_gain = (key, key_low), gain
        if best is None:
            return False
        key, key_low = best
        speed = self.where[key][1]
        self.remove(key)
        if key_low is not None:
            slow = self.where[key_low][1]
            self.remove(key_low)
            self.add(key_low, slow, donor)
        self.add(key, speed, low)
        return True


@dataclass(frozen=True)
class OptimumTrack:
    """The reference throughput after each trace event, and how tight it is.

    Equal speeds: the exact optimum. Mixed speeds: the upper bound, so ratios against it can only
    understate a policy; `gap_avg` is the mean distance from the bound of the full search run at
    every `solve_every`-th event, i.e. by how much at most they understate it. The track depends
    on the trace alone, so one serves every rule replayed on that trace.
    """

    values: list[float]
    gap_avg: float
    solves: int


def track(events: list[TraceEvent], stages: int, solve_every: int = 256) -> OptimumTrack:
    speeds: dict[str, float] = {}
    ordered: list[float] = []  # live speeds, ascending
    values: list[float] = []
    gaps: list[float] = []
    mixed = False
    for number, event in enumerate(events):
        if event.event == JOIN:
            speeds[event.peer] = event.speed
            bisect.insort(ordered, event.speed)
            mixed = mixed or event.speed != ordered[0] or event.speed != ordered[-1]
        else:
            speed = speeds.pop(event.peer)
            del ordered[bisect.bisect_left(ordered, speed)]
        if not mixed:
            values.append((len(ordered) // stages) * (ordered[0] if ordered else 0.0))
            continue
        bound = _bound_sorted(ordered, stages)
        values.append(bound)
        if number % solve_every == 0 and bound > 0:
            gaps.append((bound - best_min(ordered, stages)[0]) / bound)
    return OptimumTrack(values, sum(gaps) / len(gaps) if gaps else 0.0, len(gaps))


def _bound_sorted(ascending: list[float], stages: int) -> float:
    """`upper_bound` on speeds already sorted ascending, in O(stages)."""
    if len(ascending) < stages:
        return 0.0
    remaining = math.fsum(ascending)
    bound = remaining / stages
    for k in range(1, stages):
        remaining -= ascending[-k]
        bound = min(bound, remaining / (stages - k))
    return bound
