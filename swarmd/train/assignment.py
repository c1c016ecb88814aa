"""Which microbatches of a step a trainer works on: its own share first, then any share left undone.

Trainer k of K starts every step with the indices m ≡ k (mod K), so K live trainers split the
step with no agreement round. A trainer that dies (or was never started) leaves its indices
undone, and a step commits only when every stage holds every microbatch: so once a trainer has
finished its own share, it takes over indices that still look undone after a bound. The bound
grows with how far the taker stands from the owner in shard order (the owner's successor first,
the next one a bound later, ...), so with one trainer dead exactly one survivor normally does its
work, and a second only when the first is gone too. Taking over a live but slow trainer's index
wastes work and is harmless for correctness (summing each microbatch once is the stage's job, I1).

A trainer whose indices had to be taken over in one step is a suspect in the next: its indices
that no stage has started yet (undone even at the last stage, where a microbatch is first summed)
are taken over without waiting, so a dead trainer costs the bound once, not at every step. A
suspect that is alive after all keeps its indices covered, is not taken from, and so stops being
a suspect the step after.

Pure: the caller passes the clock and what the stages report.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TakeoverPolicy:
    # An index another trainer owns is taken over once it has looked undone for
    # max(min_s, factor × this trainer's own share time) × rank, rank = 1 for the owner's successor.
    # `factor` leaves room for a live trainer that is a little slower than this one; `min_s` for the
    # stages' reports lagging what they hold (a stage-mate progress poll, a commit in flight) and for
    # trainers of one job started seconds apart (`swarmctl train` on each daemon): a takeover of a
    # live trainer's whole share is wasted work.
    min_s: float = 20.0
    factor: float = 2.0

    def __post_init__(self) -> None:
        if not self.min_s >= 0 or not self.factor >= 0:
            raise ValueError(f"takeover min_s and factor must be >= 0, got {self.min_s}, {self.factor}")


@dataclass
class Assignment:
    """One step's division of work, seen from trainer `shard` of `shards`."""

    per_step: int
    shard: int
    shards: int
    policy: TakeoverPolicy = TakeoverPolicy()
    # index -> loop time it was first seen undone (after this trainer's own share was done)
    _undone_since: dict[int, float] = field(default_factory=dict)
    suspects: set[int] = field(default_factory=set)  # shards taken from in the previous step
    _taken_from: set[int] = field(default_factory=set)  # shards taken from in this step

    def __post_init__(self) -> None:
        if not 1 <= self.shards <= self.per_step:
            raise ValueError(f"shards must be in 1..{self.per_step} (microbatches per step), got {self.shards}")
        if not 0 <= self.shard < self.shards:
            raise ValueError(f"shard must be in 0..{self.shards - 1}, got {self.shard}")

    def own(self) -> list[int]:
        return [m for m in range(self.per_step) if m % self.shards == self.shard]

    def rank(self, index: int) -> int:
        """1 when this trainer is the owner's successor, 2 for the next, ...; 0 for its own indices."""
        return (self.shard - index % self.shards) % self.shards

    def begin_step(self) -> None:
        """A new step's watch: those taken from in the last one are the suspects now."""
        self.suspects, self._taken_from = self._taken_from, set()
        self._undone_since.clear()

    def due(self, undone: set[int], fresh: set[int], done: set[int], now: float, own_share_s: float) -> list[int]:
        """Indices to take over now: undone (by the stages' reports), not done or started here, and
        undone for longer than this trainer's bound for them, or `fresh` (not started anywhere) and
        a suspect's. Indices no longer undone are forgotten, so one that reappears (a stage lost it
        again) waits a whole bound again."""
        for index in [i for i in self._undone_since if i not in undone]:
            del self._undone_since[index]
        bound = max(self.policy.min_s, self.policy.factor * own_share_s)
        ready = []
        for index in sorted(undone - done):
            if not 0 <= index < self.per_step or self.rank(index) == 0:
                continue  # own indices are re-sent, not taken over; others are not of this step
            since = self._undone_since.setdefault(index, now)
            owner = index % self.shards
            if now - since >= bound * self.rank(index) or (owner in self.suspects and index in fresh):
                ready.append(index)
                self._taken_from.add(owner)
        return ready
