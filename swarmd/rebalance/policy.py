"""The rebalancing rule: a pure function of the load table, the time and this peer's hysteresis state.

The daemon and the simulator call the same `plan`, so what the simulator measures is what runs.
Every peer derives the same *global* move plan from the shared view and moves only if the plan names
it: that gives exactly as many movers as the deficit needs, and two peers never jump for one gap.
A move is taken only when the plan named this peer on two consecutive checks (hysteresis), the second
check coming `confirm_after_s` after the first, so one noisy view never triggers a move and a real
gap is still closed in well under a period. Views are the same only up to measurement noise (each
peer's speeds are gossiped EMAs, read at its own moment), so every choice the noise could tip —
which stage is weakest, which donates, which peer moves, whether the gain is real — is made by a
noise-free key among the options within `speed_tolerance` of each other: otherwise each check names
a different peer and nobody is ever named by its own check. See docs/rebalancing.md for the rule
and the evidence.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
from dataclasses import dataclass

from swarmd.errors import ConfigError
from swarmd.rebalance.table import SERVING, PeerLoad, StageTable


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the rule; defaults chosen with `bench/rebalance.py` (docs/rebalancing.md)."""

    # Seconds between a peer's checks. The paper's T; per-peer checks are spread by the jitter,
    # so the swarm as a whole looks much more often than once per period.
    period_s: float = 300.0
    # Each period is scaled by a factor drawn from [1 - jitter, 1 + jitter] so checks do not align.
    jitter: float = 0.5
    # Delay of the confirming check once a check named this peer: long enough for a fresh view to
    # arrive by gossip (a few exchange intervals), short next to the 60 s state download.
    confirm_after_s: float = 10.0
    # A plan must raise the pipeline's predicted throughput by more than this fraction: moving costs
    # a state download during which the mover serves nothing.
    margin: float = 0.01
    # Upper bound on moves in one plan, against pathological views (also bounds the plan's cost).
    max_moves: int = 256
    # Relative error of a gossiped speed (an EMA of samples/s). Choices that measured speeds cannot
    # tell apart within it go to noise-free keys (peer counts, stage index, peer id), so peers whose
    # views differ only by noise name the same mover; 0.3 keeps +-25% noise on equal peers agreeing.
    speed_tolerance: float = 0.3

    def __post_init__(self):
        """Raises `ConfigError` keyed by the field's name, which is also its `[rebalance]` key, so
        the daemon and `--check-config` name the setting to fix without translating."""
        for name in ("period_s", "confirm_after_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be positive, got {getattr(self, name)!r}")
        if not 0 <= self.jitter < 1:
            raise ConfigError("jitter", f"must be in [0, 1), got {self.jitter}")
        if not self.margin >= 0:
            raise ConfigError("margin", f"must be >= 0, got {self.margin}")
        if self.max_moves < 1:
            raise ConfigError("max_moves", f"must be >= 1, got {self.max_moves}")
        if not 0 <= self.speed_tolerance < 1:
            raise ConfigError("speed_tolerance", f"must be in [0, 1), got {self.speed_tolerance}")


@dataclass(frozen=True)
class PolicyState:
    """Hysteresis carried from one check to the next: the move the previous check would have made."""

    pending_stage: int | None = None


@dataclass(frozen=True)
class Decision:
    move_to: int | None
    state: PolicyState
    next_check_at: float
    reason: str


@dataclass(frozen=True)
class Move:
    peer_id: bytes
    source: int
    target: int


@dataclass(frozen=True)
class SharedPlan:
    """The swarm-wide plan every peer derives from the same view: movers by peer id, and the
    predicted pipeline throughput (weakest expected capacity) before and after the moves."""

    moves: dict[bytes, Move]
    before: float
    after: float


def jitter_factor(peer_id: bytes, now: float, jitter: float) -> float:
    """A factor in [1 - jitter, 1 + jitter] fixed by (peer, time): pure, yet spread across peers."""
    digest = hashlib.blake2b(peer_id + struct.pack("<d", now), digest_size=8).digest()
    unit = int.from_bytes(digest, "little") / 2**64
    return 1.0 - jitter + 2.0 * jitter * unit


@functools.lru_cache(maxsize=4096)
def _noise(tolerance: float, peers: int) -> float:
    """Relative error of a figure averaged over `peers` measured speeds.

    Independent per-peer errors of up to `tolerance` shrink with the root of their number: three
    standard deviations of the mean of `peers` errors spread evenly over +-tolerance, capped at the
    worst case of one peer.
    """
    return tolerance * min(1.0, math.sqrt(3.0 / max(peers, 1)))


