"""The butterfly all-reduce of one step's gradient sums among the live peers of a stage.

With P members (sorted by peer id, the same order on every member) the flattened gradient is cut
into P contiguous shards. Member i receives shard i of every member's vector and sums them in
member order (reduce-scatter), then sends its reduced shard to every other member (all-gather).
Each member so sends and receives about 2(P-1)/P of the gradient whatever P is, and since every
shard is summed by exactly one member, all of them end up with bit-identical vectors. Parts travel
in messages of bounded size; each carries the sender's microbatch ids and sample count, so every
member checks the round covers the whole step from the same data and reaches the same verdict.

The mailbox buffers parts for at most `max_open_rounds` rounds, each allocated from the local
parameter count (never from sizes a sender announces), so a mate cannot make us hold more. It also
remembers the ids of the rounds it closed here (failed, aborted, finished): parts of one travel on
other members' connections and can arrive after it closed, or after an abort that overtook them,
and a box opened for them would be an orphan that nobody ever closes. Enough orphans fill the
mailbox, every new round of the step is refused `busy`, each refusal fails a round and leaves more
late parts behind: the stage sticks at that step. Late parts are refused instead.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from swarmd.stage.errors import RoundFailed, busy, bad_input


#: Bytes per gradient element on the wire, by all-reduce codec (lz4's gain is not counted on).
WIRE_BYTES = {"none": 4, "lz4": 4, "fp16": 2, "fp16+lz4": 2, "int8": 1}


def round_timeout(numel: int, members: int, codec: str, rates: list[float], floor_s: float, ceiling_s: float,
                  margin: float) -> float:
    """How long a round may take: each member sends (and receives) about 2(P-1)/P of the vector,
    at the slowest measured rate among `rates` (bytes/s; 0: unmeasured), `margin` times over,
    within [floor_s, ceiling_s]; `ceiling_s` while any member is unmeasured."""
    if members < 2:
        return min(ceiling_s, floor_s)
    known = [r for r in rates if r > 0]
    if len(known) < len(rates):
        return ceiling_s
    moved = 2 * (members - 1) / members * numel * WIRE_BYTES.get(codec, 4)
    return min(ceiling_s, max(floor_s, margin * moved / min(known)))


def shard_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass(frozen=True)
class Contribution:
    ids: frozenset[int]
    samples: int


@dataclass
class RoundBox:
    """Everything one member receives in one round."""

    round_id: bytes
    step: int
    members: list[bytes]
    me: int
    numel: int
    bounds: list[tuple[int, int]] = field(init=False)
    parts: dict[int, torch.Tensor] = field(init=False)  # src -> its copy of my shard
    received: dict[int, int] = field(init=False)  # src -> elements of my shard received
    contributions: dict[int, Contribution] = field(default_factory=dict)
    full: torch.Tensor = field(init=False)  # the reduced vector being gathered
    gathered: dict[int, int] = field(init=False)  # shard owner -> elements received
    outliers: set[int] = field(default_factory=set)  # members some shard's reducer reported
    failure: str | None = None
    joined: bool = False  # this peer runs the round itself (not only holds parts mates sent early)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=lambda: asyncio.get_running_loop().time())

    def __post_init__(self) -> None:
        self.bounds = shard_bounds(self.numel, len(self.members))
        lo, hi = self.bounds[self.me]
        self.parts = {src: torch.zeros(hi - lo) for src in range(len(self.members))}
        self.received = {src: 0 for src in range(len(self.members))}
        self.full = torch.zeros(self.numel)
        self.gathered = {src: 0 for src in range(len(self.members))}

    def put_part(self, src: int, offset: int, part: torch.Tensor, contribution: Contribution | None) -> None:
        self._place(self.parts[src], self.received, src, offset, part)
        if contribution is not None:
            self.contributions[src] = contribution

    def put_gather(self, src: int, offset: int, part: torch.Tensor, outliers: list[int] | tuple[int, ...] = ()) -> None:
        if any(o not in range(len(self.members)) for o in outliers):
            raise bad_input(f"outliers reported by member {src} are not members of the round")
        self.outliers.update(outliers)
        lo, hi = self.bounds[src]
        self._place(self.full[lo:hi], self.gathered, src, offset, part)

    def _place(self, target: torch.Tensor, counts: dict[int, int], src: int, offset: int, part: torch.Tensor) -> None:
        # In order and contiguous, so a full count means every element was written once.
        if part.dtype != torch.float32 or part.dim() != 1 or offset != counts[src] \
                or offset + part.numel() > target.numel():
            raise bad_input(f"part from member {src} at {offset} ({part.numel()} elements) does not fit")
        target[offset: offset + part.numel()] = part
        counts[src] += part.numel()
        self.changed.set()

    def reduced_ready(self) -> bool:
        lo, hi = self.bounds[self.me]
        return all(n == hi - lo for n in self.received.values()) and len(self.contributions) == len(self.members)

    def gathered_ready(self) -> bool:
        return all(self.gathered[s] == hi - lo for s, (lo, hi) in enumerate(self.bounds))

    def late_members(self) -> list[int]:
        """Members whose parts of the current phase have not all arrived (after a timeout: the
        stragglers that held the round)."""
        lo, hi = self.bounds[self.me]
        if not self.reduced_ready():
            return [s for s in range(len(self.members))
                    if s != self.me and (self.received[s] < hi - lo or s not in self.contributions)]
        return [s for s, (a, b) in enumerate(self.bounds) if s != self.me and self.gathered[s] < b - a]

    def fail(self, reason: str) -> None:
        self.failure = reason
        self.changed.set()

    async def wait(self, ready) -> None:
        while not ready():
            if self.failure is not None:
                raise RoundFailed(self.failure)
            self.changed.clear()
            await self.changed.wait()
        if self.failure is not None:
            raise RoundFailed(self.failure)


class Mailbox:
    """Round boxes by round id; a part may arrive before its receiver has started the round."""

    def __init__(self, max_open: int, expire_s: float, join_s: float, closed_kept: int) -> None:
        self._max_open = max_open
        self._expire_s = expire_s  # a round nobody finished by then is over on every member
        # A round this peer has not joined this long after its first part never will be: the
        # leader's call asking it to join has timed out by then (it is given join_s) and aborted.
        self._join_s = join_s
        self._boxes: dict[bytes, RoundBox] = {}
        self._closed: OrderedDict[bytes, None] = OrderedDict()  # newest last, at most closed_kept
        self._closed_kept = closed_kept

    @property
    def open_rounds(self) -> int:
        return len(self._boxes)

    def box(self, round_id: bytes, step: int, members: list[bytes], me: bytes, numel: int,
            join: bool = False) -> RoundBox:
        """The round's box, opened if need be; `join` when this peer's own round asks for it."""
        if round_id in self._closed:
            raise busy(f"all-reduce round {round_id.hex()[:8]} is already closed on this peer")
        box = self._boxes.get(round_id)
        if box is not None:
            if box.members != members or box.step != step:
                raise bad_input("round members or step differ from the round's first part")
            box.joined |= join
            return box
        if me not in members or len(set(members)) != len(members) or members != sorted(members):
            raise bad_input("round members must be distinct, sorted, and include this peer")
        now = asyncio.get_running_loop().time()
        for stale in [r for r, b in self._boxes.items() if b.step < step or now - b.created > self._expire_s
                      or (not b.joined and now - b.created > self._join_s)]:
            self.drop(stale, "superseded by a later step, expired, or never joined here")
        if len(self._boxes) >= self._max_open:
            raise busy(f"{len(self._boxes)} all-reduce rounds already open (max_open_rounds)")
        box = self._boxes[round_id] = RoundBox(round_id, step, members, members.index(me), numel, joined=join)
        return box

    def get(self, round_id: bytes) -> RoundBox | None:
        return self._boxes.get(round_id)

    def drop(self, round_id: bytes, reason: str = "round closed") -> None:
        """Close the round here for good (its box, if it has one, fails with `reason`); an id
        never seen is remembered too, so an abort that overtakes the round's parts still counts."""
        self._closed[round_id] = None
        self._closed.move_to_end(round_id)
        while len(self._closed) > self._closed_kept:
            self._closed.popitem(last=False)
        box = self._boxes.pop(round_id, None)
        if box is not None and box.failure is None:
            box.fail(reason)

    def retire(self, step: int) -> None:
        """The peer committed `step`: rounds of it and earlier can never finish; free their buffers now."""
        for old in [r for r, b in self._boxes.items() if b.step <= step]:
            self.drop(old, f"step {step} is committed")

    def fail_all(self, reason: str) -> None:
        for round_id in list(self._boxes):
            self.drop(round_id, reason)
