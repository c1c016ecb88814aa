"""Stochastic wiring: which peer of a stage gets the next request, decided without any I/O.

SWARM sends each microbatch to the peer expected to be free soonest, so fast peers get more work
and slow ones less, with no central scheduler. Per stage a min-heap is keyed by each peer's
accumulated expected busy time; a pick takes the smallest key (random tie-break from a seeded RNG)
and adds `samples × weight / measured samples-per-second` to it, an interleaved weighted
round-robin. Throughput is measured by this trainer alone (announcements are never trusted for
speed) as a bias-corrected EMA of seconds per sample over whole-RPC wall time, so it includes the
network. A peer the trainer has not measured yet enters at the current minimum key: it gets work
at once and is measured, without jumping ahead of everyone by the whole history.

Each call's timeout is derived from the peer's measured rate (`timeout_factor` times the call's
expected seconds, between a floor and the caller's ceiling; the ceiling for a peer not measured
yet, or one that just timed out). A timeout does not ban: its elapsed time is fed to the EMA as a
lower bound of the true cost, but capped at `timeout_penalty` times the current estimate, so one
long stall cannot make a peer look 75x slower for hundreds of picks (the paper's code feeds the
whole elapsed time); the estimate recovers with the next replies. A peer that times out
`bench_after` times in a row is benched (left out of picks) for `bench_initial_s`, doubling with
each further timeout up to `bench_max_s`; when the bench lifts the next call probes it, and one
reply clears its record. A peer far slower than its stage's pace (`slow_factor` times the lower
median of its peers' rates) is withheld from picks, except probe calls whose reply replaces its
estimate: a stage's step waits for its slowest member's share and all-reduce part, so routing it even a little
work costs every step more than its compute adds. Slowness is judged on the median of a peer's
last `slow_window` replies, once it has that many, else on its probe reply; the first probe comes `slow_probe_first_s`
after a peer is withheld, the gap doubling to `slow_probe_s`, so a newcomer withheld for its cold
first calls is soon back, and a peer slow for good costs a probe every `slow_probe_s`. `busy` charges the
peer one more request and reroutes; a connection error or a typed failure bans the peer until it
re-announces (a newer announcement) or the announcement it was banned under expires, or, so that
a fixed table cannot starve a stage for ever, until `max_ban_s` has passed.

Pure: the caller passes the wall-clock `now` and the measured durations; tests drive it directly.
"""

from __future__ import annotations

import heapq
import logging
import math
import random
import statistics
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Any

from swarmd.directory import StagePeer

log = logging.getLogger(__name__)


class Kind(Enum):
    """What a request asks of a peer; it weighs the request's expected cost."""

    FORWARD = "forward"
    BACKWARD = "backward"
    FORWARD_BACKWARD = "forward_backward"