def _indistinct(low: float, low_noise: float, high: float, high_noise: float) -> bool:
    """Whether `high` >= `low` could be the same true figure, each being known to within its noise."""
    return high * (1.0 - high_noise) <= low * (1.0 + low_noise)


def _peer_id(peer: PeerLoad) -> bytes:
    return peer.peer_id


class _Greedy:
    """One water-filling pass over the table: capacities and counts as the chosen moves leave them.

    Every choice among options that measured speeds cannot tell apart (within `tolerance`) goes to a
    noise-free key — peer counts, stage index, peer id — so peers whose views differ only by
    measurement noise name the same movers for the same targets. With `by_count` every peer counts
    as one and the pass is exact: for swarms whose peers are alike in speed.
    """

    def __init__(self, table: StageTable, margin: float, tolerance: float, by_count: bool = False):
        self.table = table
        self.margin = margin
        self.tolerance = 0.0 if by_count else tolerance
        self.by_count = by_count
        self.caps = [float(n) for n in table.expected_count] if by_count else list(table.expected)
        self.serving = list(table.serving_count)
        self.expected = list(table.expected_count)
        self.taken: set[bytes] = set()

    def speed(self, peer: PeerLoad) -> float:
        return 1.0 if self.by_count else peer.speed

    def stage_noise(self, stage: int) -> float:
        return _noise(self.tolerance, self.expected[stage])

    def bottleneck(self) -> int:
        """The weakest stage; among stages within noise of it, the one with the fewest peers."""
        low = min(range(self.table.num_stages), key=self.caps.__getitem__)
        tied = [s for s in range(self.table.num_stages)
                if _indistinct(self.caps[low], self.stage_noise(low), self.caps[s], self.stage_noise(s))]
        return min(tied, key=lambda s: (self.expected[s], s))

    def donor_peer(self, stage: int, base: float):
        """(gain, peer): the serving peer of `stage` whose move lifts the pair's minimum by most (its
        speed nearest half their difference, the lowest id on a tie); among the peers whose speed is
        within noise of that one's, and whose move lifts the pair at all, the lowest peer id."""
        taken = self.taken
        peers = [p for p in self.table.members[stage].values() if p.state == SERVING and p.peer_id not in taken]
        if not peers:
            return None
        gap = self.caps[stage] - base
        if self.by_count:
            return (min(1.0, gap - 1.0), min(peers, key=_peer_id)) if gap > 1.0 else None
        ideal = gap / 2.0
        nearest = min(peers, key=lambda p: (abs(p.speed - ideal), p.peer_id))
        if nearest.speed >= gap:
            return None
        spread = (1.0 + self.tolerance) / (1.0 - self.tolerance)
        low, high = nearest.speed / spread, min(nearest.speed * spread, gap)
        chosen = min((p for p in peers if low <= p.speed < high or p is nearest), key=_peer_id)
        return ideal - abs(chosen.speed - ideal), chosen

    def real_gain(self, donor: int, target: int, gain: float) -> bool:
        """Whether the step lifts the target beyond the margin and beyond noise. When the two stages'
        mean peer speeds are within noise of each other, their sums differ by noise as much as by
        capacity, so peer counts decide: the donor must keep more peers than the target has."""
        base = self.caps[target]
        if gain <= base * self.margin:
            return False
        if self.expected[target] == 0:
            return True
        if self.alike_peers([donor, target]):
            return self.expected[donor] - 1 > self.expected[target]
        return True

    def alike_peers(self, stages) -> bool:
        """Whether the mean peer speeds of these (non-empty) stages are all within noise of each other."""
        means = [(self.caps[s] / self.expected[s], self.stage_noise(s)) for s in stages if self.expected[s]]
        if not means:
            return False
        low, high = min(means), max(means)
        return _indistinct(low[0], low[1], high[0], high[1])

    def step(self):
        """The next move into the bottleneck, or None when no donor lifts it for real."""
        target = self.bottleneck()
        base = self.caps[target]
        caps = self.caps
        order = sorted(range(self.table.num_stages), key=lambda s: -caps[s])
        third = order[min(2, len(order) - 1)]
        reach = caps[third] * (1.0 - self.stage_noise(third))
        # A stage's move gains at most half its gap to the target: visit the widest gaps first and
        # stop once no remaining stage could come within noise of the best gain found.
        donors = [s for s in order if s != target and self.serving[s] >= 2 and caps[s] > base
                  and caps[s] * (1.0 + self.stage_noise(s)) >= reach]  # within noise of the top three
        shrink = (1.0 - self.tolerance) / (1.0 + self.tolerance)
        options, floor = [], 0.0
        for stage in donors:
            if (caps[stage] - base) / 2.0 < floor:
                break
            found = self.donor_peer(stage, base)
            if found is not None and self.real_gain(stage, target, found[0]):
                options.append((found[0], stage, found[1]))
                floor = max(floor, found[0] * shrink)
        options = [o for o in options if o[0] >= floor]
        if not options:
            return None
        _, stage, peer = min(options, key=lambda o: (-self.serving[o[1]], o[1]))
        self.taken.add(peer.peer_id)
        caps[stage] -= self.speed(peer)
        caps[target] += self.speed(peer)
        self.serving[stage] -= 1
        self.expected[stage] -= 1
        self.expected[target] += 1
        return Move(peer.peer_id, stage, target)


