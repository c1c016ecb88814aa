"""The trainer: drives its shard of every step's microbatches through a swarm of stage peers.

SWARM's trainer is the hub of every microbatch (trainer → stage peer → trainer, no server-to-server
link): it keeps each stage's input, so a backward can go to *any* peer of the stage (recompute is
stateless) and a peer that dies holding gradients costs only a re-send. Per microbatch of step s:
forward through stages 0..n-2, `forward_backward` on the last (the targets never leave the trainer
except to it, so logits never cross the network), then backward from n-2 down to 0, each hop to a
peer picked afresh by the stochastic wiring. Several microbatches are in flight at once so every
stage stays busy. Every call is retried elsewhere until it succeeds or the trainer is cancelled;
each has a timeout, and when a stage has no usable peer the trainer waits with a status saying so
and re-reads the directory with backoff, so nothing waits unboundedly and silently.

After its microbatches of step s, the trainer polls `stage.info` until every stage has committed s
(see docs/stage-rpc.md), re-sending the backward of any of its microbatches a stage has lost (a
peer that died before the all-reduce took them with it). Only then are the step's
saved inputs and gradients dropped. Shards are fixed: trainer k of K takes microbatch indices
m ≡ k (mod K).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from swarmd.directory import StageDirectory, StagePeer
from swarmd.job.data import Microbatch, TrainingData
from swarmd.job.spec import JobSpec
from swarmd.train.errors import InputRefused, StepLost, TrainerError
from swarmd.train.events import EventSink, StatusEvent, StepEvent
from swarmd.train.replies import (
    StageShapes,
    check_backward,
    check_forward,
    check_forward_backward,
    disagreement,
    stage_shapes,
)
from swarmd.train.wiring import Kind, Pick, Wiring, WiringConfig
from transport.errors import ConnectionLost, DeadlineExceeded, LocalProtocolError, ProtocolError, RemoteError
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
    # Per-call timeouts, the paper's code's values: a forward is ~1/3 of a backward's work, and a
    # call past these is rerouted (not banned). forward_backward uses the backward timeout.
    forward_timeout_s: float = 30.0
    backward_timeout_s: float = 75.0
    # stage.info is answered from memory; a peer that cannot answer in this long is skipped.
    info_timeout_s: float = 10.0
    # Directory re-read period (the paper's code: 30 s; shorter finds replacements sooner).
    refresh_s: float = 5.0
    # Pause when every usable peer of a stage failed one call, or when a stage has no peers at all:
    # starts here, doubles per round, capped at wait_max_s.
    wait_initial_s: float = 0.05
    wait_max_s: float = 5.0
    # Polling for a step's commit: starts here, doubles while waiting, capped.
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
    # status line (the wait goes on: only the stage can finish its step).
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
    wiring: WiringConfig = field(default_factory=WiringConfig)

    def __post_init__(self) -> None:
        positive = ("forward_timeout_s", "backward_timeout_s", "info_timeout_s", "refresh_s", "wait_initial_s",
                    "wait_max_s", "commit_poll_s", "commit_poll_max_s", "commit_status_after_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"TrainerConfig.{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.verify_fraction <= 1 or not self.verify_rtol > 0:
            raise ValueError("TrainerConfig.verify_fraction must be in [0, 1] and verify_rtol positive")
        if self.ban_log_kept < 1:
            raise ValueError("TrainerConfig.ban_log_kept must be >= 1")
        if self.max_bad_input < 1 or self.resend_grace_s < 0 or self.uncovered_grace_s < 0:
            raise ValueError("TrainerConfig.max_bad_input must be >= 1, resend_grace_s and "
                             "uncovered_grace_s >= 0")


@dataclass
class _Record:
    """What the trainer keeps of one microbatch until every stage committed its step."""

    mb: Microbatch
    inputs: list[torch.Tensor]  # x_i for every stage i
    grads: list[torch.Tensor | None]  # grad_y_i for every stage but the last
    loss_sum: float = 0.0

    @property
    def samples(self) -> int:
        return len(self.mb.sample_indices)


class _Stale(Exception):
    """A peer answered stale_step: the stage already committed the step of this call."""


@dataclass
class _Attempts:
    """One call's retry state: peers it already failed on, and how many full rounds it paused."""

    tried: set[bytes] = field(default_factory=set)
    rounds: int = 0
    refused: int = 0


