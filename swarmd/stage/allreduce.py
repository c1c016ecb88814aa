"""The butterfly all-reduce of one step's gradient sums among the live peers of a stage.

With P members (sorted by peer id, the same order on every member) the flattened gradient is cut
into contiguous shards, one per *owner*. Member i sends its copy of shard j to owner j, which sums
the copies in member order (reduce-scatter), then each owner sends its reduced shard to every other
member (all-gather). With every member an owner, each sends and receives about 2(P-1)/P of the
gradient whatever P is; since every shard is summed by exactly one member, all of them end up with
bit-identical vectors. Parts travel in messages of bounded size; the first from each sender (sent
even where the shard is empty) carries its microbatch ids and sample count, so every member checks
the round covers the whole step from the same data and reaches the same verdict.

Stragglers. The leader names the owners (`choose_owners`): a member whose measured send rate is
far below the fastest member's, or that was late in a recent round, owns no shard (an empty one):
it only sends its vector once, to the owners, and the all-gather never waits on its uplink. Each
phase has its own deadline (`phase_deadlines`), from the bytes each member sends in that phase and
its measured rate, within [floor, cap]. A member whose reduce-scatter parts miss the deadline is
left out of the round: the plan is made from the prompt members' sums, and if those cover the step
the round commits without it (it fails the round on its side and catches up by download). Every
member sends the plan it used with its gathered shard and a member commits only when every
owner's plan is its own, so members that saw different members as prompt never commit different
sums (the round fails instead).

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
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from swarmd.stage.errors import RoundFailed, busy, bad_input


#: Bytes per gradient element on the wire, by all-reduce codec (lz4's gain is not counted on; a
#: piece holding inf or nan travels in fp32 even under fp16, a step that is skipped anyway).
WIRE_BYTES = {"none": 4, "lz4": 4, "fp16": 2, "fp16+lz4": 2}


def choose_owners(rates: Sequence[float], suspects: Sequence[bool], min_rate_fraction: float) -> tuple[bool, ...]:
    """Which members own a shard: not one that was late lately (`suspects`), nor one whose measured
    send rate (bytes/s; 0: unmeasured) is below `min_rate_fraction` of the fastest member's. An
    unmeasured member owns one (nothing says it is slow). At least one member always owns: the
    fastest, or the first if every member is suspect."""
    fastest = max(rates, default=0.0)
    owners = tuple(not late and not (0 < rate < min_rate_fraction * fastest) for rate, late in zip(rates, suspects))
    if any(owners):
        return owners
    best = max(range(len(rates)), key=lambda i: (rates[i], -i))
    return tuple(i == best for i in range(len(rates)))


def phase_deadlines(numel: int, codec: str, owners: Sequence[bool], rates: Sequence[float], floor_s: float,
                    cap_s: float, margin: float) -> tuple[float, float]:
    """How long the reduce-scatter and the all-gather may each take: `margin` times the longest any
    member needs to send its bytes of that phase at its measured rate (bytes/s; a member that sends
    something in the phase at an unmeasured rate gives `cap_s`), within [floor_s, cap_s].

    In the reduce-scatter member i sends every owner j != i its copy of shard j (the vector less
    its own shard); in the all-gather owner i sends its shard to the P-1 others."""
    width = WIRE_BYTES[codec]
    bounds = shard_bounds(numel, owners)
    sizes = [hi - lo for lo, hi in bounds]
    members = len(owners)

    def deadline(sent: list[int]) -> float:
        if all(b == 0 for b in sent):
            return floor_s
        if any(b > 0 and r <= 0 for b, r in zip(sent, rates)):
            return cap_s
        slowest = max(b * width / r for b, r in zip(sent, rates) if b > 0)
        return min(cap_s, max(floor_s, margin * slowest))

    reduce = [numel - sizes[i] if members > 1 else 0 for i in range(members)]
    gather = [sizes[i] * (members - 1) for i in range(members)]
    return deadline(reduce), deadline(gather)


def shard_bounds(numel: int, owners: Sequence[bool]) -> list[tuple[int, int]]:
    """Each member's contiguous shard: the vector cut evenly among the owners (member order), an
    empty slice at the current offset for every member that owns none."""
    base, extra = divmod(numel, max(1, sum(owners)))
    bounds, start, k = [], 0, 0
    for owns in owners:
        end = start + (base + (1 if k < extra else 0) if owns else 0)
        k += owns
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
    owners: tuple[bool, ...]  # per member: does it own (reduce) a shard
    bounds: list[tuple[int, int]] = field(init=False)
    parts: dict[int, torch.Tensor] = field(init=False)  # src -> its copy of my shard
    received: dict[int, int] = field(init=False)  # src -> elements of my shard received
    contributions: dict[int, Contribution] = field(default_factory=dict)
    full: torch.Tensor = field(init=False)  # the reduced vector being gathered
    gathered: dict[int, int] = field(init=False)  # shard owner -> elements received
    outliers: set[int] = field(default_factory=set)  # members some shard's reducer reported
    plans: dict[int, tuple[int, ...]] = field(default_factory=dict)  # src -> the members its plan kept
    withdrawn: set[int] = field(default_factory=set)  # members that own no shard and left at their deadline
    kept: tuple[int, ...] | None = None  # this member's plan, once made (the all-gather)
    cleared: bool = False  # a member's plan left this member's sum out (its abort said so)
    failure: str | None = None
    joined: bool = False  # this peer runs the round itself (not only holds parts mates sent early)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=lambda: asyncio.get_running_loop().time())

    def __post_init__(self) -> None:
        # Built on the event loop (a round's first part may open it), so its buffers are left
        # uninitialised: zeroing the whole model's vector and a shard per member is a memset of
        # gigabytes at 200M parameters, while `empty` only maps pages. Nothing reads an element
        # before it was written: `_place` writes each exactly once, in order, and the readers wait
        # for full counts (`prompt`, `gathered_ready`).
        self.bounds = shard_bounds(self.numel, self.owners)
        lo, hi = self.bounds[self.me]
        self.parts = {src: torch.empty(hi - lo) for src in range(len(self.members))}
        self.received = {src: 0 for src in range(len(self.members))}
        self.full = torch.empty(self.numel)
        self.gathered = {src: 0 for src in range(len(self.members))}

    def put_part(self, src: int, offset: int, part: torch.Tensor, contribution: Contribution | None) -> None:
        self._place(self.parts[src], self.received, src, offset, part)
        if contribution is not None:
            self.contributions[src] = contribution

    def put_gather(self, src: int, offset: int, part: torch.Tensor, outliers: Sequence[int] = (),
                   kept: Sequence[int] | None = None) -> None:
        """A piece of member `src`'s reduced shard; its first piece carries the outliers it found
        and the members its plan kept."""
        if any(o not in range(len(self.members)) for o in outliers):
            raise bad_input(f"outliers reported by member {src} are not members of the round")
        if kept is not None:
            if any(k not in range(len(self.members)) for k in kept) or list(kept) != sorted(set(kept)):
                raise bad_input(f"the plan of member {src} keeps no sorted set of the round's members")
            self.plans[src] = tuple(kept)
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

    def prompt(self) -> list[int]:
        """Members whose sum and whole copy of this member's shard have arrived (this one too),
        less the ones that withdrew."""
        lo, hi = self.bounds[self.me]
        return [s for s in range(len(self.members))
                if self.received[s] == hi - lo and s in self.contributions and s not in self.withdrawn]

    def reduced_ready(self) -> bool:
        """Every member's part is here, or it withdrew."""
        return len(self.prompt()) + len(self.withdrawn) == len(self.members)

    def withdraw(self, src: int) -> bool:
        """Member `src` left the round at its deadline. One that owns no shard, and whose sum this
        member has not planned to add, only leaves (True): the others may still commit without
        it. False for any other: its shard or its sum is part of the step."""
        if self.owners[src] or (self.kept is not None and src in self.kept):
            return False
        self.withdrawn.add(src)
        self.changed.set()
        return True

    def gathered_ready(self) -> bool:
        """Every owner's reduced shard and plan are here (members that own none send an empty shard
        and their plan; neither is waited for: the sum does not depend on them)."""
        return all(self.gathered[s] == hi - lo and (s in self.plans or not self.owners[s])
                   for s, (lo, hi) in enumerate(self.bounds))

    def late_members(self) -> list[int]:
        """Members whose parts of the current phase have not all arrived (after a deadline: the
        stragglers that held the round)."""
        if self.kept is None:
            return [s for s in range(len(self.members)) if s not in self.prompt()]
        return [s for s, (lo, hi) in enumerate(self.bounds) if s != self.me and self.owners[s]
                and (self.gathered[s] < hi - lo or s not in self.plans)]

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
            join: bool = False, owners: Sequence[bool] | None = None) -> RoundBox:
        """The round's box, opened if need be; `join` when this peer's own round asks for it;
        `owners` (default: every member) say which members reduce a shard."""
        owners = tuple(owners) if owners is not None else (True,) * len(members)
        if round_id in self._closed:
            raise busy(f"all-reduce round {round_id.hex()[:8]} is already closed on this peer")
        box = self._boxes.get(round_id)
        if box is not None:
            if box.members != members or box.step != step or box.owners != owners:
                raise bad_input("round members, owners or step differ from the round's first part")
            box.joined |= join
            return box
        if me not in members or len(set(members)) != len(members) or members != sorted(members):
            raise bad_input("round members must be distinct, sorted, and include this peer")
        if len(owners) != len(members) or not any(owners):
            raise bad_input("a round needs one owner flag per member and at least one owner")
        now = asyncio.get_running_loop().time()
        for stale in [r for r, b in self._boxes.items() if b.step < step or now - b.created > self._expire_s
                      or (not b.joined and now - b.created > self._join_s)]:
            self.drop(stale, "superseded by a later step, expired, or never joined here")
        if len(self._boxes) >= self._max_open:
            raise busy(f"{len(self._boxes)} all-reduce rounds already open (max_open_rounds)")
        box = self._boxes[round_id] = RoundBox(round_id, step, members, members.index(me), numel, owners,
                                               joined=join)
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