def move_plan(table: StageTable, margin: float, max_moves: int = 256, speed_tolerance: float = 0.0) -> SharedPlan:
    """Moves that, applied together, maximise the weakest stage; empty unless it rises by > margin.

    Greedy water-filling on expected capacity: take the weakest stage, bring it the donor peer that
    best evens the pair, repeat while each step lifts the weakest stage by more than the margin and
    by more than measurement noise. `speed_tolerance` is the relative error of a measured speed: 0
    for exact speeds (the simulator's global rules), `PolicyConfig.speed_tolerance` in the daemon.
    Memoised per table version: all peers of a simulated swarm share one computation.
    """
    if not 0 <= speed_tolerance < 1:
        raise ValueError(f"speed_tolerance must be in [0, 1), got {speed_tolerance}")
    key = ("plan", margin, max_moves, speed_tolerance)
    cached = table.memo.get(key)
    if cached is not None:
        return cached
    greedy = _Greedy(table, margin, speed_tolerance)
    if min(table.expected_count) > 0 and greedy.alike_peers(range(table.num_stages)):
        # Where every stage's peers are alike in speed to within noise, the sums differ by noise as
        # much as by capacity (the weakest sum most of all: a minimum over noisy figures); the peer
        # counts say what the sums would without the noise, the same in every peer's view.
        greedy = _Greedy(table, margin, speed_tolerance, by_count=True)
    start = min(greedy.caps)
    moves: list[Move] = []
    while len(moves) < max_moves:
        move = greedy.step()
        if move is None:
            break
        moves.append(move)
    if moves and min(greedy.caps) > start * (1.0 + margin):
        caps = list(table.expected)
        for move in moves:
            speed = table.by_id[move.peer_id].speed
            caps[move.source] -= speed
            caps[move.target] += speed
        before = min(table.expected)
        shared = SharedPlan({m.peer_id: m for m in moves}, before, min(caps))
    else:
        shared = SharedPlan({}, min(table.expected), min(table.expected))
    table.memo[key] = shared
    return shared


def plan(table: StageTable, me: bytes, now: float, state: PolicyState, config: PolicyConfig) -> Decision:
    """This peer's decision at this check: move now, wait for confirmation, or stay."""
    shared = move_plan(table, config.margin, config.max_moves, config.speed_tolerance)
    mine = shared.moves.get(me)
    if mine is None:
        nxt = now + config.period_s * jitter_factor(me, now, config.jitter)
        return Decision(None, PolicyState(), nxt, "balanced" if not shared.moves else "not chosen")
    if state.pending_stage == mine.target:
        nxt = now + config.period_s * jitter_factor(me, now, config.jitter)
        return Decision(mine.target, PolicyState(), nxt, "confirmed")
    return Decision(None, PolicyState(pending_stage=mine.target), now + config.confirm_after_s, "pending")


def choose_join_stage(table: StageTable, me: bytes = b"", min_peers: int = 1) -> int:
    """A new peer joins the stage with the least expected capacity: the bottleneck it would lift.

    Stages with fewer than `min_peers` peers (joining ones included) come first, whatever their
    capacity: with one peer, a stage stops the whole job when that peer fails, and no throughput
    gained elsewhere is worth that (measured speeds are noisy too: one fast peer alone on a stage
    once drew four joiners to the other). Exact ties are broken by a hash of the joiner's id, so
    peers joining at the same moment from the same view spread over the tied stages instead of
    piling onto the lowest index.
    """
    ranks = [(count >= min_peers, capacity) for count, capacity in zip(table.expected_count, table.expected)]
    low = min(ranks)
    tied = [s for s, rank in enumerate(ranks) if rank <= low]
    if len(tied) == 1:
        return tied[0]
    pick = int.from_bytes(hashlib.blake2b(me, digest_size=8).digest(), "little") % len(tied)
    return tied[pick]
