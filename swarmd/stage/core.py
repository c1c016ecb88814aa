"""The stage core: every decision one served stage makes, as a pure state machine.

No sockets, no threads, no tensors and no clock of its own: the shell (`StageService` and
`StageSync`) feeds it what happened -- a compute call arrived or settled, a poll of the mates
answered, a leader invited us to a round, a round ended, a commit, a state replaced -- with the
time as an argument, and carries out what it answers (compute and add or not, refuse, lead a
round with these members, download from these mates, jump to the swarm's step). The simulator
(`swarmd.stage.simulation`) drives the very same object over a virtual clock and an in-memory
network, so the rules below are checked on thousands of schedules no real swarm would produce.

The invariants (docs/stage-rpc.md) hold by construction:

- I1 exactly once. A round's reducers sum only the members `plan_round` keeps: members whose
  microbatch ids are pairwise disjoint; a member whose sum overlaps a kept one is left out, and
  if the kept ones do not cover the step the round fails and the left-out members clear their
  sums (their ids become `missing` and are re-sent). A call is not accumulated when this peer or a
  mate of its lineage already holds the microbatch (`admit`), so overlaps are rare.
- I2 agreement. Every peer carries a digest of its state, chained on every commit from the
  round's id, shown with its progress. Rounds only gather members of one (step, digest); a peer
  whose digest is not the one most of its visible mates at its step hold downloads (`decide`).
- I3 progress. Claims are released when their compute settles without adding, whoever waited;
  a mate whose round parts did not arrive in time (a straggler, or one we cannot hear) is
  benched for a growing while, as member and as leader; a smaller leader that invited us
  recently is deferred to.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum, StrEnum

DIGEST_BYTES = 16


class Phase(StrEnum):
    """What a served stage does now (announced to mates and trainers as this string)."""

    JOINING = "joining"  # building or downloading state: compute calls are answered `busy`
    SERVING = "serving"
    DRAINING = "draining"  # a rebalancing move: no new work, mates leave it out of rounds
    STOPPING = "stopping"
    STOPPED = "stopped"


#: What `stage.info` shows as the state of a serving peer that is idle and behind a mate
#: (`StageCore.behind`): a view of the serving phase, not a phase of its own (it is announced and
#: polled as serving, and takes work), so trainers neither count its old step as its stage's nor
#: evaluate on it (swarmd/train/progress.py `voters`).
BEHIND = "behind"


class Admission(Enum):
    """What a compute call that may add a gradient does with it."""

    ACCUMULATE = "accumulate"  # new to the stage as far as this peer can see: compute and add
    REPEAT = "repeat"  # this peer holds or computes it already: answer, add nothing
    HELD_BY_MATE = "held_by_mate"  # a mate of this peer's lineage holds it (its last poll): same


@dataclass(frozen=True)
class MateView:
    """One mate's answer to a progress poll."""

    peer_id: bytes
    addr: str
    step: int
    state: str
    digest: bytes
    ids: frozenset[int]  # microbatches of `step` whose gradient it holds
    claimed: frozenset[int] = frozenset()  # microbatches it is computing for `step`
    rate: float = 0.0  # its measured all-reduce send rate, bytes/s (0: not measured yet)


@dataclass(frozen=True)
class Lead:
    """Start a round for `step` among `members` (sorted (peer id, addr), this peer first)."""

    step: int
    digest: bytes
    members: tuple[tuple[bytes, str], ...]


@dataclass(frozen=True)
class Download:
    """Replace this peer's state with a mate's (the first that serves it whole)."""

    sources: tuple[tuple[bytes, str], ...]
    reason: str


@dataclass(frozen=True)
class RoundPlan:
    """Which members' sums make a round's step (the same on every member: same inputs)."""

    kept: tuple[int, ...]  # member indices summed; their ids are pairwise disjoint
    left_out: tuple[int, ...]  # members whose ids overlap a kept member's: never summed
    covered: bool  # the kept ids are exactly the step's ids
    samples: int  # samples behind the kept sums

    @property
    def conflict(self) -> bool:
        """The step cannot commit from these sums: the left-out members must clear theirs."""
        return not self.covered and bool(self.left_out)


