"""Discrete-event simulation of a swarm's stage assignment under a trace, on a simulated clock.

The pipeline processes min over stages of the summed speeds of the peers serving there. Peers join
and leave as the trace says; a rule decides where joiners go and who moves; a move takes
`move_cost_s` (the state download) during which the mover serves nothing. The `swarmd` rule calls
`swarmd.rebalance.policy` exactly as the daemon does, one check per peer on its own jittered clock.
Each event costs O(stages) plus the policy's memoised plan, so 32 h of 400 peers takes about a second.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from swarmd.rebalance.policy import PolicyConfig, PolicyState, choose_join_stage, jitter_factor, move_plan, plan
from swarmd.rebalance.table import JOINING, SERVING, PeerLoad, StageTable
from swarmd.sim.optimal import OptimumTrack, track
from swarmd.sim.trace import JOIN, TraceEvent


@dataclass(frozen=True)
class Rule:
    """How peers are placed: `joins` is "random" or "bottleneck"; then either a global check every
    `global_period_s` (the paper's rule) or per-peer checks with `policy` (swarmd), or neither."""

    name: str
    joins: str = "random"
    global_period_s: float | None = None
    policy: PolicyConfig | None = None

    def __post_init__(self):
        if self.joins not in ("random", "bottleneck"):
            raise ValueError(f"joins must be random or bottleneck, got {self.joins!r}")


def standard_rules(policy: PolicyConfig | None = None) -> dict[str, Rule]:
    """The rules issue 6 compares: no rebalancing, the paper's periodic rule at three periods, swarmd."""
    return {
        "none": Rule("none"),
        "T60": Rule("T60", global_period_s=60.0),
        "T300": Rule("T300", global_period_s=300.0),
        "T600": Rule("T600", global_period_s=600.0),
        "swarmd": Rule("swarmd", joins="bottleneck", policy=policy or PolicyConfig()),
    }


@dataclass(frozen=True)
class SimConfig:
    stages: int = 8
    # Seconds to download a stage's parameters and optimizer state: size / link rate (issue 6: 60 s).
    move_cost_s: float = 60.0
    # A joiner downloads state too; 0 counts it from its arrival, as the paper's comparison does.
    join_cost_s: float = 0.0
    # Spacing of the recorded timeline (for plots); does not affect the averages, which are exact.
    sample_every_s: float = 120.0

    def __post_init__(self):
        if self.stages < 1 or self.move_cost_s < 0 or self.join_cost_s < 0 or self.sample_every_s <= 0:
            raise ValueError("stages >= 1, costs >= 0 and sample_every_s > 0 are required")


@dataclass
class SimResult:
    rule: str
    duration_s: float
    throughput_avg: float
    optimal_avg: float
    moves: int
    moving_peer_s: float
    peer_s: float
    optimal_gap_avg: float
    timeline: list[tuple[float, float, float]] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.throughput_avg / self.optimal_avg if self.optimal_avg > 0 else 0.0

    @property
    def moves_per_hour(self) -> float:
        return self.moves / (self.duration_s / 3600.0)

    @property
    def moving_share(self) -> float:
        return self.moving_peer_s / self.peer_s if self.peer_s > 0 else 0.0


@dataclass
class _Peer:
    peer_id: bytes
    speed: float
    stage: int
    incarnation: int
    state: PolicyState = PolicyState()
    moving: bool = False
    check_ticket: int = 0
    check_at: float = math.inf


_CHECK, _ARRIVE, _GLOBAL = 0, 1, 2


class _Swarm:
    def __init__(self, rule: Rule, config: SimConfig, seed: int):
        self.rule = rule
        self.config = config
        self.rng = random.Random(seed)
        self.table = StageTable(config.stages)
        self.peers: dict[str, _Peer] = {}
        self.names: dict[bytes, str] = {}
        self.queue: list[tuple[float, int, int, str, int]] = []
        self.seq = 0
        self.incarnations = 0
        self.moves = 0
        self.moving = 0

    def push(self, time: float, kind: int, name: str = "", ticket: int = 0) -> None:
        """Queue an event; `ticket` (incarnation or check ticket) voids it if the peer moved on."""
        self.seq += 1
        heapq.heappush(self.queue, (time, self.seq, kind, name, ticket))

    def trace_event(self, now: float, event: TraceEvent) -> None:
        if event.event == JOIN:
            self.join(now, event.peer, event.speed)
        else:
            self.leave(event.peer)

    def join(self, now: float, name: str, speed: float) -> None:
        peer_id = name.encode()
        if self.rule.joins == "random":
            stage = self.rng.randrange(self.config.stages)
        else:
            stage = choose_join_stage(self.table, peer_id)
        self.incarnations += 1
        peer = _Peer(peer_id, speed, stage, self.incarnations)
        self.peers[name] = peer
        self.names[peer_id] = name
        if self.config.join_cost_s > 0 and now > 0:
            self._start_transfer(now, name, peer, stage, self.config.join_cost_s)
        else:
            self.table.put(PeerLoad(peer_id, stage, speed, SERVING))
        if self.rule.policy is not None:
            cfg = self.rule.policy
            self.schedule_check(now + cfg.period_s * jitter_factor(peer_id, now, cfg.jitter), name, peer)

    def schedule_check(self, time: float, name: str, peer: _Peer) -> None:
        """Schedule the peer's next check; its ticket voids it should the peer leave meanwhile."""
        ticket = self.seq + 1  # the sequence number push is about to give this event
        self.push(time, _CHECK, name, ticket)
        peer.check_ticket, peer.check_at = ticket, time

    def leave(self, name: str) -> None:
        peer = self.peers.pop(name)
        del self.names[peer.peer_id]
        if peer.moving:
            self.moving -= 1
        self.table.remove(peer.peer_id)

    def _start_transfer(self, now: float, name: str, peer: _Peer, target: int, cost: float) -> None:
        peer.stage = target
        peer.moving = True
        self.moving += 1
        self.table.put(PeerLoad(peer.peer_id, target, peer.speed, JOINING))
        self.push(now + cost, _ARRIVE, name, peer.incarnation)

    def move(self, now: float, name: str, target: int) -> None:
        self.moves += 1
        peer = self.peers[name]
        if self.config.move_cost_s > 0:
            self._start_transfer(now, name, peer, target, self.config.move_cost_s)
        else:
            peer.stage = target
            self.table.put(PeerLoad(peer.peer_id, target, peer.speed, SERVING))

    def internal_event(self, now: float, kind: int, name: str, ticket: int) -> None:
        if kind == _GLOBAL:
            self.global_check(now)
            self.push(now + self.rule.global_period_s, _GLOBAL)
            return
        peer = self.peers.get(name)
        if peer is None or ticket != (peer.incarnation if kind == _ARRIVE else peer.check_ticket):
            return  # it left (and maybe rejoined) since this was queued
        if kind == _ARRIVE:
            peer.moving = False
            self.moving -= 1
            self.table.put(PeerLoad(peer.peer_id, peer.stage, peer.speed, SERVING))
            return
        decision = plan(self.table, peer.peer_id, now, peer.state, self.rule.policy)
        peer.state = decision.state
        if decision.move_to is not None:
            self.move(now, name, decision.move_to)
        self.schedule_check(decision.next_check_at, name, peer)

    def global_check(self, now: float) -> None:
        """The paper's rule: from the strongest stages to the weakest while that lifts the minimum."""
        for move in list(move_plan(self.table, margin=0.0).moves.values()):
            self.move(now, self.names[move.peer_id], move.target)


def simulate(
    events: list[TraceEvent], rule: Rule, config: SimConfig = SimConfig(), seed: int = 0,
    duration_s: float | None = None, timeline: bool = False, optimum: OptimumTrack | None = None,
) -> SimResult:
    """Replay `events` under `rule`; averages are exact integrals over [0, duration_s].

    `optimum` is `optimal.track(events, config.stages)`, computed here unless given: pass it when
    replaying one trace under several rules, since it costs more than a replay on mixed speeds.
    """
    end = duration_s if duration_s is not None else (events[-1].time if events else 0.0)
    if optimum is None:
        optimum = track(events, config.stages)
    opt = 0.0
    swarm = _Swarm(rule, config, seed)
    if rule.global_period_s is not None:
        swarm.push(rule.global_period_s, _GLOBAL)
    last = 0.0
    thr_area = opt_area = moving_area = peer_area = 0.0
    samples: list[tuple[float, float, float]] = []
    next_sample = 0.0
    index = 0
    while True:
        trace_next = events[index].time if index < len(events) else math.inf
        queue_next = swarm.queue[0][0] if swarm.queue else math.inf
        now = min(trace_next, queue_next, end)
        dt = now - last
        if dt > 0:
            thr = swarm.table.throughput()
            thr_area += thr * dt
            opt_area += opt * dt
            moving_area += swarm.moving * dt
            peer_area += len(swarm.peers) * dt
            while next_sample < now:
                if timeline:
                    samples.append((next_sample, thr, opt))
                next_sample += config.sample_every_s
            last = now
        if now >= end:
            break
        if trace_next <= queue_next:
            swarm.trace_event(now, events[index])
            opt = optimum.values[index]
            index += 1
        else:
            time, _, kind, name, ticket = heapq.heappop(swarm.queue)
            swarm.internal_event(time, kind, name, ticket)
    span = max(end, 1e-12)
    return SimResult(
        rule=rule.name, duration_s=end, throughput_avg=thr_area / span, optimal_avg=opt_area / span,
        moves=swarm.moves, moving_peer_s=moving_area, peer_s=peer_area,
        optimal_gap_avg=optimum.gap_avg, timeline=samples,
    )