@dataclass
class _Counters:
    retries: int = 0
    bans: int = 0
    resent: int = 0


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
        per_step = spec.batch.microbatches_per_step
        if not 1 <= shards <= per_step:
            raise ValueError(f"shards must be in 1..{per_step} (microbatches per step), got {shards}")
        if not 0 <= shard < shards:
            raise ValueError(f"shard must be in 0..{shards - 1}, got {shard}")
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
        return [m for m in range(self.spec.batch.microbatches_per_step) if m % self.shards == self.shard]

    async def run(self, start_step: int | None = None, stop_step: int | None = None) -> list[StepEvent]:
        """Train steps [start_step, stop_step) (default: from the swarm's current step to the spec's
        last) and return their events. Raises TrainerError when training cannot go on."""
        if self._shapes is None:
            self._shapes = await asyncio.to_thread(stage_shapes, self.spec)
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
                records = await self._run_microbatches(step)
                if previous is not None:
                    events.append(await previous)
                previous = tasks.create_task(self._finish_step(step, records, started), name=f"commit {step}")
                if not self.spec.pipeline.delayed_updates:
                    events.append(await previous)
                    previous = None
                step += 1
            if previous is not None:
                events.append(await previous)
        return events

    async def _run_microbatches(self, step: int) -> list[_Record]:
        slots = asyncio.Semaphore(self.spec.pipeline.microbatches_in_flight)
        mine = self.my_microbatches()
        records: list[_Record | None] = [None] * len(mine)

        async def one(j: int, index: int) -> None:
            async with slots:
                records[j] = await self._microbatch(step, index)

        async with asyncio.TaskGroup() as tasks:
            for j, index in enumerate(mine):
                tasks.create_task(one(j, index), name=f"microbatch {step}/{index}")
        return [r for r in records if r is not None]

    async def _microbatch(self, step: int, index: int) -> _Record:
        """Forward through every stage, fused forward+backward on the last, backward to the first."""
        mb = await asyncio.to_thread(self.data.microbatch, step, index)
        n = self.num_stages
        record = _Record(mb, inputs=[mb.inputs], grads=[None] * n)
        try:
            for i in range(n - 1):
                record.inputs.append(await self._forward(i, step, mb, record.inputs[i]))
            reply = await self._send_last(step, record)
            record.loss_sum = float(reply.meta["loss_sum"])
            grad = reply.tensors[0] if n > 1 else None
            for i in range(n - 2, 0, -1):
                record.grads[i] = grad
                reply = await self._send_backward(i, step, record)
                grad = reply.tensors[0]
            if n > 1:
                record.grads[0] = grad
                try:
                    await self._send_backward(0, step, record)
                except _Stale:
                    pass  # stage 0 committed, so it had this microbatch; nothing depends on its answer
        except _Stale as exc:
            raise StepLost(f"microbatch {mb.id} of step {step}: {exc}; the stage stepped without the answer "
                           "this trainer needs (raise the per-call timeouts if compute is slow)") from None
        return record

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
            pick = wiring.choose(len(mb.sample_indices), Kind.FORWARD, time.time(), frozenset(asked | failed))
            if pick is None:
                return None
            started = loop.time()
            try:
                reply = await self.pool.call(pick.peer.addr, "stage.forward",
                                             Message(meta, [x], self.spec.wire.activations),
                                             timeout=self.config.forward_timeout_s)
            except DeadlineExceeded:
                wiring.timed_out(pick, loop.time() - started)
            except RemoteError as exc:
                if exc.code == STALE_STEP:
                    raise _Stale(f"stage {stage} peer {pick.peer.addr}: {exc.message}") from None
                if exc.code not in (BUSY, CODE_OVERLOADED, CODE_DEADLINE, NOT_READY, BAD_INPUT):
                    self._ban(stage, pick.peer, str(exc))
            except (ConnectionLost, ProtocolError, LocalProtocolError) as exc:
                self._ban(stage, pick.peer, f"stage.forward: {exc}")
            else:
                problem = await asyncio.to_thread(check_forward, reply, expected)
                if problem is None:
                    wiring.completed(pick, loop.time() - started)
                    return pick.peer, reply.tensors[0]
                self._ban(stage, pick.peer, f"stage.forward returned a bad reply: {problem}")
            failed.add(pick.peer.peer_id)

    async def _send_last(self, step: int, record: _Record) -> Message:
        reply, _ = await self._send_last_on(step, record)
        return reply

    def _send_last_on(self, step: int, record: _Record) -> Awaitable[tuple[Message, StagePeer]]:
        x = record.inputs[-1]
        first = self.num_stages == 1
        return self._call_on(self.num_stages - 1, Kind.FORWARD_BACKWARD, "stage.forward_backward", step, record.mb,
                             [x, record.mb.targets], self.spec.wire.activations,
                             lambda r: check_forward_backward(r, x, first))

    async def _send_backward(self, stage: int, step: int, record: _Record) -> Message:
        reply, _ = await self._send_backward_on(stage, step, record)
        return reply

    def _send_backward_on(self, stage: int, step: int, record: _Record) -> Awaitable[tuple[Message, StagePeer]]:
        x, grad = record.inputs[stage], record.grads[stage]
        return self._call_on(stage, Kind.BACKWARD, "stage.backward", step, record.mb, [x, grad],
                             self.spec.wire.gradients, lambda r: check_backward(r, x, stage == 0))

    # ------------------------------------------------------------------ commit

    async def _finish_step(self, step: int, records: list[_Record], started: float) -> StepEvent:
        stage_records = await self._wait_committed(step, records)
        elapsed = max(asyncio.get_running_loop().time() - started, 1e-9)
        samples = sum(r.samples for r in records)
        loss = sum(r.loss_sum for r in records)
        counters, self._counters = self._counters, _Counters()
        event = StepEvent(
            step=step,
            shard_loss=loss / samples,
            global_loss=loss / self.spec.batch.global_samples if self.shards == 1 else None,
            samples=samples,
            tokens_per_s=samples * self.spec.data.seq_len / elapsed,
            elapsed_s=elapsed,
            retries=counters.retries,
            bans=counters.bans,
            resent=counters.resent,
            peers_per_stage=tuple(len(self.wiring[i].usable(time.time())) for i in range(self.num_stages)),
            stage_samples=tuple(samples for samples, _ in stage_records),
            duplicates=tuple(duplicates for _, duplicates in stage_records),
        )
        log.info("step %d shard loss %.4f, %.0f tokens/s, %d retries, %d bans", step, event.shard_loss,
                 event.tokens_per_s, event.retries, event.bans)
        self._emit(event)
        return event

    async def _wait_committed(self, step: int, records: list[_Record]) -> list[tuple[int, int]]:
        """Poll until every stage committed `step`, re-sending what a stage lost. Returns, per stage,
        the (samples, summed_duplicates) of its step record (-1 where no peer reported one)."""
        by_id = {r.mb.id: r for r in records}
        committed: dict[int, tuple[int, int]] = {}
        uncovered_since: dict[tuple[int, int], float] = {}
        unrecorded: dict[int, int] = {}
        delay = self.config.commit_poll_s
        loop = asyncio.get_running_loop()
        began = loop.time()
        while len(committed) < self.num_stages:
            for i in range(self.num_stages):
                if i in committed:
                    continue
                answers = await self._stage_answers(i)
                infos = list(answers.values())
                done = [info for info in infos if _int(info.get("step")) > step]
                self._commit_status(i, step, infos, done, loop.time() - began)
                if done:
                    # A peer's step count can move a moment before its step record lands: ask
                    # again a few times for the record, then do without it.
                    record = _step_record(done, step)
                    unrecorded[i] = unrecorded.get(i, 0) + 1
                    if record != (-1, -1) or unrecorded[i] > RECORD_POLLS:
                        committed[i] = record
                    continue
                lost = self._lost(i, step, infos, set(by_id), uncovered_since, loop.time())
                for mb in [mb for mb in lost if _int(answers.get(self._held_by.get((i, mb)), {}).get("step"), -1) == step]:
                    del lost[mb]  # its holder answered at this step: the reports lag what it holds
                await self._resend(i, step, [(by_id[mb], why) for mb, why in sorted(lost.items())])
            if len(committed) < self.num_stages:
                await asyncio.sleep(delay)
                delay = min(2 * delay, self.config.commit_poll_max_s)
        for table in (self._resent_at, self._held_by):
            for key in [k for k in table if k[1] in by_id]:
                del table[key]
        return [committed[i] for i in range(self.num_stages)]

    def _commit_status(self, stage: int, step: int, infos: list[dict[str, Any]], done: list, waited: float) -> None:
        """Say so when a stage takes long to commit: a stage-wide step that does not come is what
        an operator must see (e.g. a mate that cannot finish the all-reduce)."""
        if done or waited < self.config.commit_status_after_s:
            self._set_waiting(("commit", stage), "")
            return
        uncovered = min((len(_ints(info.get("uncovered"))) for info in infos), default=-1)
        self._set_waiting(("commit", stage), f"stage {stage} has not committed step {step} for "
                                             f"{self.config.commit_status_after_s:g}+ s "
                                             f"({len(infos)} peers answered, {uncovered} microbatches uncovered)")

    def _lost(self, stage: int, step: int, infos: list[dict[str, Any]], mine: set[int],
              uncovered_since: dict[tuple[int, int], float], now: float) -> dict[int, str]:
        """This trainer's microbatches the stage no longer holds. `missing` (a peer held them, then
        left) is believed at once. `uncovered` (no live peer holds them) can merely lag a backward
        that just finished, so it counts only when every answering peer says so for
        `uncovered_grace_s`: all of this trainer's backwards had completed before polling began.
        Peers that have all committed fewer than `step` steps hold nothing of it (their progress is
        about an older step): the stage lost its state, e.g. restored an older checkpoint after all
        its peers died; everything of ours is uncovered there, and the re-send is what lets the
        stage take up this step again (StageService._resume_at)."""
        missing = {mb for info in infos for mb in _ints(info.get("missing"))} & mine
        uncovered = set(mine)
        if not infos or any(_int(info.get("step")) >= step for info in infos):
            for info in infos:
                uncovered &= set(_ints(info.get("uncovered")))
        for key in [k for k in uncovered_since if k[0] == stage and k[1] not in uncovered]:
            del uncovered_since[key]
        for mb in uncovered:
            uncovered_since.setdefault((stage, mb), now)
        lost = {mb: "uncovered" for mb in uncovered
                if now - uncovered_since[(stage, mb)] >= self.config.uncovered_grace_s}
        return lost | {mb: "missing" for mb in missing}

    async def _resend(self, stage: int, step: int, lost: list[tuple[_Record, str]]) -> None:
        now = asyncio.get_running_loop().time()
        for record, why in lost:
            key = (stage, record.mb.id)
            if now - self._resent_at.get(key, -float("inf")) < self.config.resend_grace_s:
                continue
            log.info("stage %d lost microbatch %d of step %d (%s): re-sending", stage, record.mb.id, step, why)
            try:
                reply, peer = await (self._send_last_on(step, record) if stage == self.num_stages - 1
                                     else self._send_backward_on(stage, step, record))
            except _Stale:
                pass  # the stage committed meanwhile: nothing is missing any more
            else:
                if reply.meta.get("duplicate") is True:
                    # The peer already held it: the stage has it, whatever its mates last reported.
                    # Re-sending again would only be refused again (a run once saw 79 such repeats
                    # of one step); while this peer answers at the step, it is not re-sent.
                    self._held_by[key] = peer.peer_id
                    log.info("stage %d peer %s already holds microbatch %d of step %d", stage, peer.addr,
                             record.mb.id, step)
            self._counters.resent += 1
            self._resent_at[key] = asyncio.get_running_loop().time()

    async def _stage_infos(self, stage: int) -> list[dict[str, Any]]:
        return list((await self._stage_answers(stage)).values())

    async def _stage_answers(self, stage: int) -> dict[bytes, dict[str, Any]]:
        """peer id -> `stage.info` meta, for the usable peers of the stage that answered."""
        peers = await self._usable_peers(stage)
        results: list[dict[str, Any] | None] = [None] * len(peers)

        async def ask(j: int, peer: StagePeer) -> None:
            results[j] = await self._info(stage, peer)

        async with asyncio.TaskGroup() as tasks:
            for j, peer in enumerate(peers):
                tasks.create_task(ask(j, peer))
        return {peer.peer_id: r for peer, r in zip(peers, results) if r is not None}

    async def _info(self, stage: int, peer: StagePeer) -> dict[str, Any] | None:
        message = Message({"job": self.job_id, "stage": stage}, codec="none")
        try:
            reply = await self.pool.call(peer.addr, "stage.info", message, timeout=self.config.info_timeout_s)
        except DeadlineExceeded:
            return None
        except RemoteError as exc:
            if exc.code not in (BUSY, CODE_OVERLOADED, CODE_DEADLINE):
                self._ban(stage, peer, f"stage.info: {exc}")
            return None
        except (ConnectionLost, ProtocolError, LocalProtocolError) as exc:
            self._ban(stage, peer, f"stage.info: {exc}")
            return None
        return reply.meta

    async def _swarm_step(self) -> int:
        """Where a joining trainer starts: the step every stage has reached (a stage's step is the
        highest any of its peers committed)."""
        steps = []
        for i in range(self.num_stages):
            infos = await self._stage_infos(i)
            rounds = 0
            while not infos:  # peers announced, none answering yet
                await asyncio.sleep(self._backoff(rounds))
                rounds += 1
                infos = await self._stage_infos(i)
            steps.append(max(_int(info.get("step")) for info in infos))
        return min(steps)

    # ------------------------------------------------------------------ one call, until it succeeds

    async def _call_on(self, stage: int, kind: Kind, method: str, step: int, mb: Microbatch,
                       tensors: list[torch.Tensor], codec: str,
                       check: Callable[[Message], str | None]) -> tuple[Message, StagePeer]:
        """The call's reply, and which peer gave it."""
        samples = len(mb.sample_indices)
        meta = {"job": self.job_id, "stage": stage, "step": step, "mb": mb.id, "samples": samples}
        timeout = self.config.forward_timeout_s if kind is Kind.FORWARD else self.config.backward_timeout_s
        wiring = self.wiring[stage]
        attempts = _Attempts()
        loop = asyncio.get_running_loop()
        while True:
            pick = await self._pick(stage, samples, kind, attempts)
            peer = pick.peer
            started = loop.time()
            try:
                parse_address(peer.addr)
            except LocalProtocolError as exc:
                self._ban(stage, peer, f"unusable address: {exc}")
                continue
            try:
                reply = await self.pool.call(peer.addr, method, Message(meta, tensors, codec), timeout=timeout)
            except DeadlineExceeded:
                wiring.timed_out(pick, loop.time() - started)
                log.info("%s to stage %d peer %s timed out after %.1f s: rerouting", method, stage, peer.addr,
                         loop.time() - started)
            except RemoteError as exc:
                self._on_remote_error(stage, pick, exc, attempts, loop.time() - started, mb)
            except (ConnectionLost, ProtocolError) as exc:
                self._ban(stage, peer, f"{method}: {exc}")
            else:
                problem = await asyncio.to_thread(check, reply)
                if problem is None:
                    wiring.completed(pick, loop.time() - started)
                    return reply, peer
                self._ban(stage, peer, f"{method} returned a bad reply: {problem}")
            attempts.tried.add(peer.peer_id)
            self._counters.retries += 1

    def _on_remote_error(self, stage: int, pick: Pick, exc: RemoteError, attempts: _Attempts, elapsed: float,
                         mb: Microbatch) -> None:
        if exc.code == STALE_STEP:
            raise _Stale(f"stage {stage} peer {pick.peer.addr}: {exc.message}")
        if exc.code in (BUSY, CODE_OVERLOADED):
            self.wiring[stage].busy(pick)
        elif exc.code == CODE_DEADLINE:
            self.wiring[stage].timed_out(pick, elapsed)
        elif exc.code == NOT_READY:
            pass  # it waited for its commit until the deadline; another peer may be further along
        elif exc.code == BAD_INPUT:
            attempts.refused += 1
            if attempts.refused >= self.config.max_bad_input:
                raise InputRefused(f"{attempts.refused} peers of stage {stage} refused microbatch {mb.id} "
                                   f"(step {mb.step}, index {mb.index}): {exc.message}")
        else:
            self._ban(stage, pick.peer, str(exc))

    async def _pick(self, stage: int, samples: int, kind: Kind, attempts: _Attempts) -> Pick:
        """The wiring's choice among peers this call has not failed on yet; pauses when it failed on
        every one, and waits (status set, directory re-read with backoff) while there is none."""
        wiring = self.wiring[stage]
        waited = 0
        while True:
            usable = {p.peer_id for p in wiring.usable(time.time())}
            if usable and usable <= attempts.tried:
                attempts.tried.clear()
                await asyncio.sleep(self._backoff(attempts.rounds))
                attempts.rounds += 1
            pick = wiring.choose(samples, kind, time.time(), frozenset(attempts.tried))
            if pick is not None:
                self._set_waiting(("peers", stage), "")
                return pick
            banned = len(wiring.banned())
            self._set_waiting(("peers", stage), f"stage {stage} has no peers" + (f" ({banned} banned)" if banned else ""))
            await asyncio.sleep(self._backoff(waited))
            waited += 1
            await self._refresh_stage(stage)

    async def _usable_peers(self, stage: int) -> list[StagePeer]:
        waited = 0
        while True:
            peers = self.wiring[stage].usable(time.time())
            if peers:
                self._set_waiting(("peers", stage), "")
                return peers
            self._set_waiting(("peers", stage), f"stage {stage} has no peers")
            await asyncio.sleep(self._backoff(waited))
            waited += 1
            await self._refresh_stage(stage)

    def _backoff(self, rounds: int) -> float:
        return min(self.config.wait_initial_s * 2 ** min(rounds, 30), self.config.wait_max_s)

    def _ban(self, stage: int, peer: StagePeer, reason: str) -> None:
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
        # A directory backed by the DHT can fail in many ways (timeouts, unreachable contacts); a
        # failed read keeps the previous peer list and must never stop training.
        except Exception as exc:  # noqa: BLE001
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


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _ints(value: Any) -> list[int]:
    return [v for v in value if isinstance(v, int) and not isinstance(v, bool)] if isinstance(value, list) else []


def _step_record(infos: list[dict[str, Any]], step: int) -> tuple[int, int]:
    """(samples, summed_duplicates) of `step` from the `last_step` record of peers that just committed
    it: the microbatches summed twice, which are what `samples` exceeds global_samples by."""
    for info in infos:
        record = info.get("last_step")
        if isinstance(record, dict) and _int(record.get("step"), -1) == step:
            return _int(record.get("samples"), -1), _int(record.get("summed_duplicates"), -1)
    return -1, -1


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
