"""A deterministic swarm of one stage around the stage core, for checking I1-I3 on many schedules.

Virtual time on an event heap, an in-memory network (latency, loss, one-way partitions that heal),
split directory views, compute slower than the trainers' timeout, deaths and rejoins, a member
whose round parts are slow for the whole run, a peer stopped (SIGSTOP) most of every short period,
a peer the trainers withhold work from but for a probe now and then (idle: it catches up lazily),
and trainers that time out, retry on another peer
and re-send what the stage reports missing or uncovered. Every peer runs the real `StageCore`, the
real `plan_round` and `choose_owners`, and the shell's round rules (sync.py: a phase deadline each
for the reduce-scatter and the all-gather, late members that own no shard left out, owners' plans
compared before a commit, a member that leaves at its deadline withdrawn); only the tensors are
replaced by the ids they hold, and a peer's state by its history: the (step, round, ids summed) of
every commit that made it. Equal histories are equal parameters.

Checked while it runs: every commit sums each microbatch of its step exactly once (I1); every
member that commits a round had the same history before it, and equal digests always mean equal
histories (I2). Checked at the end: once the faults stop, the trainers finish every step and all
live peers hold one history within `settle_s` (I3). A broken rule raises `Violation` naming the
seed, so a failing schedule replays exactly.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from swarmd.stage.allreduce import choose_owners
from swarmd.stage.core import (Admission, CoreConfig, Download, Lead, MateView, Phase, RoundPlan, StageCore,
                               initial_digest, plan_round)


class Violation(AssertionError):
    """An invariant broke in a simulated schedule."""


@dataclass(frozen=True)
class Schedule:
    """One drawn world: sizes, speeds and the faults (all of them end by `fault_end`)."""

    seed: int
    peers: int
    microbatches: int
    steps: int
    trainers: int
    compute_s: tuple[float, ...]  # per peer, per microbatch
    latency_s: float
    loss: float
    trainer_timeout_s: float
    late: tuple[tuple[float, float, int, float], ...]  # (from, to, peer, factor): compute that slow
    cuts: tuple[tuple[float, float, int, int], ...]  # (from, to, src, dst): src's messages to dst dropped
    hidden: tuple[tuple[float, float, int, int], ...]  # (from, to, viewer, peer): not in viewer's directory
    deaths: tuple[tuple[float, int, float], ...]  # (at, peer, back at)
    errors: float  # chance that a compute fails (out of memory, say) while faults last
    hedge: int  # peers each microbatch goes to at once (2: a trainer that hedges every call)
    fault_end: float
    slow_links: tuple[tuple[float, float, int, float], ...] = ()  # (from, to, peer, delay): its sends that late
    polled: int = 8  # mates polled per tick (StageLimits.polled_mates)
    sync_s: float = 0.2
    poll_timeout_s: float = 0.5
    round_timeout_s: float = 1.5
    download_s: float = 0.3
    # (peer, delay): one member whose round parts (the bulk of what it sends) are that late for the
    # whole run, past the faults too: a mate behind a slow uplink for good, whose small answers
    # still come in time. The stage must finish all the same, on one state.
    slow_member: tuple[int, float] | None = None
    # (peer, period, stopped): one peer stopped (SIGSTOP) for the first `stopped` fraction of every
    # `period` s for the whole run, running the rest (bench/chaos_goodput.py `slow_peer`): whatever
    # would happen at it meanwhile (its ticks, computes, messages reaching it) happens when it runs
    # again. Its mates lead rounds without it when it holds nothing, and it catches up by download.
    stalled: tuple[int, float, float] | None = None
    # (peer, probe_s): one peer the trainers send no work to (withheld for slowness, docs/trainer.md)
    # but one probe call each every probe_s s, unless no other peer is alive. It is idle: it catches
    # up with its mates every idle_catch_up_s, or at once for a probe of a later step.
    withheld: tuple[int, float] | None = None
    # The stage core's idle rule (StageLimits), at the simulator's time scale.
    idle_after_steps: int = 2
    idle_catch_up_s: float = 1.0


def random_schedule(seed: int) -> Schedule:
    rng = random.Random(seed)
    peers, fault_end = rng.randint(1, 5), rng.uniform(4.0, 12.0)
    timeout = rng.uniform(0.3, 0.8)

    def window() -> tuple[float, float]:
        start = rng.uniform(0.0, fault_end)
        return start, min(fault_end, start + rng.uniform(0.2, 4.0))

    late = tuple((*window(), rng.randrange(peers), rng.uniform(3.0, 15.0)) for _ in range(rng.randint(0, 2)))
    slow_links = tuple((*window(), rng.randrange(peers), rng.uniform(0.5, 3.0)) for _ in range(rng.randint(0, 1)))
    pairs = peers > 1
    cuts = tuple((*window(), *rng.sample(range(peers), 2)) for _ in range(rng.randint(0, 3) * pairs))
    hidden = []
    for _ in range(rng.randint(0, 3) * pairs):  # split views: one-sided, or both sides at once
        (a, b), (x, y) = window(), rng.sample(range(peers), 2)
        hidden += [(a, b, x, y), (a, b, y, x)] if rng.random() < 0.5 else [(a, b, x, y)]
    deaths = []
    for _ in range(rng.randint(0, 2)):
        at = rng.uniform(0.0, fault_end)
        deaths.append((at, rng.randrange(peers), min(fault_end, at + rng.uniform(0.1, 4.0))))
    schedule = Schedule(seed, peers, rng.randint(2, 6), rng.randint(3, 6), rng.randint(1, 2),
                        tuple(rng.uniform(0.01, 0.06) for _ in range(peers)), rng.uniform(0.001, 0.02),
                        rng.choice((0.0, 0.0, 0.01, 0.05)), timeout, late, cuts, tuple(hidden), tuple(deaths),
                        rng.choice((0.0, 0.0, 0.1)), rng.choice((1, 1, 2)), fault_end, slow_links,
                        rng.choice((1, 2, 8)))
    if peers > 1 and rng.random() < 0.25:  # drawn last: the schedules above stay what they were
        schedule = dataclasses.replace(schedule, slow_member=(rng.randrange(peers), rng.uniform(0.2, 4.0)))
    if peers > 1 and rng.random() < 0.2:  # drawn after the rest, likewise
        schedule = dataclasses.replace(schedule, stalled=(rng.randrange(peers), rng.uniform(0.1, 0.6),
                                                          rng.uniform(0.3, 0.8)))
    # Drawn after the rest, likewise; never beside a member slow for good, with which it can stall
    # the stage (idle rule or not): docs/stage-rpc.md, "Idle peers catch up lazily".
    if peers > 1 and rng.random() < 0.25 and schedule.slow_member is None:
        schedule = dataclasses.replace(schedule, withheld=(rng.randrange(peers), rng.uniform(0.3, 4.0)))
    return schedule


@dataclass
class _Round:
    round_id: bytes
    step: int
    members: list[int]  # peer indices, in member (peer id) order
    leader: int
    owners: set[int]  # the peers (of `members`) that own a shard
    contributions: dict[int, tuple[frozenset[int], int]] = field(default_factory=dict)
    gathers: dict[int, tuple[int, ...]] = field(default_factory=dict)  # owner -> the peers its plan kept
    withdrawn: set[int] = field(default_factory=set)  # non-owners that left
    plan: RoundPlan | None = None  # in peer indices
    late: list[int] = field(default_factory=list)  # left out for lateness


@dataclass
class _Peer:
    index: int
    core: StageCore
    life: int = 0  # bumped by every death: events of an earlier life are ignored
    alive: bool = True
    sums: dict[int, set[int]] = field(default_factory=dict)
    taken: dict[int, frozenset[int]] = field(default_factory=dict)
    history: tuple = ()
    round: _Round | None = None
    early: dict[bytes, list] = field(default_factory=dict)  # parts of rounds not joined yet
    closed: set[bytes] = field(default_factory=set)
    free_at: float = 0.0
    inviting: bool = False  # the shell awaits its invitations before it polls again
    downloads: int = 0  # states it downloaded from a mate (the idle rule's cost saved, per peer)


@dataclass
class _Trainer:
    shard: int
    step: int = 0
    todo: set[int] = field(default_factory=set)
    inflight: dict[int, int] = field(default_factory=dict)  # mb -> attempt
    done: set[int] = field(default_factory=set)
    uncovered_since: dict[int, float] = field(default_factory=dict)
    probe_at: float = 0.0  # when its next call may go to the withheld peer


class StageSimulation:
    def __init__(self, schedule: Schedule, settle_s: float = 60.0) -> None:
        self.s = schedule
        self.rng = random.Random(schedule.seed ^ 0x5EED)
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self._attempts = itertools.count()
        self.settle_s = settle_s
        self.peers = [_Peer(i, self._core(i)) for i in range(schedule.peers)]
        self.trainers = [_Trainer(k) for k in range(schedule.trainers)]
        self.commits = 0
        self.counts: dict[str, int] = {}  # what happened, by kind (the scenario tests read it)
        self._pre: dict[bytes, tuple] = {}  # round id -> the history its committers had
        self._digests: dict[bytes, tuple] = {}  # digest -> the history it names

    # ------------------------------------------------------------------ plumbing

    def _core(self, i: int) -> StageCore:
        core = StageCore(bytes([i + 1]) * 8, f"p{i}", CoreConfig(
            self.s.microbatches, missing_grace_s=1.0, resume_after_s=1.0, defer_s=0.3, bench_s=0.3, bench_max_s=4.0,
            idle_after_steps=self.s.idle_after_steps, idle_catch_up_s=self.s.idle_catch_up_s, job_steps=self.s.steps))
        core.replaced(0, initial_digest(0, 1))
        core.phase = Phase.SERVING
        return core

    def at(self, delay: float, fn: Callable, *args) -> None:
        heapq.heappush(self._heap, (self.now + delay, next(self._seq), fn, args))

    def _for(self, peer: _Peer, fn: Callable) -> Callable:
        """`fn` if the peer is still in the same life when the event fires (a stalled peer's, once
        it runs again)."""
        life = peer.life

        def fire(*a) -> None:
            if not (peer.alive and peer.life == life):
                return
            resume = self._resumes(peer.index)
            if resume > self.now:
                self.at(resume - self.now, fire, *a)
            else:
                fn(*a)

        return fire

    def _resumes(self, i: int) -> float:
        """When peer `i` runs again (now, unless it is the stalled peer in a stopped part)."""
        if self.s.stalled is None or self.s.stalled[0] != i:
            return self.now
        _, period, stopped = self.s.stalled
        start = self.now - self.now % period
        return start + stopped * period if self.now < start + stopped * period else self.now

    def _faulty(self) -> bool:
        return self.now < self.s.fault_end

    def _cut(self, src: int, dst: int) -> bool:
        return bool(self.s.cuts) and self._faulty() and any(
            a <= self.now < b and s == src and d == dst for a, b, s, d in self.s.cuts)

    def send(self, src: int | None, dst: int, fn: Callable, *args, extra: float = 0.0, bulk: bool = False) -> None:
        """A message from peer `src` (None: a trainer) to peer `dst`: lost, cut or delivered;
        `bulk`: a round part (a gradient's worth of bytes)."""
        if src is not None and self._cut(src, dst):
            return
        if self._faulty() and self.rng.random() < self.s.loss:
            return
        if src is not None:
            extra += self._uplink(src)
            if bulk and self.s.slow_member is not None and self.s.slow_member[0] == src:
                extra += self.s.slow_member[1]
        target = self.peers[dst]
        self.at(self.s.latency_s * (1 + self.rng.random()) + extra, self._for(target, fn), *args)

    def _uplink(self, src: int) -> float:
        """Extra delay of what peer `src` sends now (a slow uplink)."""
        if not self.s.slow_links or not self._faulty():
            return 0.0
        return max((d for a, b, p, d in self.s.slow_links if p == src and a <= self.now < b), default=0.0)

    def visible(self, viewer: int) -> list[int]:
        """The peers `viewer`'s directory lists (alive ones, less any hidden from it now)."""
        return [p.index for p in self.peers if p.alive and p.index != viewer and not (
            self._faulty() and any(a <= self.now < b and (v, h) == (viewer, p.index) for a, b, v, h in self.s.hidden))]

    # ------------------------------------------------------------------ running

    def run(self) -> None:
        for t in self.trainers:
            self._start_step(t, 0)
            self.at(0.05, self._trainer_poll, t)
        for p in self.peers:
            self.at(self.s.sync_s * self.rng.random(), self._for(p, self._tick), p)
        for at, i, back in self.s.deaths:
            self.at(at, self._die, i, back)
        end = self.s.fault_end + self.settle_s
        while self._heap:
            t, _, fn, args = heapq.heappop(self._heap)
            if t > end:
                break
            self.now = t
            fn(*args)
            if self.now > self.s.fault_end and self._finished():
                return
        raise Violation(f"seed {self.s.seed}: not finished {self.settle_s}s after the faults ended (I3): "
                        f"trainers at {[t.step for t in self.trainers]}, peers at "
                        f"{[(p.core.step, p.core.phase.value, p.alive) for p in self.peers]}")

    def _finished(self) -> bool:
        live = [p for p in self.peers if p.alive]
        return (all(t.step >= self.s.steps for t in self.trainers)
                and all(p.core.step >= self.s.steps and p.core.phase == Phase.SERVING for p in live)
                and len({p.history for p in live}) == 1)

    def _die(self, i: int, back: float) -> None:
        peer = self.peers[i]
        if not peer.alive or sum(p.alive for p in self.peers) <= 1:
            return  # I3's premise: every stage keeps one responsive peer
        peer.alive = False
        peer.life += 1
        self.at(back - self.now, self._rejoin, peer)

    def _rejoin(self, peer: _Peer) -> None:
        """A restarted peer: its checkpoint is its old history (digest of the bytes, not the chain)."""
        peer.alive, peer.core = True, self._core(peer.index)
        peer.sums, peer.taken, peer.round, peer.early, peer.closed = {}, {}, None, {}, set()
        peer.inviting, peer.free_at = False, self.now
        peer.core.replaced(len(peer.history), _checkpoint_digest(peer.history))
        peer.core.worked(peer.core.step)  # as StageService._join: a newcomer is not idle at once
        self._note_digest(peer)
        self.at(self.s.sync_s, self._for(peer, self._tick), peer)

    # ------------------------------------------------------------------ trainers

    def _mine(self, t: _Trainer, step: int) -> set[int]:
        ids = self.peers[0].core.step_ids(step)
        return {mb for mb in ids if mb % len(self.trainers) == t.shard}

    def _start_step(self, t: _Trainer, step: int) -> None:
        t.step, t.todo, t.inflight, t.done, t.uncovered_since = step, set(), {}, set(), {}
        if step < self.s.steps:
            t.todo = self._mine(t, step)
            self._dispatch(t)

    def _dispatch(self, t: _Trainer) -> None:
        for mb in sorted(t.todo):
            t.todo.discard(mb)
            attempt = next(self._attempts)
            t.inflight[mb] = attempt
            for target in self._targets(t):
                if not self.peers[target].alive:
                    self.at(self.s.latency_s, self._reply, t, t.step, mb, attempt, "refused")
                else:
                    self.send(None, target, self._call, target, t, t.step, mb, attempt)
            self.at(self.s.trainer_timeout_s, self._timed_out, t, t.step, mb, attempt)

    def _targets(self, t: _Trainer) -> list[int]:
        """Where one microbatch goes: `hedge` peers at random, never the withheld peer but for its
        probe (then alone) or when no other peer is alive (the wiring's takeover of a lone peer)."""
        choices = list(range(len(self.peers)))
        if self.s.withheld is not None:
            withheld, every = self.s.withheld
            if self.now >= t.probe_at:
                t.probe_at = self.now + every
                self._count("probe")
                return [withheld]
            if any(p.alive for p in self.peers if p.index != withheld):
                choices.remove(withheld)
        return self.rng.sample(choices, min(self.s.hedge, len(choices)))

    def _timed_out(self, t: _Trainer, step: int, mb: int, attempt: int) -> None:
        if t.step == step and t.inflight.get(mb) == attempt:
            del t.inflight[mb]
            t.todo.add(mb)
            self._dispatch(t)

    def _reply(self, t: _Trainer, step: int, mb: int, attempt: int, answer: str) -> None:
        if t.step != step or t.inflight.get(mb) != attempt:
            return  # a late reply: its caller moved on (its gradient may be held: the stage copes)
        del t.inflight[mb]
        if answer == "stale":
            self._start_step(t, step + 1)  # the stage committed the step
        elif answer in ("added", "held"):
            t.done.add(mb)
        else:  # refused, busy, not_ready: try again shortly
            t.todo.add(mb)
            self.at(0.05, self._redispatch, t, step)

    def _redispatch(self, t: _Trainer, step: int) -> None:
        if t.step == step:
            self._dispatch(t)

    def _trainer_poll(self, t: _Trainer) -> None:
        if t.step < self.s.steps:
            target = self.rng.randrange(len(self.peers))
            if self.peers[target].alive:
                self.send(None, target, self._info, target, t, t.step)
        self.at(0.2, self._trainer_poll, t)

    def _info(self, i: int, t: _Trainer, step: int) -> None:
        core = self.peers[i].core
        answer = (core.step, list(core.missing), list(core.uncovered))
        self.at(self.s.latency_s, self._heard, t, step, *answer)

    def _heard(self, t: _Trainer, step: int, stage_step: int, missing: list[int], uncovered: list[int]) -> None:
        if t.step != step:
            return
        if stage_step > step:
            self._start_step(t, stage_step)
            return
        if stage_step < step:
            return
        mine = self._mine(t, step)
        lost = set(missing) & mine
        for mb in set(uncovered) & mine:
            since = t.uncovered_since.setdefault(mb, self.now)
            if self.now - since >= 1.0:
                lost.add(mb)
        for mb in list(t.uncovered_since):
            if mb not in uncovered:
                del t.uncovered_since[mb]
        for mb in lost - set(t.inflight):
            t.done.discard(mb)
            t.todo.add(mb)
            t.uncovered_since.pop(mb, None)
        self._dispatch(t)

    # ------------------------------------------------------------------ compute calls

    def _call(self, i: int, t: _Trainer, step: int, mb: int, attempt: int, parked: bool = False) -> None:
        peer = self.peers[i]
        core = peer.core

        def answer(what: str) -> None:
            self.at(self.s.latency_s + self._uplink(i), self._reply, t, step, mb, attempt, what)

        if core.phase != Phase.SERVING:
            return answer("busy")
        if step < core.step:
            return answer("stale")
        download = core.wanted(self.now, step, self._held(peer, core.step))
        if download is not None:  # an idle peer behind the call's step catches up now
            self._count("download: called")
            self._download(peer, [self._index(pid) for pid, _ in download.sources])
        if not core.accepts(step):
            if parked or core.phase != Phase.JOINING:
                return answer("not_ready")
            # It waits for the download it started (StageService._gate parks it), then is looked at again.
            self.at(self.s.download_s + self.s.latency_s, self._for(peer, self._call), i, t, step, mb, attempt, True)
            return
        if peer.free_at - self.now > 4 * self.s.compute_s[i] + self.s.trainer_timeout_s:
            return answer("busy")  # the executor's bounded queue (queue_size)
        admission = core.admit(self.now, step, mb)
        self._count(f"admit: {admission.value}")
        epoch = core.epoch
        start = max(self.now, peer.free_at)
        peer.free_at = start + self._compute_s(i)
        self.at(peer.free_at - self.now, self._for(peer, self._computed), peer, step, mb, admission, epoch, answer)

    def _compute_s(self, i: int) -> float:
        slow = [f for a, b, p, f in self.s.late if p == i and a <= self.now < b]
        return self.s.compute_s[i] * (max(slow) * self.s.trainer_timeout_s / self.s.compute_s[i] if slow else 1.0)

    def _computed(self, peer: _Peer, step: int, mb: int, admission: Admission, epoch: int, answer) -> None:
        core = peer.core
        if step < core.step:
            core.settled(step, mb, epoch, False)
            return answer("stale")
        if self._faulty() and self.rng.random() < self.s.errors:
            core.settled(step, mb, epoch, False)  # its caller may be long gone: the claim goes anyway
            self._count("compute failed")
            return answer("error")
        added = admission == Admission.ACCUMULATE and epoch == core.epoch
        if added:
            peer.sums.setdefault(step, set()).add(mb)
        core.settled(step, mb, epoch, added)
        answer("added" if added else "held")

    # ------------------------------------------------------------------ mates

    def _held(self, peer: _Peer, step: int) -> frozenset[int]:
        return frozenset(peer.sums.get(step, set()) | peer.taken.get(step, frozenset()))

    def _view(self, peer: _Peer) -> MateView:
        core = peer.core
        held = self._held(peer, core.step)
        return MateView(core.peer_id, core.address, core.step, core.phase.value, core.digest, held,
                        core.claimed(core.step) - held)

    def _tick(self, peer: _Peer) -> None:
        """One poll of the mates (answers read at once, as of one latency later) and the decision."""
        mates = self.visible(peer.index)
        ids = {self.peers[j].core.peer_id: j for j in mates}
        polled = [ids[p] for p in peer.core.to_poll(list(ids), self.s.polled)]
        views, slow = [], []
        for j in polled:
            if self._cut(peer.index, j) or self._cut(j, peer.index) or self._uplink(j) > self.s.poll_timeout_s or (
                    self._faulty() and self.rng.random() < 2 * self.s.loss):
                slow.append(self.peers[j].core.peer_id)
            else:
                views.append(self._view(self.peers[j]))
        self.at(self.s.sync_s, self._for(peer, self._tick), peer)
        core = peer.core
        core.observe(self.now, views, slow, list(ids), [self.peers[j].core.peer_id for j in polled])
        if core.behind():
            self._count("tick behind")
        if peer.inviting:
            return
        action = core.decide(self.now, self._held(peer, core.step))
        if isinstance(action, Download):
            self._count("download: " + ("agreement" if "agree" in action.reason else "behind"))
            self._download(peer, [self._index(pid) for pid, _ in action.sources])
        elif isinstance(action, Lead):
            self._lead(peer, action)

    def _count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def _index(self, peer_id: bytes) -> int:
        return peer_id[0] - 1

    def _download(self, peer: _Peer, sources: list[int]) -> None:
        peer.core.phase = Phase.JOINING
        if not sources:
            peer.core.phase = Phase.SERVING
            return
        src = self.peers[sources[0]]
        ok = src.alive and src.core.phase == Phase.SERVING and not self._cut(src.index, peer.index) \
            and not self._cut(peer.index, src.index)
        if not ok:
            self.at(self.s.poll_timeout_s, self._for(peer, self._download), peer, sources[1:])
            return
        state = (src.history, src.core.step, src.core.digest)
        self.at(self.s.download_s, self._for(peer, self._downloaded), peer, state)

    def _downloaded(self, peer: _Peer, state: tuple) -> None:
        history, step, digest = state
        peer.history, peer.sums, peer.taken = history, {}, {}
        peer.downloads += 1
        peer.core.replaced(step, digest)
        peer.core.phase = Phase.SERVING
        self._note_digest(peer)

    def _note_digest(self, peer: _Peer) -> None:
        known = self._digests.setdefault(peer.core.digest, peer.history)
        if known != peer.history:
            raise Violation(f"seed {self.s.seed}: one digest names two histories (I2)")

    # ------------------------------------------------------------------ rounds

    def _lead(self, peer: _Peer, lead: Lead) -> None:
        round_id = self.rng.getrandbits(128).to_bytes(16, "big")
        members = [self._index(pid) for pid, _ in lead.members]
        # Rates are not modelled (every member unmeasured): a member late here lately owns no shard.
        flags = choose_owners([0.0] * len(members), [peer.core.suspect(pid) for pid, _ in lead.members], 0.25)
        owners = {j for j, owns in zip(members, flags) if owns}
        invite = {"answers": {}, "lead": lead, "members": members, "owners": owners, "done": False}
        peer.inviting = True
        for j in members:
            if j != peer.index:
                self.send(peer.index, j, self._invited, j, peer.index, round_id, lead.step, lead.digest, members,
                          owners, invite)
        self.at(self.s.poll_timeout_s, self._for(peer, self._invites_due), peer, round_id, invite)

    def _invited(self, j: int, leader: int, round_id: bytes, step: int, digest: bytes, members: list[int],
                 owners: set[int], invite: dict) -> None:
        peer = self.peers[j]
        reason = "closed" if round_id in peer.closed else peer.core.invited(
            self.now, self.peers[leader].core.peer_id, step, digest)
        if reason is None:
            self._start_round(peer, round_id, step, members, leader, owners)
        self.send(j, leader, self._invite_answer, leader, round_id, j, reason is None, invite)

    def _invite_answer(self, leader: int, round_id: bytes, j: int, accepted: bool, invite: dict) -> None:
        invite["answers"][j] = accepted
        if len(invite["answers"]) == len(invite["members"]) - 1:
            self._invites_due(self.peers[leader], round_id, invite)

    def _invites_due(self, peer: _Peer, round_id: bytes, invite: dict) -> None:
        if invite["done"]:
            return
        invite["done"], peer.inviting = True, False
        lead, members = invite["lead"], invite["members"]
        others = [j for j in members if j != peer.index]
        joined = all(invite["answers"].get(j) for j in others)
        silent = [self.peers[j].core.peer_id for j in others if j not in invite["answers"]]
        if silent:  # their answers did not come in time: late, like parts that do not
            peer.core.round_failed(self.now, round_id, peer.core.peer_id, silent)
        if joined and peer.core.invited(self.now, peer.core.peer_id, lead.step, lead.digest) is None \
                and round_id not in peer.closed:
            self._start_round(peer, round_id, lead.step, members, peer.index, invite["owners"])
        else:
            peer.closed.add(round_id)
            for j in others:
                self.send(peer.index, j, self._aborted, j, round_id, peer.index, False, False, ())

    def _start_round(self, peer: _Peer, round_id: bytes, step: int, members: list[int], leader: int,
                     owners: set[int]) -> None:
        peer.core.round_started(round_id)
        take = frozenset(peer.sums.pop(step, set()))
        peer.taken[step] = take
        peer.round = _Round(round_id, step, members, leader, owners)
        peer.round.contributions[peer.index] = (take, len(take))
        for j in members:
            if j != peer.index:
                self.send(peer.index, j, self._part, j, round_id, "reduce", peer.index, (take, len(take)), bulk=True)
        self.at(self.s.round_timeout_s, self._for(peer, self._round_due), peer, round_id, "reduce")
        for kind, src, payload in peer.early.pop(round_id, (0.0, []))[1]:
            self._apply_part(peer, kind, src, payload)
            if peer.round is None:
                break
        if peer.round is not None:
            self._progress_round(peer)

    def _part(self, j: int, round_id: bytes, kind: str, src: int, payload) -> None:
        peer = self.peers[j]
        if round_id in peer.closed:
            return
        if peer.round is None or peer.round.round_id != round_id:
            self._buffer(peer, round_id, (kind, src, payload))
            return
        self._apply_part(peer, kind, src, payload)
        if peer.round is not None:
            self._progress_round(peer)

    def _buffer(self, peer: _Peer, round_id: bytes, part: tuple) -> None:
        """A part of a round this peer has not joined (yet): kept like allreduce.Mailbox keeps it,
        in at most two boxes, a box nobody joined within two poll timeouts making room."""
        if round_id not in peer.early:
            for old in [r for r, (t, _) in peer.early.items() if self.now - t > 2 * self.s.poll_timeout_s]:
                del peer.early[old]
            if len(peer.early) >= 2:
                return
            peer.early[round_id] = (self.now, [])
        peer.early[round_id][1].append(part)

    def _apply_part(self, peer: _Peer, kind: str, src: int, payload) -> None:
        if kind == "reduce":
            peer.round.contributions[src] = payload
        else:
            peer.round.gathers[src] = payload

    def _prompt(self, r: _Round) -> list[int]:
        return [j for j in r.members if j in r.contributions and j not in r.withdrawn]

    def _progress_round(self, peer: _Peer) -> None:
        r = peer.round
        if r.plan is None and len(self._prompt(r)) + len(r.withdrawn) == len(r.members):
            self._make_plan(peer)
            if peer.round is None:
                return
        if r.plan is not None and all(j in r.gathers for j in r.owners):
            plans = {r.gathers[j] for j in r.owners}
            if plans == {r.plan.kept}:
                self._commit(peer)
            elif len(plans) == 1 and peer.index not in next(iter(plans)):
                self._fail(peer, broadcast=False)  # left out by every owner alike: it only leaves
            else:
                self._fail(peer)

    def _make_plan(self, peer: _Peer) -> None:
        """The reduce-scatter is over (every part here, or its deadline passed): plan over the
        prompt members' sums, as sync._round does."""
        r = peer.round
        prompt = self._prompt(r)
        r.late = [j for j in r.members if j not in prompt and j not in r.withdrawn]
        if any(j in r.owners for j in r.late + sorted(r.withdrawn)):
            self._fail(peer, late=r.late)
            return
        plan = plan_round([r.contributions[j] for j in prompt], peer.core.step_ids(r.step))
        r.plan = RoundPlan(tuple(prompt[k] for k in plan.kept), tuple(prompt[k] for k in plan.left_out),
                           plan.covered, plan.samples)
        if not r.plan.covered:
            # The abort names the members the plan left out: one that has not seen every sum yet
            # (a slow member's part still on its way) clears its own all the same.
            self._fail(peer, left_out=peer.index in r.plan.left_out, late=r.late, cleared=r.plan.left_out)
            return
        if peer.index in r.owners:
            r.gathers[peer.index] = r.plan.kept
            for j in r.members:
                if j != peer.index:
                    self.send(peer.index, j, self._part, j, r.round_id, "gather", peer.index, r.plan.kept, bulk=True)
        self.at(self.s.round_timeout_s, self._for(peer, self._round_due), peer, r.round_id, "gather")

    def _round_due(self, peer: _Peer, round_id: bytes, phase: str) -> None:
        r = peer.round
        if r is None or r.round_id != round_id:
            return
        if phase == "reduce" and r.plan is None:
            self._make_plan(peer)
            if peer.round is not None:
                self._progress_round(peer)
        elif phase == "gather":
            self._fail(peer, late=[j for j in r.owners if j not in r.gathers], leaving=True)

    def _aborted(self, j: int, round_id: bytes, src: int, leaving: bool, timed_out: bool,
                 cleared: tuple[int, ...]) -> None:
        peer = self.peers[j]
        r = peer.round
        if r is not None and r.round_id == round_id and leaving and src not in r.owners \
                and (r.plan is None or src not in r.plan.kept):
            r.withdrawn.add(src)  # RoundBox.withdraw: a member that owns no shard only leaves
            self._progress_round(peer)
            return
        peer.closed.add(round_id)
        peer.early.pop(round_id, None)
        if r is not None and r.round_id == round_id:
            # A member whose deadline passed left: what is still missing here is late here too.
            late = [m for m in r.members if m not in (src, peer.index)
                    and (m not in r.contributions if r.plan is None else m in r.owners and m not in r.gathers)]
            self._fail(peer, left_out=j in cleared, late=late if timed_out else (), broadcast=False)

    def _fail(self, peer: _Peer, left_out: bool = False, late: list[int] = (), broadcast: bool = True,
              leaving: bool = False, cleared: tuple[int, ...] = ()) -> None:
        """The round ends here without a commit; `leaving`: at a deadline (a member that owns no
        shard then only leaves: its mates may still commit without it; a plan that cannot commit
        fails everywhere instead, so every member reaches the same verdict on the same sums)."""
        r, peer.round = peer.round, None
        peer.closed.add(r.round_id)
        taken = peer.taken.pop(r.step, frozenset())
        self._count("round failed: " + ("left out" if left_out else "late" if late else "aborted"))
        if left_out:
            peer.core.left_out(r.step, taken)
        else:
            peer.sums.setdefault(r.step, set()).update(taken)
        pid = [self.peers[j].core.peer_id for j in late]
        peer.core.round_failed(self.now, r.round_id, self.peers[r.leader].core.peer_id, pid)
        if broadcast:
            for j in r.members:
                if j != peer.index:
                    self.send(peer.index, j, self._aborted, j, r.round_id, peer.index, leaving, bool(late), cleared)

    def _commit(self, peer: _Peer) -> None:
        r, peer.round = peer.round, None
        peer.closed.add(r.round_id)
        kept = [r.contributions[j][0] for j in r.plan.kept]
        union = frozenset().union(*kept)
        if sum(len(ids) for ids in kept) != len(union) or union != peer.core.step_ids(r.step):
            raise Violation(f"seed {self.s.seed}: step {r.step} summed {sorted(i for ids in kept for i in ids)} (I1)")
        pre = self._pre.setdefault(r.round_id, peer.history)
        if pre != peer.history:
            raise Violation(f"seed {self.s.seed}: members of round {r.round_id.hex()[:8]} started from "
                            f"different states (I2)")
        peer.history = peer.history + ((r.step, r.round_id, union),)
        if r.plan.left_out:
            self._count("commit with sums left out")
        if r.late:
            self._count("commit without late members")
        prompt = self._prompt(r)
        if self._faulty():
            self._count(f"commit by {len(prompt)} of {len(self.peers)} while faults last")
        peer.taken.pop(r.step, None)
        for s in [s for s in peer.sums if s <= r.step]:
            del peer.sums[s]
        peer.core.committed(self.now, r.step, r.round_id, self.peers[r.leader].core.peer_id,
                            [self.peers[j].core.peer_id for j in prompt])
        peer.core.note_late(self.now, [self.peers[j].core.peer_id for j in r.late])
        self._note_digest(peer)
        self.commits += 1


def _checkpoint_digest(history: tuple) -> bytes:
    """What a restored checkpoint's content digest stands for here: a function of the state alone."""
    import hashlib

    return hashlib.blake2b(repr(history).encode(), digest_size=16).digest()


def check_schedules(seeds: range, settle_s: float = 60.0) -> int:
    """Run every seed's schedule; returns the commits made (raises Violation on the first break)."""
    commits = 0
    for seed in seeds:
        sim = StageSimulation(random_schedule(seed), settle_s)
        sim.run()
        commits += sim.commits
    return commits