def plan_round(contributions: Sequence[tuple[frozenset[int], int]], step_ids: frozenset[int]) -> RoundPlan:
    """Keep members greedily, largest id set first (ties: member order), while their ids stay
    disjoint: a microbatch held by two members is summed from exactly one of them."""
    order = sorted(range(len(contributions)), key=lambda i: (-len(contributions[i][0]), i))
    taken: set[int] = set()
    kept, left_out, samples = [], [], 0
    for i in order:
        ids, n = contributions[i]
        if ids.isdisjoint(taken):
            kept.append(i)
            taken |= ids
            samples += n
        else:
            left_out.append(i)
    return RoundPlan(tuple(sorted(kept)), tuple(sorted(left_out)), taken == step_ids, samples)


def every_member(contributions: Sequence[tuple[frozenset[int], int]], step_ids: frozenset[int]) -> RoundPlan:
    """The plan of a robust aggregate (`centered_clip`): every member's sum enters the robust
    combination, which bounds each one's pull instead of adding it (a second copy of a microbatch
    only shifts the weights, and a member it leaves out as non-finite loses nothing another holds).
    I1 is the exact mean's promise; robust aggregation trades it for a bound on any one member."""
    union = frozenset().union(*(ids for ids, _ in contributions))
    return RoundPlan(tuple(range(len(contributions))), (), union == step_ids, sum(n for _, n in contributions))


def initial_digest(seed: int, stage: int) -> bytes:
    """The digest of the deterministic init: every fresh peer of the stage starts equal."""
    return _hash(b"init", seed.to_bytes(8, "big", signed=True), stage.to_bytes(4, "big"))


def next_digest(digest: bytes, step: int, round_id: bytes) -> bytes:
    """The digest after committing `step` in round `round_id`: equal digests mean equal histories
    (same start, same rounds), so mates that committed a step in different rounds differ."""
    return _hash(b"commit", digest, step.to_bytes(8, "big"), round_id)


def jump_digest(digest: bytes, target: int) -> bytes:
    return _hash(b"jump", digest, target.to_bytes(8, "big"))