@dataclass(frozen=True)
class WiringConfig:
    # EMA smoothing of seconds-per-sample; the paper's code uses 0.1 (about the last 10 requests).
    ema_alpha: float = 0.1
    # A backward recomputes the forward and then backpropagates: ~2.5 forwards in the paper's code.
    backward_weight: float = 2.5
    # Cost charged to a peer before anyone on its stage has been measured; it only orders peers
    # that are all unmeasured, so its scale does not matter much (10 ms per sample).
    default_seconds_per_sample: float = 0.01
    # A ban lifts when the peer re-announces; with a static table it never would, so it also lifts
    # after this long (the peer is then tried again and re-banned if it still fails).
    max_ban_s: float = 60.0
    # A call's timeout: timeout_factor x its expected seconds at the peer's measured rate, at least
    # timeout_floor_s (a reply's time varies with the peer's queue and the network; a floor keeps a
    # fast peer's tiny estimate from timing out on noise), at most the caller's ceiling.
    timeout_factor: float = 4.0
    timeout_floor_s: float = 5.0
    # A timeout is fed to the EMA as at most this many times the current estimate.
    timeout_penalty: float = 2.0
    # Consecutive timeouts before a peer is benched, and the bench's first and longest length.
    bench_after: int = 2
    bench_initial_s: float = 5.0
    bench_max_s: float = 300.0
    # A peer whose measured seconds per sample exceed this many times its stage's pace (the lower
    # median of its usable peers': the faster of two) gets no work (its mates take its share), but
    # probes. A stage commits a step only once every microbatch is held and its holders' all-reduce
    # parts are in: a peer 4x slower than its mates (a shared or throttled host, docs/chaos.md `slow_peer`) holds
    # up every step it gets one microbatch of, by more than its compute saves its mates; below 4x
    # the weighted routing (fewer picks for a slower peer) is the better use of it.
    slow_factor: float = 4.0
    # At most this long between the calls a withheld slow peer is given to measure it again (its
    # reply replaces its estimate, so a peer that recovered rejoins at once). Each probe can delay
    # one step by the slow peer's time; every 20 s that is a few percent of the stage's time.
    slow_probe_s: float = 20.0
    # The first probe after a peer is withheld, the gap then doubling to slow_probe_s: a fresh
    # process's first calls pay one-time costs (a connection's handshake, lazy initialisation, a
    # cold allocator) that measured 10-20x its pace for its first two replies under load, so a
    # newcomer (a joining or a moved peer) can be withheld on them; its first probe, warm, brings it
    # back within seconds rather than slow_probe_s. A peer slow for good pays a few extra probes.
    slow_probe_first_s: float = 4.0
    # A peer is judged slow (and sets the pace others are judged by) on the median of its last
    # this many replies, and only once it has that many. The routing already gives a slow peer few
    # picks: a peer stopped 75% of the time (bench/chaos_goodput.py `slow_peer`) got 3 replies in
    # 13 steps, so a window of five never judged it and the stage kept its pace (0.17 of the
    # mate-less rate, tests/train/test_train_stalled_mate.py). One stray fast reply is outvoted.
    slow_window: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.ema_alpha <= 1:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")
        if self.backward_weight <= 0 or self.default_seconds_per_sample <= 0 or self.max_ban_s < 0:
            raise ValueError("backward_weight and default_seconds_per_sample must be positive, "
                             "max_ban_s must not be negative")
        if not (self.timeout_factor > 0 and self.timeout_floor_s > 0 and self.timeout_penalty >= 1):
            raise ValueError("timeout_factor and timeout_floor_s must be positive, timeout_penalty >= 1")
        if self.bench_after < 1 or not 0 < self.bench_initial_s <= self.bench_max_s:
            raise ValueError("bench_after must be >= 1 and 0 < bench_initial_s <= bench_max_s")
        if not (self.slow_factor > 1 and 0 < self.slow_probe_first_s <= self.slow_probe_s and self.slow_window >= 1):
            raise ValueError("slow_factor must be > 1, 0 < slow_probe_first_s <= slow_probe_s and slow_window at least 1")

    def weight(self, kind: Kind) -> float:
        """Cost of one sample of `kind` in forward-equivalents."""
        if kind is Kind.FORWARD:
            return 1.0
        if kind is Kind.BACKWARD:
            return self.backward_weight
        return 1.0 + self.backward_weight


class Throughput:
    """Bias-corrected EMA of forward-equivalent seconds per sample (Adam-style correction: the
    first measurements are not dragged towards the zero the average starts from), and the last
    `window` replies, whose median judges slowness without one outlier's long tail."""

    def __init__(self, alpha: float, window: int = 1) -> None:
        self.alpha = alpha
        self._ema = 0.0
        self._count = 0
        self._recent: deque[float] = deque(maxlen=window)

    @property
    def measured(self) -> bool:
        return self._count > 0

    def update(self, seconds_per_sample: float) -> None:
        self._ema = self.alpha * seconds_per_sample + (1 - self.alpha) * self._ema
        self._count += 1
        self._recent.append(seconds_per_sample)

    def recent_median(self) -> float | None:
        """The median of the last `window` replies; None until there are that many."""
        if len(self._recent) < (self._recent.maxlen or 0):
            return None
        return statistics.median(self._recent)

    @property
    def seconds_per_sample(self) -> float:
        return self._ema / (1 - (1 - self.alpha) ** self._count)

    @property
    def samples_per_s(self) -> float:
        return 1.0 / self.seconds_per_sample if self.measured and self.seconds_per_sample > 0 else math.inf


