"""The trainer: drives every step's microbatches through a swarm of stage peers until each stage commits.

SWARM's trainer is the hub of every microbatch (trainer → stage peer → trainer, no server-to-server
link). Per microbatch of step s: forward through stages 0..n-2, `forward_backward` on the last (the
targets never leave the trainer except to it), then backward from n-2 down to 0, each hop to a
peer picked afresh by the stochastic wiring. Several microbatches are in flight at once. Every
call is retried elsewhere until it succeeds or the trainer is cancelled; each has a timeout
derived from the peer's measured rate, and when a stage has no usable peer the trainer waits with
a status saying so and re-reads the directory with backoff: nothing waits unboundedly and silently.

What it keeps its promises with (docs/trainer.md, "Invariants"):
- No trainer dies of a late reply. A call that timed out may still have completed and let the
  stage commit; a retry then gets `stale_step`. The stage has the microbatch; the stages below it
  still need its input gradient, which only the committed stage's old parameters could give: the
  trainer covers them with a zero gradient (the id is summed once, its contribution below that
  stage is lost, counted in `answers_lost`) and moves on. A stage that replays a committed step's
  answer (docs/stage-rpc.md) makes this path exact without any change here.
- No fixed shards. Trainer k of K starts with its share (m ≡ k mod K); once done, it takes over
  microbatches the stages still show undone after a bound (`assignment.py`), so a dead trainer's
  work is done by the others.
- Memory bounded by the work in flight: a finished microbatch's tensors, needed only for a re-send,
  go to disk (`held.py`).
- A step's commit is watched by long-polling every stage at once (`stage.info` with `until_step`:
  a peer answers when it commits, or after `commit_wait_s`), each peer with a bounded timeout and
  the stragglers a shorter one once a peer's wait ended; a peer that did not answer in time is not
  asked for a while: one hung peer costs one straggler wait now and then, not a timeout per poll.
- No one peer's word decides for a stage (docs/security.md, "Progress lies"): a stage's step is the
  lower median of its peers' claims, preferring peers that served this trainer (`progress.py`);
  `stale_step` is believed once the stage's step confirms it; `bad_input` blames the input only
  when a peer that served this trainer, or every peer of the stage, refuses it, and a peer that
  refused an input a stage-mate then accepted is banned.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from swarmd.directory import StageDirectory, StagePeer
from swarmd.errors import SwarmdError
from swarmd.job.data import Microbatch, TrainingData
from swarmd.job.spec import JobSpec
import swarmd.train.progress as progress
from swarmd.train.assignment import Assignment, TakeoverPolicy
from swarmd.train.errors import InputRefused, TrainerError
from swarmd.train.evaluation import Evaluation, EvaluationConfig
from swarmd.train.events import EventSink, StatusEvent, StepEvent
from swarmd.train.held import HeldTensors, StageTensors
from swarmd.train.replies import (
    StageShapes,
    check_backward,
    check_forward,
    check_forward_backward,
    disagreement,
    stage_shapes,
)
from swarmd.train.wiring import Kind, Pick, Wiring, WiringConfig
from transport.errors import (ConnectionLost, DeadlineExceeded, LocalProtocolError, ProtocolError, RemoteError,
                              RpcError, TransportError)
from transport.rpc import CODE_DEADLINE, CODE_OVERLOADED, Message, Pool, parse_address

log = logging.getLogger(__name__)

# RpcError codes of the stage contract (docs/stage-rpc.md).
BUSY = "busy"
BAD_INPUT = "bad_input"
NOT_READY = "not_ready"
STALE_STEP = "stale_step"
# Polls of a committed stage whose peers have not yet shown the step's record before going on without it.
RECORD_POLLS = 5


@dataclass(frozen=True)
class TrainerConfig:
    # Per-call timeout ceilings (the paper's code's fixed values): a forward is ~1/3 of a backward's
    # work. The timeout actually used is derived from the peer's measured rate (WiringConfig:
    # timeout_factor, timeout_floor_s) and is the ceiling only for a peer not measured yet or one
    # that just timed out. forward_backward uses the backward ceiling.
    forward_timeout_s: float = 30.0
    backward_timeout_s: float = 75.0
    # A directory read that takes longer is given up (the previous peer list is kept).
    info_timeout_s: float = 10.0
    # stage.info calls (a commit watch, a joining trainer): every peer of every stage is asked at once,
    # each for at most this long (answered from memory, so a peer slower than this is hung or overloaded).
    stage_info_timeout_s: float = 2.0
    # Once one peer of a stage answered stage.info, the others get at most this much longer (the
    # spread of round trips to a stage's peers, not a compute time), then they count as not answering.
    stage_info_straggler_s: float = 0.5
    # A peer that did not answer stage.info in time is not asked again for this long, doubling with
    # each further miss up to the max; one answer clears it (a hung peer must not cost every poll).
    stage_info_skip_s: float = 5.0
    stage_info_skip_max_s: float = 60.0
    # Directory re-read period (the paper's code: 30 s; shorter finds replacements sooner).
    refresh_s: float = 5.0
    # Pause when every usable peer of a stage failed one call, or when a stage has no peers at all:
    # starts here, doubles per round, capped at wait_max_s.
    wait_initial_s: float = 0.05
    wait_max_s: float = 5.0
    # How long one stage.info of a commit watch may wait at a peer for the step's commit (a
    # long-poll, docs/stage-rpc.md): the peer answers as soon as it commits, so the watch hears of
    # a commit one reply leg after it, whatever the round trip. Not longer: while a step does not
    # commit, the watch's other work (re-sending what a stage lost, taking over undone
    # microbatches, the status line) runs on these answers, and 1 s keeps it at the pace of the
    # old poll's 1 s cap, well inside resend_grace_s and uncovered_grace_s. 0: plain polls.
    commit_wait_s: float = 1.0
    # Commit-watch rounds that come back at once (a peer with no watch slot free or that does not
    # wait, a committed stage whose step record has not landed yet) start at least this long apart,
    # the spacing doubling while they keep coming back at once, capped.
    commit_poll_s: float = 0.02
    commit_poll_max_s: float = 1.0
    # A missing microbatch re-sent less than this long ago is not re-sent again: the stage's report
    # may predate the re-send, and every extra copy on another peer is a duplicate gradient.
    resend_grace_s: float = 2.0
    # An id of this trainer that every peer of a stage reports `uncovered` (held by no live peer)
    # for this long is re-sent: longer than a stage-mate progress poll, so a backward that has just
    # completed is not taken for a lost one (a re-send to another peer would be a duplicate).
    uncovered_grace_s: float = 3.0
    # A stage that has not committed a step this long after this trainer's part was done gets a
    # status line (the wait goes on).
    commit_status_after_s: float = 10.0
    # Distinct peers that may refuse one input as bad_input before the input is blamed.
    max_bad_input: int = 3
    # Fraction of forwards recomputed on a second peer of the stage and compared (0: none; seeded
    # from wiring.seed). A mismatch asks a third peer, and the one the other two outvote is banned.
    verify_fraction: float = 0.0
    # Two forward answers disagree when ||a - b|| > verify_rtol * max(||a||, ||b||). Stage-mates
    # hold bit-identical parameters, so honest answers differ only by batching order (~1e-6) and
    # the activation codec (fp16 ~2e-4, int8 ~6e-3 relative): keep it above the codec's error.
    verify_rtol: float = 0.05
    # Ban records kept for `banned_peers` (what `swarmctl job` shows), oldest dropped first.
    ban_log_kept: int = 64
    # When another trainer's microbatches are taken over (assignment.py).
    takeover: TakeoverPolicy = field(default_factory=TakeoverPolicy)
    # Where finished microbatches' tensors wait for their step's commit (held.py); None: the system's temp dir.
    held_dir: str | None = None
    wiring: WiringConfig = field(default_factory=WiringConfig)
    # Held-out evaluation of jobs with [eval] (evaluation.py).
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)

    def __post_init__(self) -> None:
        positive = ("forward_timeout_s", "backward_timeout_s", "info_timeout_s", "stage_info_timeout_s",
                    "stage_info_straggler_s", "stage_info_skip_s", "stage_info_skip_max_s", "refresh_s",
                    "wait_initial_s", "wait_max_s", "commit_poll_s", "commit_poll_max_s", "commit_status_after_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"TrainerConfig.{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.verify_fraction <= 1 or not self.verify_rtol > 0:
            raise ValueError("TrainerConfig.verify_fraction must be in [0, 1] and verify_rtol positive")
        if self.stage_info_skip_max_s < self.stage_info_skip_s:
            raise ValueError("TrainerConfig.stage_info_skip_max_s must be >= stage_info_skip_s")
        if self.ban_log_kept < 1:
            raise ValueError("TrainerConfig.ban_log_kept must be >= 1")
        if self.max_bad_input < 1 or self.resend_grace_s < 0 or self.uncovered_grace_s < 0 \
                or not self.commit_wait_s >= 0:
            raise ValueError("TrainerConfig.max_bad_input must be >= 1, resend_grace_s, uncovered_grace_s "
                             "and commit_wait_s >= 0")


@dataclass(frozen=True)
class _Done:
    """What stays in memory of a finished microbatch until its step commits: no tensors (held.py)."""

    index: int
    mb_id: int
    samples: int
    loss_sum: float | None  # None: the last stage's answer was lost to a commit (answers_lost)
    taken_over: bool = False


class _Stale(SwarmdError):
    """A peer answered stale_step: the stage already committed the step of this call."""


@dataclass
class _Attempts:
    """One call's retry state: peers it already failed on, how many full rounds it paused, and the
    peers that refused its input as bad_input (peer id -> (peer, their reason))."""

    tried: set[bytes] = field(default_factory=set)
    rounds: int = 0
    refusers: dict[bytes, tuple[StagePeer, str]] = field(default_factory=dict)


@dataclass
class _Counters:
    retries: int = 0
    bans: int = 0
    resent: int = 0
    answers_lost: int = 0


@dataclass
class _CommitWatch:
    """What one step's commit watch (`Trainer._wait_committed`) has learnt so far."""

    step: int
    lead: int  # a stage this many steps past `step` shows every stage committed it
    began: float  # loop time
    losses: dict[int, progress.LossWatch]  # per stage: this trainer's ids it lost
    spacing: float  # the least time between the starts of two rounds that come back at once (`pause`)
    committed: dict[int, tuple[int, int]] = field(default_factory=dict)  # stage -> its step record
    unrecorded: dict[int, int] = field(default_factory=dict)  # stage -> rounds it showed no record
    takeovers: dict[int, asyncio.Task] = field(default_factory=dict)  # index -> its task
    furthest: int = -1  # the furthest step any stage's peers agreed on

    def pending(self, stages: int) -> list[int]:
        return [i for i in range(stages) if i not in self.committed]

    def stage_past(self, stage: int, finished: list[dict[str, Any]]) -> None:
        """Stage `stage` committed the step (`finished`: the answers of its peers that did), or
        another stage is `lead` past it (`finished` empty: no record). A peer's step count can
        move a moment before its step record lands: the record is asked for again for up to
        RECORD_POLLS rounds, then done without."""
        if not finished:
            log.info("stage %d taken as past step %d: another stage agrees on step %d", stage, self.step,
                     self.furthest)
            self.committed[stage] = (-1, -1)
            return
        record = progress.step_record(finished, self.step)
        self.unrecorded[stage] = self.unrecorded.get(stage, 0) + 1
        if record != (-1, -1) or self.unrecorded[stage] > RECORD_POLLS:
            self.committed[stage] = record

    def pause(self, took: float, config: TrainerConfig) -> float:
        """How long to wait before the next round, after one that took `took` seconds. A round in
        which peers waited (for the commit, or the whole commit_wait_s) is followed at once. Rounds
        that come back at once (no watch slot free at a peer, a peer that does not wait, a stage
        committed whose record has not landed) start `spacing` apart, from commit_poll_s doubling
        up to commit_poll_max_s while they keep coming back at once: never a busy loop."""
        if took >= self.spacing:
            self.spacing = config.commit_poll_s
            return 0.0
        pause, self.spacing = self.spacing - took, min(2 * self.spacing, config.commit_poll_max_s)
        return pause