def _hash(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for part in parts:
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.digest()


def agreed_digest(mine: bytes, others: Iterable[bytes]) -> bytes:
    """The digest a step's visible peers agree on: the one most of them hold (ties: the smallest
    digest, so every peer that sees the same set picks the same one)."""
    counts: dict[bytes, int] = {mine: 1}
    for d in others:
        counts[d] = counts.get(d, 0) + 1
    return min(counts, key=lambda d: (-counts[d], d))


@dataclass(frozen=True)
class CoreConfig:
    """The core's timing rules (a subset of StageLimits, so the simulator can build one)."""

    microbatches: int
    missing_grace_s: float = 10.0
    resume_after_s: float = 10.0
    # How long an invitation from a smaller leader keeps us from leading; also how long a mate of
    # the round just committed may still show the step before (its commit a moment behind ours)
    # before a round leaves it out.
    defer_s: float = 1.0
    bench_s: float = 1.0  # first bench of a failing leader or straggling member; doubles per failure
    bench_max_s: float = 60.0
    # The exact mean (I1): a mate's copy makes a call redundant. False with a robust aggregate,
    # where every copy is one more opinion (a hostile holder must not be the only one).
    exact: bool = True
    # An idle peer (no compute call for this many of its steps) catches up with its mates at most
    # every idle_catch_up_s instead of every step (StageLimits says why).
    idle_after_steps: int = 4
    idle_catch_up_s: float = 10.0
    # The job's steps (spec.steps; None: no end known). Mates there mean the job is done: an idle
    # peer then catches up at once, since no work will come and its state is what the job leaves
    # behind (its final checkpoint, an export).
    job_steps: int | None = None


@dataclass
class _Bench:
    failures: int = 0
    until: float = 0.0


@dataclass
class StageCore:
    """The decisions of one served stage on one peer (see the module docstring)."""

    peer_id: bytes
    address: str
    config: CoreConfig
    step: int = 0  # committed steps: the step this peer accumulates for
    digest: bytes = b""
    phase: Phase = Phase.STOPPED
    epoch: int = 0  # bumped whenever the state is replaced: older compute adds nothing
    delayed: bool = False  # pipeline.delayed_updates: step + 1 is accepted too
    missing: list[int] = field(default_factory=list)
    uncovered: list[int] = field(default_factory=list)
    round_id: bytes | None = None  # the round this peer runs now
    _claims: dict[int, set[int]] = field(default_factory=dict)
    _repeats: dict[int, int] = field(default_factory=dict)
    _mates: dict[bytes, MateView] = field(default_factory=dict)
    _slow: dict[bytes, float] = field(default_factory=dict)  # mates whose polls time out, since
    _seen: set[int] = field(default_factory=set)
    _seen_step: int = -1
    _bench: dict[bytes, _Bench] = field(default_factory=dict)  # mates whose round parts came late
    _defer_until: float = 0.0
    _behind_since: tuple[int, float] | None = None
    _polled_last: bytes = b""  # the round robin's place (`to_poll`)
    _last_round: tuple[float, frozenset[bytes]] = (float("-inf"), frozenset())  # (when, members) of our last commit
    _active_at: float = 0.0  # when a new microbatch of this step last reached this peer or its lineage
    _work_step: int = 0  # the latest step a compute call reached this peer for (or it joined at)
    _catch_up_at: float = float("-inf")  # when this peer last decided to download from a mate ahead

    # ------------------------------------------------------------------ compute calls

    def step_ids(self, step: int) -> frozenset[int]:
        return frozenset(range(step * self.config.microbatches, (step + 1) * self.config.microbatches))

    def admit(self, now: float, step: int, mb: int) -> Admission:
        """A call that may add `mb`'s gradient to `step` arrived (its step is accepted)."""
        claims = self._claims.setdefault(step, set())
        if mb in claims:
            self._repeats[step] = self._repeats.get(step, 0) + 1
            return Admission.REPEAT
        # Only what a mate *holds* counts: a claim may sit behind a long queue or a hung compute, and
        # an id it blocked here would stay uncovered for as long (exactness does not rest on this:
        # plan_round sums any id once; this only saves the wasted copy).
        # A benched mate's copy does not count either: no round of ours will include it.
        if self.config.exact and step == self.step and any(mb in m.ids for m in self._lineage(step, shielded=True)
                                     if not self._benched(m.peer_id, now)):
            self._repeats[step] = self._repeats.get(step, 0) + 1
            return Admission.HELD_BY_MATE
        claims.add(mb)
        if step == self.step:
            self._active_at = now
        return Admission.ACCUMULATE

    def settled(self, step: int, mb: int, epoch: int, added: bool) -> None:
        """An accumulating call's compute is over (answered, failed, refused or abandoned): a
        claim whose gradient was not added is released, whoever still waits for the answer."""
        if not added and epoch == self.epoch:
            claims = self._claims.get(step)
            if claims is not None:
                claims.discard(mb)

    def claimed(self, step: int) -> frozenset[int]:
        return frozenset(self._claims.get(step, ()))

    def repeats(self, step: int) -> int:
        return self._repeats.get(step, 0)

    def accepts(self, step: int) -> bool:
        return self.step <= step <= self.step + (1 if self.delayed else 0)

    # ------------------------------------------------------------------ mates

    def to_poll(self, announced: Sequence[bytes], count: int) -> list[bytes]:
        """The `count` mates to poll this tick, round robin over the announced ones: a peer's control
        traffic stays the same however many mates it has, and each view is refreshed every
        len(announced) / count ticks."""
        ordered = sorted(announced)
        if len(ordered) <= count:
            return ordered
        later = [p for p in ordered if p > self._polled_last]
        chosen = (later + ordered)[:count]
        self._polled_last = chosen[-1]
        return chosen

    def observe(self, now: float, views: Iterable[MateView], slow: Iterable[bytes], announced: Iterable[bytes],
                polled: Iterable[bytes] | None = None) -> None:
        """A poll of `polled` (default: every announced mate) ended: `views` answered, `slow` timed
        out, the rest of `polled` refused or failed (what they held is lost); mates not polled keep
        their last view, and mates no longer announced are forgotten."""
        announced = set(announced)
        polled = announced if polled is None else set(polled)
        slow = set(slow)
        answered = set()
        for view in views:
            self._mates[view.peer_id] = view
            self._slow.pop(view.peer_id, None)
            answered.add(view.peer_id)
        for peer in slow:
            self._slow.setdefault(peer, now)
        for peer in list(self._mates):
            if peer not in announced or (peer in polled and peer not in answered and peer not in slow):
                del self._mates[peer]
                self._slow.pop(peer, None)
        for peer, since in list(self._slow.items()):
            if peer not in announced:
                del self._slow[peer]
            elif now - since >= self.config.missing_grace_s:
                self._mates.pop(peer, None)  # silent past the grace: what it held counts as lost

    def mate_ahead(self) -> bool:
        return any(m.state == Phase.SERVING and m.step > self.step for m in self._mates.values())

    def mate_slow(self) -> bool:
        return bool(self._slow)

    def mate_addr(self, peer: bytes) -> str | None:
        """Where this peer polled `peer` (its announced address); None for a mate not in view."""
        view = self._mates.get(peer)
        return view.addr if view is not None else None

    def rate_of(self, peer: bytes) -> float:
        """A mate's last reported send rate (0.0: unknown)."""
        view = self._mates.get(peer)
        return view.rate if view is not None else 0.0

    def _lineage(self, step: int, shielded: bool = False) -> list[MateView]:
        """Serving mates at `step` with this peer's digest that answered the last poll (its
        possible round members); with `shielded`, also the ones whose polls time out, for
        `missing_grace_s` (an overloaded mate may still hold what it last reported)."""
        return [m for m in self._mates.values()
                if m.state == Phase.SERVING and m.step == step and m.digest == self.digest
                and (m.peer_id not in self._slow or shielded)]

    def decide(self, now: float, held: frozenset[int]) -> Lead | Download | None:
        """After a poll: catch up, agree, or lead a round (None: nothing to do now)."""
        if self.phase != Phase.SERVING or self.round_id is not None:
            return None
        serving = [m for m in self._mates.values() if m.state == Phase.SERVING]
        ahead = [m for m in serving if m.step > self.step]
        agreeing = any(m.step == self.step and m.digest == self.digest for m in serving)
        if len(ahead) >= 2 or (ahead and (not agreeing or now - self._active_at >= self.config.resume_after_s)):
            done = self.config.job_steps is not None and max(m.step for m in ahead) >= self.config.job_steps
            if self.idle() and now - self._catch_up_at < self.config.idle_catch_up_s and not done:
                return None  # idle: it catches up lazily (a call for a later step makes it: `wanted`)
            self._catch_up_at = now
            # Steps two mates claim first (highest first), then lone claims: a peer that makes up
            # a far step is not the first one downloaded from while others are ahead too.
            backed = {m.step for m in ahead if sum(o.step == m.step for o in ahead) >= 2}
            ahead.sort(key=lambda m: (m.step not in backed, -m.step, m.peer_id))
            return Download(tuple((m.peer_id, m.addr) for m in ahead), f"mates are at step {ahead[0].step}")
        # One mate alone ahead while another shares this peer's step and state: its claim is not
        # confirmed (a peer may make up any step and state) and is set aside while this step is
        # worked on here. It is believed with a second mate ahead, with none at this step to
        # contradict it, or once no new microbatch of this step has reached this peer or its
        # lineage for `resume_after_s` (the trainers went on: an honest mate did commit alone).
        same = [m for m in serving if m.step == self.step]
        agreed = agreed_digest(self.digest, (m.digest for m in same))
        if agreed != self.digest:
            holders = sorted((m for m in same if m.digest == agreed), key=lambda m: m.peer_id)
            return Download(tuple((m.peer_id, m.addr) for m in holders),
                            f"its mates at step {self.step} agree on another state")
        lineage = [m for m in self._lineage(self.step) if not self._benched(m.peer_id, now)]
        if not self._coverage(now, held, lineage):
            return None
        since, members = self._last_round
        if now - since < self.config.defer_s and any(m.step < self.step for m in serving if m.peer_id in members):
            return None  # a mate of the round just committed shows the step before: give its commit a moment
        # Only peers that hold some of the step's microbatches are members: one that holds
        # nothing adds nothing to the sum, and waiting for its parts would hold the round to its
        # pace (a slow mate the trainers route nothing to); it downloads the committed state. A
        # peer that holds nothing leads no round either.
        mine = [(self.peer_id, self.address)] if held else []
        members = tuple(sorted(mine + [(m.peer_id, m.addr) for m in lineage if m.ids]))
        if not members or members[0][0] != self.peer_id or now < self._defer_until:
            return None
        return Lead(self.step, self.digest, members)

    def _coverage(self, now: float, held: frozenset[int], lineage: list[MateView]) -> bool:
        """Update `missing` and `uncovered` (what trainers re-send); True when the round's
        members hold every microbatch of the step."""
        union = set(held)
        for m in lineage:
            union |= m.ids
        if self.step != self._seen_step:  # a new step here (a commit, a download): quiet from now on
            self._seen, self._seen_step, self._active_at = set(), self.step, now
        if not union <= self._seen:
            self._active_at = now
        self._seen |= union
        shielded: set[int] = set()
        for m in self._lineage(self.step, shielded=True):
            since = self._slow.get(m.peer_id)
            if since is not None and now - since < self.config.missing_grace_s:
                shielded |= m.ids | m.claimed  # an overloaded mate may still hold them
        step_ids = self.step_ids(self.step)
        self.missing = sorted(self._seen - union - shielded)
        self.uncovered = sorted(step_ids - union - shielded)
        return step_ids <= union

    # ------------------------------------------------------------------ idle peers

    def worked(self, step: int) -> None:
        """A compute call for `step` reached this peer, or it joined at `step`: it is not idle until
        `idle_after_steps` more of its steps pass without one (a newcomer gets its chance). A step
        past every one in view counts as the one after the furthest (a stranger's call may name
        any step: it must not keep this peer from ever going idle)."""
        furthest = max([self.step, *(m.step for m in self._mates.values())])
        self._work_step = max(self._work_step, min(step, furthest + 1))

    def idle(self) -> bool:
        """No compute call for `idle_after_steps` of this peer's steps: it holds nothing its mates
        need, so it catches up every `idle_catch_up_s` instead of every step (`decide`)."""
        return self.step - self._work_step >= self.config.idle_after_steps

    def behind(self) -> bool:
        """Idle and serving with a mate ahead: its parameters are older than its stage's (shown as
        `behind` to trainers, who then neither count its step nor evaluate on it)."""
        return self.phase == Phase.SERVING and self.idle() and self.mate_ahead()

    def wanted(self, now: float, step: int, held: frozenset[int]) -> Download | None:
        """A compute call for `step` arrived: work came back, so this peer is not idle. When it was,
        and `step` is past the steps it accepts while the views at hand put a mate ahead, the
        Download to make now, which the call waits for (a busy peer's catch-ups stay the sync
        loop's: it is at most a step behind, and the call waits for its commit or download)."""
        was_idle = self.idle()
        self.worked(step)
        if not was_idle or step < self.step or self.accepts(step):
            return None
        action = self.decide(now, held)
        return action if isinstance(action, Download) else None

    # ------------------------------------------------------------------ rounds

    def invited(self, now: float, leader: bytes, step: int, digest: bytes) -> str | None:
        """A leader asks us into its round: None to join, else why not (answered `busy`)."""
        if self.phase != Phase.SERVING:
            return f"this peer is {self.phase}"
        if self.round_id is not None:
            if leader < self.peer_id:
                self._defer_until = now + self.config.defer_s
            return "this peer is already in an all-reduce round"
        if step != self.step:
            return f"round for step {step}, this peer is at step {self.step}"
        if digest != self.digest:
            return (f"round for another state of step {step} (digest {digest.hex()[:8]}, "
                    f"this peer {self.digest.hex()[:8]})")
        if self._benched(leader, now):
            return "that leader's round parts did not reach this peer in time lately; it is benched here"
        if leader < self.peer_id:
            self._defer_until = now + self.config.defer_s
        return None

    def round_started(self, round_id: bytes) -> None:
        if self.round_id is not None:
            raise RuntimeError("a round is already running")
        self.round_id = round_id

    def round_failed(self, now: float, round_id: bytes, leader: bytes, late: Iterable[bytes] = ()) -> None:
        """A round ended without a commit here; `late` are members whose parts did not arrive in
        time (a straggler, or a mate we cannot hear: asymmetric links). They are benched: left out
        of the rounds this peer leads, their invitations refused, for a growing while; they catch
        up by download. An abort benches nobody (a refused invitation is not a fault)."""
        if self.round_id == round_id:
            self.round_id = None
        self.note_late(now, late)

    def note_late(self, now: float, late: Iterable[bytes]) -> None:
        """Mates whose round parts (or answers to an invitation) did not come in time."""
        for member in late:
            if member != self.peer_id:
                self._add_bench(member, now)

    def left_out(self, step: int, ids: Iterable[int]) -> None:
        """A conflicting round left this peer's sum out and it cleared it: the ids are free here."""
        claims = self._claims.get(step)
        if claims is not None:
            claims.difference_update(ids)

    def committed(self, now: float, step: int, round_id: bytes, leader: bytes, members: Iterable[bytes]) -> None:
        if step != self.step:
            raise RuntimeError(f"commit of step {step} at step {self.step}")
        self.step += 1
        self.digest = next_digest(self.digest, step, round_id)
        if self.round_id == round_id:
            self.round_id = None
        members = frozenset(members)
        for member in members:
            self._bench.pop(member, None)
        self._last_round = (now, members)
        self._active_at = now
        self._forget_through(step)

    def replaced(self, step: int, digest: bytes) -> None:
        """The state was replaced (download, checkpoint, init): nothing held so far counts."""
        self.step, self.digest = step, digest
        self.epoch += 1
        self._claims.clear()
        self._repeats.clear()
        self.missing, self.uncovered = [], []
        self._seen, self._seen_step = set(), -1

    def _forget_through(self, step: int) -> None:
        for table in (self._claims, self._repeats):
            for s in [s for s in table if s <= step]:
                del table[s]
        self.missing, self.uncovered = [], []

    def _add_bench(self, peer: bytes, now: float) -> None:
        bench = self._bench.setdefault(peer, _Bench())
        bench.failures += 1
        # The first failure is free (one lost message, one abort race); then a growing bench.
        if bench.failures > 1:
            span = min(self.config.bench_max_s, self.config.bench_s * 2 ** (bench.failures - 2))
            bench.until = now + span

    def suspect(self, peer: bytes) -> bool:
        """Was `peer` late in a round here since it last committed one with us? (Such a member owns
        no shard in the rounds this peer leads: allreduce.choose_owners.)"""
        bench = self._bench.get(peer)
        return bench is not None and bench.failures > 0

    def _benched(self, peer: bytes, now: float) -> bool:
        bench = self._bench.get(peer)
        return bench is not None and now < bench.until

    # ------------------------------------------------------------------ a stage that lost steps

    def behind_alone(self, now: float, looks_alone: bool) -> bool:
        """Another look at whether this peer may take up the swarm's step (see docs: "A stage that
        lost steps"): True once every look for `resume_after_s` found it alone and behind."""
        if not looks_alone or self.round_id is not None or self.phase != Phase.SERVING:
            self._behind_since = None
            return False
        if self._behind_since is None or self._behind_since[0] != self.step:
            self._behind_since = (self.step, now)
        if now - self._behind_since[1] < self.config.resume_after_s:
            return False
        self._behind_since = None
        return True

    def jumped(self, target: int) -> None:
        self.replaced(target, jump_digest(self.digest, target))