@dataclass(frozen=True)
class Pick:
    """One routing decision, handed back with the outcome so the right peer is charged."""

    peer: StagePeer
    kind: Kind
    samples: int
    probe: bool = False  # a withheld slow peer's probe: its reply replaces the peer's estimate
    # A probe sent at once after one whose peer first caught up with its mates (`completed`): it is
    # judged whatever its reply says.
    recheck: bool = False


@dataclass
class _Ban:
    announcement: StagePeer
    until: float
    reason: str


class StageWiring:
    """The heap of one stage's peers."""

    def __init__(self, stage: int, config: WiringConfig, rng: random.Random) -> None:
        self.stage = stage
        self.config = config
        self._rng = rng
        self._peers: dict[bytes, StagePeer] = {}
        self._key: dict[bytes, float] = {}
        self._heap: list[tuple[float, float, bytes]] = []  # (key, tie-break, peer_id); stale entries skipped
        self._speed: dict[bytes, Throughput] = {}
        self._bans: dict[bytes, _Ban] = {}
        self._strikes: dict[bytes, int] = {}  # consecutive timeouts
        self._benched: dict[bytes, float] = {}  # peer id -> until (wall clock)
        self._probe_at: dict[bytes, float] = {}  # slow peers withheld: peer id -> next probe (wall clock)
        self._probe_gap: dict[bytes, float] = {}  # peer id -> the gap to its next probe (doubling)
        # Peers whose speed record began with a probe reply: judged on it until their window fills.
        self._probed: set[bytes] = set()

    # ------------------------------------------------------------------ membership

    def update(self, peers: list[StagePeer], now: float) -> None:
        """Replace the peer list with a fresh read of the directory. A ban lifts when the peer
        re-announces (a record newer than the one it was banned under), when that record lapses,
        or after `max_ban_s`; not when a read merely misses the peer or shows an older record:
        replicas differ for a while (a restarted peer's new "joining" record beside its old
        "serving" one), and lifting at each flip re-banned a restarting peer twenty times a second."""
        fresh = {p.peer_id: p for p in peers if p.stage == self.stage and p.state == "serving" and p.expires > now}
        for peer_id, ban in list(self._bans.items()):
            current = fresh.get(peer_id)
            renewed = current is not None and current.expires > ban.announcement.expires
            if renewed or ban.announcement.expires <= now or now >= ban.until:
                del self._bans[peer_id]
        entry = self._minimum()
        for peer_id in self._peers.keys() - fresh.keys():
            del self._key[peer_id]
        for peer_id in fresh.keys() - self._peers.keys():
            self._set_key(peer_id, entry)
        self._peers = fresh
        self._speed = {pid: s for pid, s in self._speed.items() if pid in fresh}
        self._strikes = {pid: n for pid, n in self._strikes.items() if pid in fresh}
        self._benched = {pid: t for pid, t in self._benched.items() if pid in fresh}
        self._probe_at = {pid: t for pid, t in self._probe_at.items() if pid in fresh}
        self._probe_gap = {pid: t for pid, t in self._probe_gap.items() if pid in fresh}
        self._probed &= fresh.keys()

    def ban(self, peer: StagePeer, now: float, reason: str) -> bool:
        """True when this newly bans the peer (concurrent calls often fail on the same dead peer).
        The ban remembers the announcement current now, not the one the failed call was routed by:
        only a later change counts as re-announcing."""
        current = self._peers.get(peer.peer_id)
        if current is None:
            return False
        fresh = peer.peer_id not in self._bans
        self._bans[peer.peer_id] = _Ban(current, now + self.config.max_ban_s, reason)
        return fresh

    def _lift_expired_bans(self, now: float) -> None:
        for peer_id, ban in list(self._bans.items()):
            if now >= ban.until or now >= ban.announcement.expires:
                del self._bans[peer_id]

    def _lift_expired_benches(self, now: float) -> None:
        for peer_id in [pid for pid, until in self._benched.items() if now >= until]:
            del self._benched[peer_id]

    def _excluded(self, now: float, slow_too: bool = False) -> set[bytes]:
        """Peers not to pick now: banned, benched and (unless `slow_too`) withheld for slowness."""
        self._lift_expired_bans(now)
        self._lift_expired_benches(now)
        out = self._bans.keys() | self._benched.keys()
        return out if slow_too else out | self.withheld(now, out)

    def withheld(self, now: float, excluded: set[bytes] | None = None) -> set[bytes]:
        """Peers withheld from picks for slowness now (`slow_factor`): their probe is not due.
        Slowness is against the stage's pace, the lower median of its judged peers' rates (the
        faster of two): one fast peer, which a liar can always be, cannot withhold all its mates
        and hold every microbatch of a step alone, where robust aggregation has no one to compare
        it with. The pace is taken among the peers not banned or benched (`excluded`), so a slow
        peer is used again, at once, when its faster mates are gone."""
        if excluded is None:
            self._lift_expired_bans(now)
            self._lift_expired_benches(now)
            excluded = self._bans.keys() | self._benched.keys()
        rates = {pid: spp for pid, spp in ((pid, self._judged_rate(pid, s)) for pid, s in self._speed.items()
                                          if pid in self._peers and pid not in excluded) if spp is not None}
        ordered = sorted(rates.values())
        pace = ordered[(len(ordered) - 1) // 2] if ordered else 0.0
        slow = {pid for pid, spp in rates.items() if pace > 0 and spp > self.config.slow_factor * pace}
        for peer_id in [pid for pid in self._probe_at if pid not in slow]:
            del self._probe_at[peer_id]
        for peer_id in slow - self._probe_at.keys():
            self._probe_at[peer_id] = self._next_probe(peer_id, now)
            log.info("stage %d peer %s withheld for slowness: %.3g s a sample against the stage's pace of %.3g; "
                     "probed in %.3g s", self.stage, self._peers[peer_id].addr, rates[peer_id], pace,
                     self._probe_at[peer_id] - now)
        return {pid for pid in slow if now < self._probe_at[pid]}

    def _next_probe(self, peer_id: bytes, now: float) -> float:
        """When to probe a withheld peer next: slow_probe_first_s, then twice the last gap, up to
        slow_probe_s. The gap is kept when the peer recovers, so one that flaps backs off too."""
        gap = self._probe_gap.get(peer_id, self.config.slow_probe_first_s)
        self._probe_gap[peer_id] = min(2 * gap, self.config.slow_probe_s)
        return now + gap

    def _judged_rate(self, peer_id: bytes, speed: Throughput) -> float | None:
        """Seconds per sample that slowness is judged on: the median of the peer's last
        `slow_window` replies once it has that many, else its probe reply's (a probe restarts
        its record); None: not judged yet.

        The same rule whether the peer is withheld or not: judged on its EMA while withheld and
        on the median otherwise, a peer flapped in and out of `withheld` from one look to the
        next (its probe gap doubling at each flap), and a released peer leaving the judged set
        moved the stage's pace and withheld another, so that `usable` and `choose` at the same
        moment disagreed and a trainer waited for ever between two usable peers."""
        median = speed.recent_median()
        if median is not None:
            return median
        return speed.seconds_per_sample if peer_id in self._probed and speed.measured else None

    def usable(self, now: float, benched_too: bool = False) -> list[StagePeer]:
        """Announced peers not banned, and (unless `benched_too`) not benched nor withheld for slowness."""
        excluded = self._excluded(now)
        if benched_too:
            excluded = set(self._bans)
        return [p for pid, p in self._peers.items() if pid not in excluded]

    @property
    def peer_count(self) -> int:
        return len(self._peers)

    def banned(self) -> dict[bytes, str]:
        return {pid: ban.reason for pid, ban in self._bans.items()}

    def benched(self, now: float) -> dict[bytes, float]:
        """Peer id -> seconds its bench still lasts."""
        self._lift_expired_benches(now)
        return {pid: until - now for pid, until in self._benched.items()}

    # ------------------------------------------------------------------ routing

    def choose(self, samples: int, kind: Kind, now: float, exclude: frozenset[bytes] = frozenset(),
               slow_too: bool = False) -> Pick | None:
        """The usable peer with the smallest expected finish, charged for this request; None when
        no peer is usable (all gone, banned or excluded). `slow_too`: peers withheld for slowness
        count as usable, for a second opinion: it is about what a peer answers, not how fast, and
        without them a fast liar's reply stands unchecked whenever its honest mates look slow."""
        excluded = self._excluded(now, slow_too) | exclude
        skipped = []
        chosen = None
        while self._heap:
            key, tie, peer_id = heapq.heappop(self._heap)
            if self._key.get(peer_id) != key:
                continue  # stale entry: the peer left or its key moved on
            if peer_id in excluded:
                skipped.append((key, tie, peer_id))
                continue
            chosen = peer_id
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if chosen is None:
            return None
        probe = chosen in self._probe_at
        recheck = probe and self._probe_at[chosen] == -math.inf
        if probe:
            # Withheld until now, its key stayed behind its mates': charged from where they are,
            # so a peer that turns out fast again is not handed a burst of work.
            # A recheck repeats the probe before it (which found the peer catching up): the gap
            # stays where that probe left it.
            self._probe_at[chosen] = (now + self._probe_gap[chosen] if recheck and chosen in self._probe_gap
                                      else self._next_probe(chosen, now))
            rest = [k for pid, k in self._key.items() if pid != chosen and pid not in excluded]
            self._key[chosen] = max(self._key[chosen], min(rest, default=self._key[chosen]))
        self._set_key(chosen, self._key[chosen] + self.expected_seconds(chosen, samples, kind))
        return Pick(self._peers[chosen], kind, samples, probe, recheck)

    def again(self, peer_id: bytes, samples: int, kind: Kind, now: float) -> Pick | None:
        """The same peer once more (a retry of a call that timed out there: if it did complete,
        the peer answers the repeat without counting it twice), charged like a pick; None when it
        is gone, banned or benched."""
        if peer_id not in self._peers or peer_id in self._excluded(now):
            return None
        self._set_key(peer_id, self._key[peer_id] + self.expected_seconds(peer_id, samples, kind))
        return Pick(self._peers[peer_id], kind, samples)

    def expected_seconds(self, peer_id: bytes, samples: int, kind: Kind) -> float:
        return samples * self.config.weight(kind) * self._seconds_per_sample(peer_id)

    def call_timeout(self, pick: Pick, ceiling_s: float) -> float:
        """How long to wait for this call: `timeout_factor` x its expected seconds at the peer's
        measured rate, within [timeout_floor_s, ceiling_s]; the ceiling while the peer is not
        measured or has just timed out (its estimate is then not to be trusted)."""
        peer_id = pick.peer.peer_id
        speed = self._speed.get(peer_id)
        if speed is None or not speed.measured or self._strikes.get(peer_id, 0):
            return ceiling_s
        wanted = self.config.timeout_factor * self.expected_seconds(peer_id, pick.samples, pick.kind)
        return min(max(wanted, self.config.timeout_floor_s), ceiling_s)

    def completed(self, pick: Pick, elapsed_s: float, caught_up_s: Any = None) -> None:
        """A whole RPC took `elapsed_s` of wall time: that is the peer's measured speed (a probe's
        alone: the estimate of a slow peer is otherwise all from before it was withheld). A probe
        whose reply says the peer first caught up with its mates (`caught_up_s`: idle while
        withheld, it downloads their state only now and then, docs/stage-rpc.md) is not judged:
        the peer keeps its estimate and is probed again at once, now caught up, and judged on that
        reply whatever it says. Judged on the first, a peer that recovered would pay a download at
        every probe and stay withheld; with the wait taken off, a peer stopped most of the time
        (SIGSTOP) would be judged on its running part alone, the stops hidden in its wait."""
        peer_id = pick.peer.peer_id
        self._strikes.pop(peer_id, None)
        if pick.probe and not pick.recheck and isinstance(caught_up_s, (int, float)) \
                and not isinstance(caught_up_s, bool) and caught_up_s > 0 and peer_id in self._probe_at:
            self._probe_at[peer_id] = -math.inf
            return
        if pick.probe:
            self._speed.pop(peer_id, None)
            self._probed.add(peer_id)
        self._measure(pick, elapsed_s)

    def timed_out(self, pick: Pick, elapsed_s: float, now: float) -> None:
        """No ban: the elapsed time is a lower bound of the peer's true cost, fed to its EMA capped
        at `timeout_penalty` x the estimate; `bench_after` in a row bench it, for longer each time."""
        peer_id = pick.peer.peer_id
        if peer_id not in self._peers:
            return
        speed = self._speed.get(peer_id)
        if speed is not None and speed.measured:
            cap = self.config.timeout_penalty * self.expected_seconds(peer_id, pick.samples, pick.kind)
            elapsed_s = min(elapsed_s, cap)
        self._measure(pick, elapsed_s)
        strikes = self._strikes[peer_id] = self._strikes.get(peer_id, 0) + 1
        if strikes >= self.config.bench_after:
            length = self.config.bench_initial_s * 2 ** min(strikes - self.config.bench_after, 30)
            self._benched[peer_id] = now + min(length, self.config.bench_max_s)

    def busy(self, pick: Pick) -> None:
        """Its queue is full: charge it one more such request so the next picks go elsewhere."""
        peer_id = pick.peer.peer_id
        if peer_id in self._key:
            self._set_key(peer_id, self._key[peer_id] + self.expected_seconds(peer_id, pick.samples, pick.kind))

    def samples_per_s(self, peer_id: bytes) -> float:
        speed = self._speed.get(peer_id)
        return speed.samples_per_s if speed is not None else math.inf

    def key(self, peer_id: bytes) -> float:
        return self._key[peer_id]

    # ------------------------------------------------------------------ internals

    def _measure(self, pick: Pick, elapsed_s: float) -> None:
        peer_id = pick.peer.peer_id
        if peer_id not in self._peers or pick.samples <= 0:
            return
        speed = self._speed.setdefault(peer_id, Throughput(self.config.ema_alpha, self.config.slow_window))
        speed.update(max(elapsed_s, 0.0) / (pick.samples * self.config.weight(pick.kind)))

    def _seconds_per_sample(self, peer_id: bytes) -> float:
        speed = self._speed.get(peer_id)
        if speed is not None and speed.measured:
            return speed.seconds_per_sample
        measured = [s.seconds_per_sample for s in self._speed.values() if s.measured]
        return sum(measured) / len(measured) if measured else self.config.default_seconds_per_sample

    def _minimum(self) -> float:
        return min(self._key.values(), default=0.0)

    def _set_key(self, peer_id: bytes, key: float) -> None:
        self._key[peer_id] = key
        heapq.heappush(self._heap, (key, self._rng.random(), peer_id))
        if len(self._heap) > 4 * len(self._key) + 16:  # drop stale entries so the heap stays O(peers)
            self._heap = [(k, t, p) for k, t, p in self._heap if self._key.get(p) == k]
            heapq.heapify(self._heap)


class Wiring:
    """Every stage's heap, sharing one seeded RNG so a run's routing is reproducible."""

    def __init__(self, num_stages: int, config: WiringConfig = WiringConfig()) -> None:
        rng = random.Random(config.seed)
        self.config = config
        self.stages = [StageWiring(i, config, rng) for i in range(num_stages)]

    def __getitem__(self, stage: int) -> StageWiring:
        return self.stages[stage]