@dataclass(frozen=True)
class BanRecord:
    """One ban, kept after the ban itself lifts, so an operator sees who misbehaved and how."""

    stage: int
    peer_id: str  # hex
    addr: str
    reason: str
    at: float  # wall-clock time


class Trainer:
    def __init__(self, spec: JobSpec, job_id: bytes, directory: StageDirectory, pool: Pool, data: TrainingData,
                 *, shard: int = 0, shards: int = 1, config: TrainerConfig = TrainerConfig(),
                 on_event: EventSink | None = None, shapes: list[StageShapes] | None = None) -> None:
        self.assignment = Assignment(spec.batch.microbatches_per_step, shard, shards, config.takeover)
        if shapes is not None and len(shapes) != spec.pipeline.stages:
            raise ValueError(f"{len(shapes)} stage shapes for {spec.pipeline.stages} stages")
        self.spec = spec
        self.job_id = job_id
        self.directory = directory
        self.pool = pool
        self.data = data
        self.shard, self.shards = shard, shards
        self.config = config
        self.num_stages = spec.pipeline.stages
        self.wiring = Wiring(self.num_stages, config.wiring)
        self._on_event = on_event
        self._shapes = shapes
        self._waiting: dict[tuple[str, int], str] = {}  # (what, stage) -> message
        self._counters = _Counters()
        self._resent_at: dict[tuple[int, int], float] = {}  # (stage, mb id) -> loop time
        # (stage, mb id) -> the peer that answered a re-send of it as a repeat it already holds
        self._held_by: dict[tuple[int, int], bytes] = {}
        self._ban_log: deque[BanRecord] = deque(maxlen=config.ban_log_kept)
        self._verify_rng = random.Random(f"verify {config.wiring.seed} {shard}")
        self._held: HeldTensors | None = None
        self._takeover_slots = asyncio.Semaphore(1)  # replaced per commit watch
        # Per stage, the peers whose compute replies this trainer used (and has not banned since):
        # their stage.info answers decide for the stage when any answers (progress.voters).
        self._served: list[set[bytes]] = [set() for _ in range(self.num_stages)]
        self._info_skips = [progress.InfoSkips(config.stage_info_skip_s, config.stage_info_skip_max_s)
                            for _ in range(self.num_stages)]
        # Shard 0 evaluates the job's held-out samples when its [eval] says so (evaluation.py).
        self._evaluation = Evaluation(spec, job_id, pool, self.wiring, data, config, self._ban) \
            if shard == 0 and spec.eval.enabled and data.eval_batch_count() else None
        self.in_memory = 0  # microbatches whose tensors are in memory now (in flight)
        self.peak_in_memory = 0

    # ------------------------------------------------------------------ public

    @property
    def status(self) -> str:
        """Empty while training flows; otherwise what the trainer is waiting for."""
        return "; ".join(self._waiting[key] for key in sorted(self._waiting, key=lambda k: (k[1], k[0])))

    @property
    def banned_peers(self) -> list[BanRecord]:
        """Every ban this trainer made (newest last, up to `ban_log_kept`), with its reason."""
        return list(self._ban_log)

    def my_microbatches(self) -> list[int]:
        """The indices this trainer starts every step with (others' are taken over when left undone)."""
        return self.assignment.own()

    async def run(self, start_step: int | None = None, stop_step: int | None = None) -> list[StepEvent]:
        """Train steps [start_step, stop_step) (default: from the swarm's current step to the spec's
        last) and return their events. Raises TrainerError when training cannot go on."""
        if self._shapes is None:
            self._shapes = await asyncio.to_thread(stage_shapes, self.spec)
        self._held = await asyncio.to_thread(HeldTensors, self.config.held_dir)
        try:
            async with asyncio.TaskGroup() as tasks:
                await self._refresh_all()
                refresher = tasks.create_task(self._refresh_forever(), name="trainer directory refresh")
                try:
                    return await self._train(start_step, stop_step)
                finally:
                    refresher.cancel()
        except BaseExceptionGroup as group:
            raise _single(group) from None
        finally:
            await asyncio.shield(self._held.close())

    # ------------------------------------------------------------------ steps

    async def _train(self, start_step: int | None, stop_step: int | None) -> list[StepEvent]:
        step = await self._swarm_step() if start_step is None else start_step
        stop = self.spec.steps if stop_step is None else stop_step
        events: list[StepEvent] = []
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as tasks:
            previous: asyncio.Task[StepEvent] | None = None
            while step < stop:
                started = loop.time()
                done = await self._run_own(step)
                own_s = loop.time() - started
                if previous is not None:
                    events.append(await previous)
                previous = tasks.create_task(self._finish_step(step, done, started, own_s), name=f"commit {step}")
                if not self.spec.pipeline.delayed_updates:
                    events.append(await previous)
                    previous = None
                step += 1
            if previous is not None:
                events.append(await previous)
        return events

    async def _run_own(self, step: int) -> dict[int, _Done]:
        """This trainer's share of the step, `microbatches_in_flight` at a time: index -> what is kept."""
        slots = asyncio.Semaphore(self.spec.pipeline.microbatches_in_flight)
        done: dict[int, _Done] = {}

        async def one(index: int) -> None:
            async with slots:
                done[index] = await self._microbatch(step, index)

        async with asyncio.TaskGroup() as tasks:
            for index in self.my_microbatches():
                tasks.create_task(one(index), name=f"microbatch {step}/{index}")
        return done

    async def _microbatch(self, step: int, index: int, taken_over: bool = False) -> _Done:
        """Forward through every stage, fused forward+backward on the last, backward to the first;
        then the tensors a re-send needs go to disk and only a small record stays."""
        mb = await asyncio.to_thread(self.data.microbatch, step, index)
        self.in_memory += 1
        self.peak_in_memory = max(self.peak_in_memory, self.in_memory)
        try:
            kept, loss_sum = await self._pass(step, mb)
            await self._held.put(step, mb.id, kept)
        finally:
            self.in_memory -= 1
        return _Done(index, mb.id, len(mb.sample_indices), loss_sum, taken_over)

    async def _pass(self, step: int, mb: Microbatch) -> tuple[StageTensors, float | None]:
        """One microbatch through the pipeline: per stage, the (input, output gradient) it was sent,
        and the loss (None when the last stage's answer was lost to its commit)."""
        n = self.num_stages
        xs = [mb.inputs]
        for i in range(n - 1):
            try:
                xs.append(await self._forward(i, step, mb, xs[i]))
            except _Stale as exc:
                return await self._cover(step, mb, xs, i, exc), None
        try:
            reply = await self._send_last(step, mb, xs[-1])
        except _Stale as exc:
            return await self._cover(step, mb, xs, n - 1, exc), None
        loss_sum = float(reply.meta["loss_sum"])
        kept: StageTensors = {n - 1: (xs[-1] if n > 1 else None, None)}
        grad = reply.tensors[0] if n > 1 else None
        for i in range(n - 2, -1, -1):
            kept[i] = (xs[i] if i else None, grad)
            try:
                reply = await self._send_backward(i, step, mb, xs[i], grad)
            except _Stale as exc:
                if i == 0:
                    break  # stage 0 committed, so it had this microbatch; nothing depends on its answer
                return kept | await self._cover(step, mb, xs, i, exc), loss_sum
            grad = reply.tensors[0] if i else None
        return kept, loss_sum

    async def _cover(self, step: int, mb: Microbatch, xs: list[torch.Tensor], committed: int,
                     exc: _Stale) -> StageTensors:
        """Stage `committed` stepped past `step` holding this microbatch (a call that timed out here
        had completed there) before this trainer got the answer the stages below it need. Those
        stages still wait for the id; they get a zero output gradient, so the id is summed once
        and the step commits; what the microbatch would have added below `committed` is lost
        (counted in `answers_lost`). A stage that replays committed steps never gets here."""
        log.warning("microbatch %d of step %d: %s; the stage stepped before this trainer got its answer: "
                    "stages 0..%d get a zero gradient for it", mb.id, step, exc, committed - 1)
        self._counters.answers_lost += 1
        kept: StageTensors = {}
        for i in range(committed - 1, -1, -1):
            grad = torch.zeros_like(xs[i + 1])
            kept[i] = (xs[i] if i else None, grad)
            try:
                await self._send_backward(i, step, mb, xs[i], grad)
            except _Stale:
                continue  # this stage committed too: it had the microbatch
        return kept

    async def _forward(self, stage: int, step: int, mb: Microbatch, x: torch.Tensor) -> torch.Tensor:
        """A forward, recomputed on a second peer for a `verify_fraction` of microbatches. Only
        forwards are verified: they are stateless, while a second backward would add the
        microbatch's gradient twice to the stage's step."""
        expected = self._shapes[stage].output
        disputes = 0
        verify = self._verify_rng.random() < self.config.verify_fraction  # a redo is verified again
        while True:
            reply, peer = await self._call_on(stage, Kind.FORWARD, "stage.forward", step, mb, [x],
                                              self.spec.wire.activations, lambda r: check_forward(r, expected))
            if not verify:
                self._set_waiting(("dispute", stage), "")
                return reply.tensors[0]
            answers = [(peer, reply.tensors[0])]
            while len(answers) < 3:
                other = await self._second_opinion(stage, step, mb, x, expected, {p.peer_id for p, _ in answers})
                if other is None:
                    break
                answers.append(other)
                verdict = self._settle(stage, mb, answers)
                if verdict is not None:
                    self._set_waiting(("dispute", stage), "")
                    return verdict
            if len(answers) == 1:
                self._set_waiting(("dispute", stage), "")
                return reply.tensors[0]  # no second peer usable now: nothing to compare with
            # Two peers disagree and no third settles it (or all three differ): distrust them all
            # for this microbatch, say so, and redo it after a pause (a new peer may have come).
            self._set_waiting(("dispute", stage), f"stage {stage} peers {sorted(p.addr for p, _ in answers)} "
                                                  f"disagree on microbatch {mb.id} and no other peer settles it")
            await asyncio.sleep(self._backoff(disputes))
            disputes += 1
            await self._refresh_stage(stage)

    def _settle(self, stage: int, mb: Microbatch, answers: list[tuple[StagePeer, torch.Tensor]]) -> torch.Tensor | None:
        """The answer to use once the peers asked agree, banning the one outvoted; None while unsettled."""
        rtol = self.config.verify_rtol
        if len(answers) == 2:
            (_, a), (_, b) = answers
            return a if disagreement(a, b, rtol) is None else None
        for j, (peer, odd) in enumerate(answers):
            rest = [t for k, (_, t) in enumerate(answers) if k != j]
            if disagreement(rest[0], rest[1], rtol) is None:
                why = disagreement(odd, rest[0], rtol)
                if why is not None:
                    self._ban(stage, peer, f"stage.forward of microbatch {mb.id} outvoted by two stage-mates: {why}")
                return rest[0]
        return None  # all three differ: distrust them all for this microbatch

    async def _second_opinion(self, stage: int, step: int, mb: Microbatch, x: torch.Tensor, expected,
                              asked: set[bytes]) -> tuple[StagePeer, torch.Tensor] | None:
        """The same forward from a peer not yet asked; None when no such peer can answer now."""
        meta = {"job": self.job_id, "stage": stage, "step": step, "mb": mb.id, "samples": len(mb.sample_indices)}
        wiring = self.wiring[stage]
        loop = asyncio.get_running_loop()
        failed: set[bytes] = set()
        while True:
            pick = wiring.choose(len(mb.sample_indices), Kind.FORWARD, time.time(), frozenset(asked | failed),
                                 slow_too=True)
            if pick is None:
                return None
            started = loop.time()
            try:
                reply = await self.pool.call(pick.peer.addr, "stage.forward",
                                             Message(meta, [x], self.spec.wire.activations),
                                             timeout=wiring.call_timeout(pick, self.config.forward_timeout_s))
            except DeadlineExceeded:
                wiring.timed_out(pick, loop.time() - started, time.time())
            except RemoteError as exc:
                if exc.code == STALE_STEP:
                    if await self._stale_confirmed(stage, step, pick, exc):
                        raise _Stale(f"stage {stage} peer {pick.peer.addr}: {exc.message}") from None
                elif exc.code not in (BUSY, CODE_OVERLOADED, CODE_DEADLINE, NOT_READY, BAD_INPUT):
                    self._ban(stage, pick.peer, str(exc))
            except (ConnectionLost, ProtocolError, LocalProtocolError) as exc:
                self._ban(stage, pick.peer, f"stage.forward: {exc}")
            else:
                problem = await asyncio.to_thread(check_forward, reply, expected)
                if problem is None:
                    wiring.completed(pick, loop.time() - started, reply.meta.get("caught_up_s"))
                    self._served[stage].add(pick.peer.peer_id)
                    return pick.peer, reply.tensors[0]
                self._ban(stage, pick.peer, f"stage.forward returned a bad reply: {problem}")
            failed.add(pick.peer.peer_id)

    async def _send_last(self, step: int, mb: Microbatch, x: torch.Tensor) -> Message:
        reply, _ = await self._send_last_on(step, mb, x)
        return reply

    async def _send_last_on(self, step: int, mb: Microbatch, x: torch.Tensor,
                            avoid: frozenset[bytes] = frozenset()) -> tuple[Message, StagePeer]:
        first = self.num_stages == 1
        return await self._call_on(self.num_stages - 1, Kind.FORWARD_BACKWARD, "stage.forward_backward", step, mb,
                                   [x, mb.targets], self.spec.wire.activations,
                                   lambda r: check_forward_backward(r, x, first), avoid)

    async def _send_backward(self, stage: int, step: int, mb: Microbatch, x: torch.Tensor,
                             grad: torch.Tensor) -> Message:
        reply, _ = await self._send_backward_on(stage, step, mb, x, grad)
        return reply

    async def _send_backward_on(self, stage: int, step: int, mb: Microbatch, x: torch.Tensor,
                                grad: torch.Tensor, avoid: frozenset[bytes] = frozenset()) -> tuple[Message, StagePeer]:
        return await self._call_on(stage, Kind.BACKWARD, "stage.backward", step, mb, [x, grad],
                                   self.spec.wire.gradients, lambda r: check_backward(r, x, stage == 0), avoid)

    # ------------------------------------------------------------------ commit

    async def _finish_step(self, step: int, done: dict[int, _Done], started: float, own_s: float) -> StepEvent:
        try:
            stage_records = await self._wait_committed(step, done, own_s)
        finally:
            await asyncio.shield(self._held.drop(step))
        elapsed = max(asyncio.get_running_loop().time() - started, 1e-9)
        evaluated = await self._evaluation.run(step + 1, self._shapes) \
            if self._evaluation is not None and self._evaluation.due(step + 1) else None
        known = [d for d in done.values() if d.loss_sum is not None]
        samples = sum(d.samples for d in done.values())
        loss = sum(d.loss_sum for d in known)
        whole = len(known) == self.spec.batch.microbatches_per_step
        counters, self._counters = self._counters, _Counters()
        event = StepEvent(
            step=step,
            shard_loss=loss / max(sum(d.samples for d in known), 1) if known else math.nan,
            global_loss=loss / self.spec.batch.global_samples if whole else None,
            samples=samples,
            tokens_per_s=samples * self.spec.data.seq_len / elapsed,
            elapsed_s=elapsed,
            retries=counters.retries,
            bans=counters.bans,
            resent=counters.resent,
            peers_per_stage=tuple(len(self.wiring[i].usable(time.time())) for i in range(self.num_stages)),
            stage_samples=tuple(samples for samples, _ in stage_records),
            duplicates=tuple(duplicates for _, duplicates in stage_records),
            taken_over=sum(d.taken_over for d in done.values()),
            answers_lost=counters.answers_lost,
            evaluation=evaluated,
        )
        log.info("step %d shard loss %.4f, %.0f tokens/s, %d retries, %d bans, %d taken over", step,
                 event.shard_loss, event.tokens_per_s, event.retries, event.bans, event.taken_over)
        self._emit(event)
        return event

    async def _wait_committed(self, step: int, done: dict[int, _Done], own_s: float) -> list[tuple[int, int]]:
        """Watch every stage until it committed `step`: each round long-polls the stages still
        pending (`_stage_answers` with `until_step`: a peer answers as soon as it commits, or after
        `commit_wait_s`), re-sends what a stage lost of this trainer's microbatches and takes over
        others' that stay undone. Returns, per stage, the (samples, summed_duplicates) of its step
        record (-1 where no peer reported one)."""
        loop = asyncio.get_running_loop()
        # A stage that committed step s + 1 had every microbatch of s + 1 pass through every stage,
        # which each accepts only once it committed s (with delayed updates, s - 1): so once any
        # stage's agreed step is `lead` past `step`, every stage has committed `step`, whatever
        # its own answers say (a liar's low claim beside one honest peer, to a trainer behind).
        watch = _CommitWatch(step, 3 if self.spec.pipeline.delayed_updates else 2, loop.time(),
                             {i: progress.LossWatch(self.config.uncovered_grace_s) for i in range(self.num_stages)},
                             spacing=self.config.commit_poll_s)
        self.assignment.begin_step()
        # Taken-over microbatches run `microbatches_in_flight` at a time, as the own share does.
        self._takeover_slots = asyncio.Semaphore(self.spec.pipeline.microbatches_in_flight)
        try:
            while pending := watch.pending(self.num_stages):
                started = loop.time()
                await self._watch_round(watch, pending, done, own_s)
                if len(watch.committed) < self.num_stages:
                    await asyncio.sleep(watch.pause(loop.time() - started, self.config))
        finally:
            await self._end_takeovers(watch.takeovers)
        for table in (self._resent_at, self._held_by):
            for key in [k for k in table if k[1] in self._step_ids(step)]:
                del table[key]
        return [watch.committed[i] for i in range(self.num_stages)]

    async def _watch_round(self, watch: _CommitWatch, pending: list[int], done: dict[int, _Done],
                           own_s: float) -> None:
        """One round of the commit watch over the stages still pending: mark those committed, act
        on what the others report lost or undone."""
        step = watch.step
        answers = await self._poll_stages(pending, until_step=step)
        voting = {i: progress.voters(answers[i], self._served[i]) for i in pending}
        watch.furthest = max([watch.furthest,
                              *(a for a in map(progress.agreed_step, voting.values()) if a is not None)])
        undone: set[int] = set()
        fresh: set[int] = set()  # undone even at the last stage: started nowhere
        for i in pending:
            infos = voting[i]
            finished = progress.committed(infos, step)
            self._commit_status(i, step, infos, finished, asyncio.get_running_loop().time() - watch.began)
            if finished or watch.furthest >= step + watch.lead:
                watch.stage_past(i, finished)
                continue
            await self._resend_lost(i, step, answers[i], infos, watch.losses[i], done)
            ids = self._step_ids(step)
            here = {mb - ids.start for mb in progress.uncovered_everywhere(infos, step, set(ids))}
            undone |= here
            fresh |= here if i == self.num_stages - 1 else set()
        self._take_over(step, undone, fresh, done, watch.takeovers, own_s)

    @staticmethod
    async def _end_takeovers(takeovers: dict[int, asyncio.Task]) -> None:
        """Cancel the takeovers still running: the step committed without them (or the trainer
        stops). One that failed the way a trainer can fail (InputRefused) no longer matters once the
        step committed; anything else is a bug and is not swallowed."""
        for task in takeovers.values():
            task.cancel()
        outcomes = await asyncio.gather(*takeovers.values(), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, Exception) and not isinstance(outcome, (TrainerError, asyncio.CancelledError)):
                raise outcome

    def _step_ids(self, step: int) -> range:
        per_step = self.spec.batch.microbatches_per_step
        return range(step * per_step, (step + 1) * per_step)

    def _take_over(self, step: int, undone: set[int], fresh: set[int], done: dict[int, _Done],
                   takeovers: dict[int, asyncio.Task], own_s: float) -> None:
        """Start the microbatches of other trainers that the stages show undone past this trainer's
        bound (assignment.py); each lands in `done` when through. A failed one is an error of the
        trainer (as in its own share), heard when the commit watch ends."""
        for index, task in list(takeovers.items()):
            if task.done():
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()
                del takeovers[index]
        started = set(done) | set(takeovers)
        for index in self.assignment.due(undone, fresh, started, asyncio.get_running_loop().time(), own_s):
            log.info("taking over microbatch %d of step %d: the stages show it undone", index, step)

            async def run(index: int = index) -> None:
                async with self._takeover_slots:
                    done[index] = await self._microbatch(step, index, taken_over=True)

            takeovers[index] = asyncio.create_task(run(), name=f"takeover {step}/{index}")

    async def _resend_lost(self, stage: int, step: int, answers: dict[bytes, dict[str, Any]],
                           infos: list[dict[str, Any]], watch: progress.LossWatch, done: dict[int, _Done]) -> None:
        """Re-send what the stage lost of this trainer's microbatches: `missing` in any answer,
        `uncovered` by the answers that vote (`infos`, progress.voters); `answers` has every peer's."""
        by_id = {d.mb_id: d for d in done.values()}
        lost = watch.lost(infos, step, set(by_id), asyncio.get_running_loop().time(), list(answers.values()))
        for mb in [mb for mb in lost if
                   progress.as_int(answers.get(self._held_by.get((stage, mb)), {}).get("step"), -1) == step]:
            del lost[mb]  # its holder answered at this step: the reports lag what it holds
        # A peer past the step committed it: a re-send there is answered as a replay and adds
        # nothing to the step its mates still need (each went to the fastest peer, the one that
        # committed alone, and was resent every resend_grace_s while its mates, which held nothing,
        # waited resume_after_s to believe it: docs/trainer.md).
        past = frozenset(peer for peer, info in answers.items() if progress.as_int(info.get("step"), -1) > step)
        await self._resend(stage, step, [(by_id[mb], why) for mb, why in sorted(lost.items())], past)

    def _commit_status(self, stage: int, step: int, infos: list[dict[str, Any]], done: list, waited: float) -> None:
        """Say so when a stage takes long to commit: a stage-wide step that does not come is what
        an operator must see (e.g. a mate that cannot finish the all-reduce)."""
        if done or waited < self.config.commit_status_after_s:
            self._set_waiting(("commit", stage), "")
            return
        uncovered = min((len(progress.as_ints(info.get("uncovered"))) for info in infos), default=-1)
        self._set_waiting(("commit", stage), f"stage {stage} has not committed step {step} for "
                                             f"{self.config.commit_status_after_s:g}+ s "
                                             f"({len(infos)} peers answered, {uncovered} microbatches uncovered)")

    async def _resend(self, stage: int, step: int, lost: list[tuple[_Done, str]],
                      past: frozenset[bytes] = frozenset()) -> None:
        now = asyncio.get_running_loop().time()
        for done, why in lost:
            key = (stage, done.mb_id)
            if now - self._resent_at.get(key, -float("inf")) < self.config.resend_grace_s:
                continue
            kept = await self._held.get(step, done.mb_id)
            if kept is None or stage not in kept:
                continue  # not sent to this stage by this trainer (its answer above was lost)
            log.info("stage %d lost microbatch %d of step %d (%s): re-sending", stage, done.mb_id, step, why)
            mb = await asyncio.to_thread(self.data.microbatch, step, done.index)
            x, grad = kept[stage]
            x = mb.inputs if stage == 0 else x
            try:
                reply, peer = await (self._send_last_on(step, mb, x, past) if stage == self.num_stages - 1
                                     else self._send_backward_on(stage, step, mb, x, grad, past))
            except _Stale:
                pass  # the stage committed meanwhile: nothing is missing any more
            else:
                if reply.meta.get("duplicate") is True:
                    # The peer already held it: the stage has it, whatever its mates last reported.
                    # Re-sending again would only be refused again; while this peer answers at the
                    # step, it is not re-sent.
                    self._held_by[key] = peer.peer_id
                    log.info("stage %d peer %s already holds microbatch %d of step %d", stage, peer.addr,
                             done.mb_id, step)
            self._counters.resent += 1
            self._resent_at[key] = asyncio.get_running_loop().time()

    async def _poll_stages(self, stages: list[int],
                           until_step: int | None = None) -> dict[int, dict[bytes, dict[str, Any]]]:
        """Every given stage's answers, all stages asked at once (`_stage_answers`; a long-poll
        given `until_step`)."""
        answers = await asyncio.gather(*(self._stage_answers(i, until_step) for i in stages))
        return dict(zip(stages, answers))

    async def _stage_answers(self, stage: int, until_step: int | None = None) -> dict[bytes, dict[str, Any]]:
        """peer id -> `stage.info` meta, for the stage's unbanned peers that answered in time
        (benched peers too: a bench is about compute calls, and they may hold the step's work).
        All are asked at once (`_ask`); given `until_step`, as a long-poll. A peer still waiting
        when its mates' answers ended a long-poll has not committed the step (or is hung): a plain
        stage.info asks it where it stands, for `stage_info_straggler_s`, since its silence must
        not leave the mates that did commit to vote alone. A peer that did not answer in time is
        not asked again for a while (`progress.InfoSkips`), unless no peer of the stage would be."""
        peers = await self._usable_peers(stage, benched_too=True)
        skips = self._info_skips[stage]
        loop = asyncio.get_running_loop()
        # Peers withheld for slowness hold nothing this trainer sent them (but a probe), and
        # waiting for their answers would hold every commit watch to their pace.
        skipped = skips.skipped(loop.time()) | self.wiring[stage].withheld(time.time())
        asked = [peer for peer in peers if peer.peer_id not in skipped] or peers
        answers, late = await self._ask(stage, asked, until_step, self._info_timeout(until_step))
        if until_step is not None and answers and late:
            more, late = await self._ask(stage, late, None, self.config.stage_info_straggler_s)
            answers |= more
        for peer in late:
            skips.missed(peer.peer_id, loop.time())
        return answers

    async def _ask(self, stage: int, peers: list[StagePeer], until_step: int | None,
                   timeout: float) -> tuple[dict[bytes, dict[str, Any]], list[StagePeer]]:
        """`peers`' stage.info answers (peer id -> meta), all asked at once, each for at most
        `timeout`, and the peers that did not answer in time: once one answer ended a wait
        (`_ends_wait`), the others get `stage_info_straggler_s` more."""
        loop = asyncio.get_running_loop()
        calls = {asyncio.create_task(self._info(stage, peer, until_step), name=f"stage.info {stage} {peer.addr}"): peer
                 for peer in peers}
        trusted = self._served[stage] & {peer.peer_id for peer in peers}
        answers: dict[bytes, dict[str, Any]] = {}
        pending = set(calls)
        asked_at = loop.time()
        until = asked_at + timeout
        try:
            while pending and (left := until - loop.time()) > 0:
                finished, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    meta, peer_id = task.result(), calls[task].peer_id
                    if meta is None:
                        continue
                    answers[peer_id] = meta
                    if self._ends_wait(meta, peer_id in trusted or not trusted, until_step, loop.time() - asked_at):
                        until = min(until, loop.time() + self.config.stage_info_straggler_s)
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        return answers, [calls[task] for task in pending]

    def _ends_wait(self, meta: dict[str, Any], voting: bool, until_step: int | None, waited: float) -> bool:
        """Whether this answer starts the stragglers' clock. A plain poll's first answer does. In a
        long-poll, only an answer that ended a wait does (the peer is past `until_step`, or it waited
        the whole `commit_wait_s`), and only from a peer whose word votes (one that served this
        trainer, when any was asked): a peer answering at once (it had no watch slot free, or it
        claims a far step) must not cut off its mates mid-wait, leaving its answer alone to vote."""
        if until_step is None:
            return True
        return voting and (progress.as_int(meta.get("step")) > until_step or waited >= self.config.commit_wait_s)

    def _info_timeout(self, until_step: int | None) -> float:
        """A stage.info call's timeout: a long-poll's must outlast the wait it asks for."""
        return self.config.stage_info_timeout_s + (0.0 if until_step is None else self.config.commit_wait_s)

    async def _info(self, stage: int, peer: StagePeer, until_step: int | None = None) -> dict[str, Any] | None:
        meta: dict[str, Any] = {"job": self.job_id, "stage": stage}
        if until_step is not None:
            meta |= {"until_step": until_step, "wait_s": self.config.commit_wait_s}
        skips = self._info_skips[stage]
        try:
            reply = await self.pool.call(peer.addr, "stage.info", Message(meta, codec="none"),
                                         timeout=self._info_timeout(until_step))
        except DeadlineExceeded:
            skips.missed(peer.peer_id, asyncio.get_running_loop().time())
            return None
        except RemoteError as exc:
            if exc.code not in (BUSY, CODE_OVERLOADED, CODE_DEADLINE):
                self._ban(stage, peer, f"stage.info: {exc}")
            return None
        except (ConnectionLost, ProtocolError, LocalProtocolError) as exc:
            self._ban(stage, peer, f"stage.info: {exc}")
            return None
        skips.answered(peer.peer_id)
        return reply.meta

    async def _swarm_step(self) -> int:
        """Where a joining trainer starts: the step every stage has reached (a stage's step is the
        lower median of its answering peers' claims, `progress.agreed_step`: one peer claiming a
        far step in every stage must not make the trainer, and through its calls the stages, skip
        the steps between)."""

        async def stage_step(i: int) -> int:
            rounds = 0
            while (agreed := progress.agreed_step(progress.voters(await self._stage_answers(i),
                                                                  self._served[i]))) is None:
                await asyncio.sleep(self._backoff(rounds))  # peers announced, none answering yet
                rounds += 1
            return agreed

        return min(await asyncio.gather(*(stage_step(i) for i in range(self.num_stages))))

    # ------------------------------------------------------------------ one call, until it succeeds

    async def _call_on(self, stage: int, kind: Kind, method: str, step: int, mb: Microbatch,
                       tensors: list[torch.Tensor], codec: str,
                       check: Callable[[Message], str | None],
                       avoid: frozenset[bytes] = frozenset()) -> tuple[Message, StagePeer]:
        """The call's reply, and which peer gave it. A backward or forward_backward that timed out
        is tried once more on the same peer first: if the first attempt did complete there, the
        peer answers the repeat without adding it twice, where another peer would add it again.
        Peers in `avoid` count as tried already: picked only once every other peer failed."""
        samples = len(mb.sample_indices)
        meta = {"job": self.job_id, "stage": stage, "step": step, "mb": mb.id, "samples": samples}
        ceiling = self.config.forward_timeout_s if kind is Kind.FORWARD else self.config.backward_timeout_s
        wiring = self.wiring[stage]
        attempts = _Attempts(tried=set(avoid))
        again: bytes | None = None
        loop = asyncio.get_running_loop()
        while True:
            pick = wiring.again(again, samples, kind, time.time()) if again is not None else None
            again = None
            if pick is None:
                pick = await self._pick(stage, samples, kind, attempts)
            peer = pick.peer
            try:
                parse_address(peer.addr)
            except LocalProtocolError as exc:
                self._ban(stage, peer, f"unusable address: {exc}")
                attempts.tried.add(peer.peer_id)
                continue
            timeout = wiring.call_timeout(pick, ceiling)
            started = loop.time()
            try:
                reply = await self.pool.call(peer.addr, method, Message(meta, tensors, codec), timeout=timeout)
            except DeadlineExceeded:
                wiring.timed_out(pick, loop.time() - started, time.time())
                log.info("%s to stage %d peer %s timed out after %.1f s: %s", method, stage, peer.addr,
                         loop.time() - started, "rerouting" if kind is Kind.FORWARD else "trying it once more")
                if kind is not Kind.FORWARD and peer.peer_id not in attempts.tried:
                    again = peer.peer_id
            except RemoteError as exc:
                if exc.code == STALE_STEP:
                    if await self._stale_confirmed(stage, step, pick, exc):
                        raise _Stale(f"stage {stage} peer {peer.addr}: {exc.message}") from None
                else:
                    self._on_remote_error(stage, pick, exc, attempts, loop.time() - started, mb)
            except (ConnectionLost, ProtocolError) as exc:
                self._ban(stage, peer, f"{method}: {exc}")
            else:
                problem = await asyncio.to_thread(check, reply)
                if problem is None:
                    wiring.completed(pick, loop.time() - started, reply.meta.get("caught_up_s"))
                    self._served[stage].add(peer.peer_id)
                    for refuser, why in attempts.refusers.values():
                        if refuser.peer_id != peer.peer_id:
                            self._ban(stage, refuser, f"refused microbatch {mb.id} of step {step} as bad_input "
                                                      f"({why}), which stage-mate {peer.addr} then accepted")
                    return reply, peer
                self._ban(stage, peer, f"{method} returned a bad reply: {problem}")
            attempts.tried.add(peer.peer_id)
            self._counters.retries += 1

    def _on_remote_error(self, stage: int, pick: Pick, exc: RemoteError, attempts: _Attempts, elapsed: float,
                         mb: Microbatch) -> None:
        if exc.code in (BUSY, CODE_OVERLOADED):
            self.wiring[stage].busy(pick)
        elif exc.code == CODE_DEADLINE:
            self.wiring[stage].timed_out(pick, elapsed, time.time())
        elif exc.code == NOT_READY:
            pass  # it waited for its commit until the deadline; another peer may be further along
        elif exc.code == BAD_INPUT:
            attempts.refusers[pick.peer.peer_id] = (pick.peer, exc.message)
            self._blame_input(stage, mb, attempts, exc)
        else:
            self._ban(stage, pick.peer, str(exc))

    def _blame_input(self, stage: int, mb: Microbatch, attempts: _Attempts, exc: RemoteError) -> None:
        """Raise InputRefused when the refusals of this input as bad_input are evidence against
        the input rather than against the refusers: `max_bad_input` distinct peers refused it and
        one of them served this trainer before, or every unbanned peer of the stage refused it.
        Peer ids are free, so refusals from strangers alone blame nothing: a stage-mate that then
        accepts the input gets it banned for them (`_call_on`)."""
        refusers = attempts.refusers.keys()
        trusted = refusers & self._served[stage]
        unbanned = {p.peer_id for p in self.wiring[stage].usable(time.time(), benched_too=True)}
        if (len(refusers) >= self.config.max_bad_input and trusted) or (unbanned and unbanned <= refusers):
            raise InputRefused(f"{len(refusers)} peers of stage {stage} refused microbatch {mb.id} "
                               f"(step {mb.step}, index {mb.index}), {len(trusted)} of them after serving this "
                               f"trainer, {len(unbanned - refusers)} unbanned peers left: {exc.message}")

    async def _stale_confirmed(self, stage: int, step: int, pick: Pick, exc: RemoteError) -> bool:
        """Whether stage `stage` did commit `step`, as `pick.peer` answered `stale_step`: one peer's
        word is not the stage's (acting on it zero-covers the stages below and leaves the stage
        without the microbatch). Confirmed when the stage's agreed step (`progress.agreed_step`)
        is past it. Otherwise the call goes elsewhere, and the peer is banned when its own
        stage.info puts it at or before `step` (it contradicts itself); else it is charged like a
        busy one. (Not banned for claiming to be far ahead of the agreed step: a liar claiming a
        low step beside one honest peer would make that peer look far ahead, and a ban then would
        leave the stage to the liar.)"""
        answers = await self._stage_answers(stage)
        agreed = progress.agreed_step(progress.voters(answers, self._served[stage]))
        if agreed is not None and agreed > step:
            return True
        own = answers.get(pick.peer.peer_id)
        claimed = None if own is None else progress.as_int(own.get("step"))
        if claimed is not None and claimed <= step:
            self._ban(stage, pick.peer, f"answered stale_step for step {step} ({exc.message}) while its "
                                        f"stage.info says step {claimed}")
        else:
            log.info("stage %d peer %s answered stale_step for step %d, but the stage's peers agree on step %s: "
                     "not believed, rerouting", stage, pick.peer.addr, step, agreed)
            self.wiring[stage].busy(pick)
        return False

    async def _pick(self, stage: int, samples: int, kind: Kind, attempts: _Attempts) -> Pick:
        """The wiring's choice among peers this call has not failed on yet; pauses when it failed on
        every one, and waits (status set, directory re-read with backoff) while there is none."""
        wiring = self.wiring[stage]
        waited = 0
        while True:
            now = time.time()
            usable = {p.peer_id for p in wiring.usable(now)}
            if usable and usable <= attempts.tried:
                attempts.tried.clear()
                await asyncio.sleep(self._backoff(attempts.rounds))
                attempts.rounds += 1
                now = time.time()
            # The same `now` as `usable`: a peer usable there and not tried is picked here (the
            # wiring once judged a withheld peer differently at each look, and a trainer whose
            # call had failed on one peer waited for ever, "no peers", between two usable ones).
            pick = wiring.choose(samples, kind, now, frozenset(attempts.tried))
            if pick is not None:
                self._set_waiting(("peers", stage), "")
                return pick
            self._set_waiting(("peers", stage), f"stage {stage} has no peers" + self._unusable(stage))
            await asyncio.sleep(self._backoff(waited))
            waited += 1
            await self._refresh_stage(stage)

    def _unusable(self, stage: int) -> str:
        wiring, now = self.wiring[stage], time.time()
        banned, benched, withheld = len(wiring.banned()), len(wiring.benched(now)), len(wiring.withheld(now))
        why = ([f"{banned} banned"] * bool(banned) + [f"{benched} benched for timing out"] * bool(benched)
               + [f"{withheld} withheld for slowness"] * bool(withheld))
        return f" ({', '.join(why)})" if why else ""

    async def _usable_peers(self, stage: int, benched_too: bool = False) -> list[StagePeer]:
        waited = 0
        while True:
            peers = self.wiring[stage].usable(time.time(), benched_too)
            if peers:
                self._set_waiting(("peers", stage), "")
                return peers
            self._set_waiting(("peers", stage), f"stage {stage} has no peers" + self._unusable(stage))
            await asyncio.sleep(self._backoff(waited))
            waited += 1
            await self._refresh_stage(stage)

    def _backoff(self, rounds: int) -> float:
        return min(self.config.wait_initial_s * 2 ** min(rounds, 30), self.config.wait_max_s)

    def _ban(self, stage: int, peer: StagePeer, reason: str) -> None:
        self._served[stage].discard(peer.peer_id)
        now = time.time()
        if self.wiring[stage].ban(peer, now, reason):
            log.warning("banned stage %d peer %s: %s", stage, peer.addr, reason)
            self._counters.bans += 1
            self._ban_log.append(BanRecord(stage, peer.peer_id.hex(), peer.addr, reason, now))

    # ------------------------------------------------------------------ directory and status

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_s)
            await self._refresh_all()

    async def _refresh_all(self) -> None:
        for i in range(self.num_stages):
            await self._refresh_stage(i)

    async def _refresh_stage(self, stage: int) -> None:
        try:
            async with asyncio.timeout(self.config.info_timeout_s):
                peers = await self.directory.peers(self.job_id, stage)
        # A directory backed by the DHT can fail in many ways (timeouts, unreachable contacts, its
        # own errors); such a failed read keeps the previous peer list and must never stop
        # training. Anything else is a bug: it ends the trainer, whose supervisor shows it.
        except (SwarmdError, TransportError, RpcError, OSError, TimeoutError) as exc:
            log.warning("reading the peers of stage %d failed: %s", stage, exc)
            return
        self.wiring[stage].update(peers, time.time())

    def _set_waiting(self, key: tuple[str, int], message: str) -> None:
        before = self.status
        if message:
            self._waiting[key] = message
        else:
            self._waiting.pop(key, None)
        if self.status != before:
            if message:
                log.warning("waiting: %s", message)
            self._emit(StatusEvent(self.status))

    def _emit(self, event: StatusEvent | StepEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)


def _single(group: BaseExceptionGroup) -> BaseException:
    """The TrainerError inside nested task groups, so callers catch it plainly; anything else (a
    bug) comes out as the group itself."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            inner = _single(exc)
            if inner is not exc:
                return inner
        elif isinstance(exc, TrainerError):
            return exc
    return group
