"""The rebalancing rule: a pure function of the load table, the time and this peer's hysteresis state.

The daemon and the simulator call the same `plan`, so what the simulator measures is what runs.
Every peer derives the same *global* move plan from the shared view and moves only if the plan names
it: that gives exactly as many movers as the deficit needs, and two peers never jump for one gap.
A move is taken only when the plan named this peer on two consecutive checks (hysteresis), the second
check coming `confirm_after_s` after the first, so one noisy view never triggers a move and a real
gap is still closed in well under a period. See docs/rebalancing.md for the rule and the evidence.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import struct
from dataclasses import dataclass

from swarmd.rebalance.table import SERVING, StageTable


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

    def __post_init__(self):
        if self.period_s <= 0 or self.confirm_after_s <= 0:
            raise ValueError("period_s and confirm_after_s must be positive")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")
        if self.margin < 0 or self.max_moves < 1:
            raise ValueError("margin must be >= 0 and max_moves >= 1")


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


def _best_donor(table: StageTable, caps: list[float], counts: list[int], taken: set[bytes], bottleneck: int):
    """(pair minimum, peer) for the move into `bottleneck` that best evens it with its donor.

    Donors are the three strongest stages; a stage keeps at least one serving peer. The best peer
    has the speed closest to half the two stages' difference; ties go to the lowest peer id, so
    every peer computing this from the same view picks the same mover.
    """
    base = caps[bottleneck]
    best_pair, best_peer = base, None
    for stage in heapq.nlargest(3, range(table.num_stages), key=caps.__getitem__):
        if stage == bottleneck or counts[stage] < 2 or caps[stage] <= base:
            continue
        ideal = (caps[stage] - base) / 2.0
        near, near_peer = math.inf, None
        for peer in table.members[stage].values():
            if peer.state != SERVING or peer.peer_id in taken:
                continue
            off = abs(peer.speed - ideal)
            if off < near or (off == near and peer.peer_id < near_peer.peer_id):
                near, near_peer = off, peer
        if near_peer is None:
            continue
        pair = base + ideal - near
        if pair > best_pair or (pair == best_pair and best_peer and near_peer.peer_id < best_peer.peer_id):
            best_pair, best_peer = pair, near_peer
    return None if best_peer is None else (best_pair, best_peer)


def move_plan(table: StageTable, margin: float, max_moves: int = 256) -> SharedPlan:
    """Moves that, applied together, maximise the weakest stage; empty unless it rises by > margin.

    Greedy water-filling on expected capacity: take the weakest stage, bring it the donor peer that
    best evens the pair, repeat while each step lifts the weakest stage by more than the margin.
    Memoised per table version: all peers of a simulated swarm share one computation.
    """
    key = ("plan", margin, max_moves)
    cached = table.memo.get(key)
    if cached is not None:
        return cached
    caps = list(table.expected)
    counts = list(table.serving_count)
    before = min(caps)
    taken: set[bytes] = set()
    moves: list[Move] = []
    while len(moves) < max_moves:
        bottleneck = min(range(table.num_stages), key=caps.__getitem__)
        found = _best_donor(table, caps, counts, taken, bottleneck)
        if found is None or found[0] <= caps[bottleneck] * (1.0 + margin):
            break
        peer = found[1]
        taken.add(peer.peer_id)
        moves.append(Move(peer.peer_id, peer.stage, bottleneck))
        caps[peer.stage] -= peer.speed
        caps[bottleneck] += peer.speed
        counts[peer.stage] -= 1
    after = min(caps)
    if moves and after > before * (1.0 + margin):
        shared = SharedPlan({m.peer_id: m for m in moves}, before, after)
    else:
        shared = SharedPlan({}, before, before)
    table.memo[key] = shared
    return shared


def plan(table: StageTable, me: bytes, now: float, state: PolicyState, config: PolicyConfig) -> Decision:
    """This peer's decision at this check: move now, wait for confirmation, or stay."""
    shared = move_plan(table, config.margin, config.max_moves)
    mine = shared.moves.get(me)
    if mine is None:
        nxt = now + config.period_s * jitter_factor(me, now, config.jitter)
        return Decision(None, PolicyState(), nxt, "balanced" if not shared.moves else "not chosen")
    if state.pending_stage == mine.target:
        nxt = now + config.period_s * jitter_factor(me, now, config.jitter)
        return Decision(mine.target, PolicyState(), nxt, "confirmed")
    return Decision(None, PolicyState(pending_stage=mine.target), now + config.confirm_after_s, "pending")


def choose_join_stage(table: StageTable, me: bytes = b"") -> int:
    """A new peer joins the stage with the least expected capacity: the bottleneck it would lift.

    Exact ties are broken by a hash of the joiner's id, so peers joining at the same moment from the
    same view spread over the tied stages instead of piling onto the lowest index.
    """
    low = min(table.expected)
    tied = [s for s in range(table.num_stages) if table.expected[s] <= low]
    if len(tied) == 1:
        return tied[0]
    pick = int.from_bytes(hashlib.blake2b(me, digest_size=8).digest(), "little") % len(tied)
    return tied[pick]
