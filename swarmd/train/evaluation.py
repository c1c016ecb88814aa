"""Held-out evaluation through the swarm: the job's `[eval]` samples forward through every stage on
the parameters of one committed step, and their mean loss.

After every `eval.every_steps` commits, and after the job's last step, trainer shard 0 (one
evaluator per job, whichever daemon runs it) evaluates version v = the steps committed: each
held-out batch (`microbatch_samples` samples, the last maybe fewer) goes `stage.evaluate` through
stages 0..n-1, each call to a peer the trainer's own wiring picks, `EvaluationConfig.workers`
batches at a time. A stage answers on the parameters of exactly v (live, or kept from the step
just committed) and never accumulates, claims or waits (docs/stage-rpc.md): evaluation cannot
change what a step sums, and its loss is a function of v's parameters and the held-out samples
alone, which is what the exported model of step v reproduces (tests/jobs/test_jobs_eval_daemons.py).

An evaluation is worth a few retries, never a stalled or failed job: a call that fails on one peer
goes to another (a bad reply or a protocol error bans the peer, as in training), and after
`max_attempts` failures of one call, or once a stage has gone two steps past v (`stale_step`:
nobody holds v's parameters any more), the evaluation is given up and reported without a loss.

Answers are second-guessed as training forwards are (`TrainerConfig.verify_fraction`, seeded):
a call is recomputed on another peer of the stage, two that disagree beyond `verify_rtol` are
settled by a third and the outvoted peer is banned; when nobody settles it the evaluation is given
up rather than reported with a loss a liar may have made.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from swarmd.directory import StagePeer
from swarmd.errors import SwarmdError
from swarmd.job.data import EvalBatch, TrainingData
from swarmd.job.spec import JobSpec
from swarmd.model import TensorSpec
from swarmd.train.replies import StageShapes, check_forward, disagreement
from swarmd.train.wiring import Kind, Wiring
from transport.errors import ConnectionLost, DeadlineExceeded, LocalProtocolError, ProtocolError, RemoteError
from transport.rpc import CODE_DEADLINE, CODE_OVERLOADED, Message

if TYPE_CHECKING:
    from swarmd.train.trainer import TrainerConfig

log = logging.getLogger(__name__)

# RpcError codes of the stage contract (docs/stage-rpc.md) an evaluation call may get without the
# peer being at fault.
_PASSING = {"busy", "not_ready", CODE_OVERLOADED, CODE_DEADLINE}
STALE_STEP = "stale_step"


@dataclass(frozen=True)
class EvaluationConfig:
    # Held-out batches in flight at once, each pushed through every stage: a bounded pool, so an
    # evaluation of MAX_EVAL_SAMPLES never floods the stages' queues (they answer busy past theirs).
    workers: int = 4
    # Peers one stage.evaluate call may try before the whole evaluation is given up.
    max_attempts: int = 8
    # Ceiling of one call's timeout; the one used is the wiring's, derived from the peer's measured
    # rate as for a training forward (WiringConfig.timeout_factor, timeout_floor_s).
    timeout_s: float = 30.0
    # Pause before trying peers again once every usable peer of a stage failed a call: starts here,
    # doubles per round.
    retry_pause_s: float = 0.05

    def __post_init__(self) -> None:
        if self.workers < 1 or self.max_attempts < 1:
            raise ValueError("EvaluationConfig.workers and max_attempts must be >= 1")
        if not self.timeout_s > 0 or not self.retry_pause_s > 0:
            raise ValueError("EvaluationConfig.timeout_s and retry_pause_s must be positive")


@dataclass(frozen=True)
class EvalResult:
    version: int  # steps committed when the parameters were evaluated
    loss: float | None  # mean per-sample loss of the held-out samples; None: given up
    samples: int  # held-out samples evaluated (all of them, or 0 when given up)
    elapsed_s: float
    why: str = ""  # why it was given up


class GiveUp(SwarmdError):
    """This evaluation cannot complete (a stage moved past its version, or a call failed too often)."""


Ban = Callable[[int, StagePeer, str], None]


class Evaluation:
    def __init__(self, spec: JobSpec, job_id: bytes, pool, wiring: Wiring, data: TrainingData,
                 trainer_config: "TrainerConfig", ban: Ban) -> None:
        self.spec, self.job_id, self.pool, self.wiring, self.data = spec, job_id, pool, wiring, data
        self.config: EvaluationConfig = trainer_config.evaluation
        self.verify_fraction, self.verify_rtol = trainer_config.verify_fraction, trainer_config.verify_rtol
        self._verify_rng = random.Random(f"evaluation verify {trainer_config.wiring.seed}")
        self._ban = ban
        self.num_stages = spec.pipeline.stages

    def due(self, committed: int) -> bool:
        return self.spec.eval.due(committed, self.spec.steps)

    async def run(self, version: int, shapes: list[StageShapes]) -> EvalResult:
        """Evaluate the parameters of `version` (steps committed); never raises for the swarm's
        failures, which give the evaluation up (EvalResult.loss None, `why` set)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        slots = asyncio.Semaphore(self.config.workers)
        sums: list[float] = []

        async def one(index: int) -> None:
            async with slots:
                sums.append(await self._batch(version, index, shapes))

        why = ""
        try:
            async with asyncio.TaskGroup() as tasks:
                for index in range(self.data.eval_batch_count()):
                    tasks.create_task(one(index), name=f"evaluate {version}/{index}")
        except* GiveUp as group:
            why = str(group.exceptions[0])
        if why:
            log.warning("evaluation of step %d given up: %s", version, why)
            return EvalResult(version, None, 0, loop.time() - started, why)
        samples = len(self.data.eval_indices)
        loss = math.fsum(sums) / samples
        log.info("evaluation of step %d: held-out loss %.4f over %d samples", version, loss, samples)
        return EvalResult(version, loss, samples, loop.time() - started)

    async def _batch(self, version: int, index: int, shapes: list[StageShapes]) -> float:
        """One held-out batch through every stage: its sample-summed loss."""
        batch = await asyncio.to_thread(self.data.eval_batch, index)
        x = batch.inputs
        for stage in range(self.num_stages - 1):
            out = shapes[stage].output
            expected = TensorSpec((len(batch.sample_indices), *out.shape[1:]), out.dtype)
            reply = await self._verified(stage, version, batch, [x], lambda r: check_forward(r, expected))
            x = reply.tensors[0]
        reply = await self._verified(self.num_stages - 1, version, batch, [x, batch.targets], _check_loss)
        return float(reply.meta["loss_sum"])

    async def _verified(self, stage: int, version: int, batch: EvalBatch, tensors: list[torch.Tensor],
                        check: Callable[[Message], str | None]) -> Message:
        """The call's reply; for a `verify_fraction` of calls agreed on by a second peer, or by two
        of three (the outvoted one banned). Nobody to ask a second time: the one reply stands."""
        reply, peer = await self._call(stage, version, batch, tensors, check)
        if not self._verify_rng.random() < self.verify_fraction:
            return reply
        answers = [(peer, reply)]
        while len(answers) < 3:
            other = await self._call(stage, version, batch, tensors, check, frozenset(p.peer_id for p, _ in answers))
            if other is None:
                break
            answers.append((other[1], other[0]))
            settled = self._settle(stage, batch, answers)
            if settled is not None:
                return settled
        if len(answers) == 1:
            return reply
        raise GiveUp(f"stage {stage} peers {sorted(p.addr for p, _ in answers)} disagree on held-out batch "
                     f"{batch.index} and no other peer settles it")

    def _settle(self, stage: int, batch: EvalBatch, answers: list[tuple[StagePeer, Message]]) -> Message | None:
        """The reply to use once the peers asked agree, banning the one two others outvote."""
        if len(answers) == 2:
            (_, a), (_, b) = answers
            return a if self._disagreement(a, b) is None else None
        for j, (peer, odd) in enumerate(answers):
            rest = [m for k, (_, m) in enumerate(answers) if k != j]
            if self._disagreement(rest[0], rest[1]) is None:
                why = self._disagreement(odd, rest[0])
                if why is not None:
                    self._ban(stage, peer, f"stage.evaluate of held-out batch {batch.index} outvoted by two "
                                           f"stage-mates: {why}")
                return rest[0]
        return None

    def _disagreement(self, a: Message, b: Message) -> str | None:
        """Why two checked replies to one call cannot both be right (losses, or activations)."""
        if not a.tensors:
            la, lb = float(a.meta["loss_sum"]), float(b.meta["loss_sum"])
            if abs(la - lb) > self.verify_rtol * max(abs(la), abs(lb)):
                return f"losses {la:.6g} and {lb:.6g} differ beyond {self.verify_rtol:g} relative"
            return None
        return disagreement(a.tensors[0], b.tensors[0], self.verify_rtol)

    async def _call(self, stage: int, version: int, batch: EvalBatch, tensors: list[torch.Tensor],
                    check: Callable[[Message], str | None], others_than: frozenset[bytes] | None = None):
        """(reply, peer) of one stage.evaluate, retried on other peers. With `others_than` (a second
        opinion) only from other peers, and None rather than giving up when none can answer."""
        samples = len(batch.sample_indices)
        meta = {"job": self.job_id, "stage": stage, "version": version, "samples": samples}
        wiring = self.wiring[stage]
        loop = asyncio.get_running_loop()
        tried: set[bytes] = set()
        rounds = 0
        for attempt in range(self.config.max_attempts):
            pick = wiring.choose(samples, Kind.FORWARD, time.time(), frozenset(tried) | (others_than or frozenset()),
                                 slow_too=others_than is not None)
            if pick is None:
                if others_than is not None and not tried:
                    return None  # no other peer to ask
                if not tried:
                    raise GiveUp(f"stage {stage} has no usable peer")
                tried.clear()  # every usable peer failed once: pause, then try them again
                await asyncio.sleep(self.config.retry_pause_s * 2 ** min(rounds, 10))
                rounds += 1
                continue
            peer, began = pick.peer, loop.time()
            tried.add(peer.peer_id)
            try:
                reply = await self.pool.call(peer.addr, "stage.evaluate", Message(meta, tensors, self.spec.wire.activations),
                                             timeout=wiring.call_timeout(pick, self.config.timeout_s))
            except DeadlineExceeded:
                wiring.timed_out(pick, loop.time() - began, time.time())
                continue
            except RemoteError as exc:
                if exc.code == STALE_STEP:
                    raise GiveUp(f"stage {stage} no longer holds the parameters of step {version}") from None
                if exc.code in ("busy", CODE_OVERLOADED):
                    wiring.busy(pick)
                elif exc.code not in _PASSING:
                    self._ban(stage, peer, f"stage.evaluate: {exc}")
                continue
            except (ConnectionLost, ProtocolError, LocalProtocolError) as exc:
                self._ban(stage, peer, f"stage.evaluate: {exc}")
                continue
            problem = await asyncio.to_thread(check, reply)
            if problem is None and reply.meta.get("version") != version:
                problem = f"answered version {reply.meta.get('version')!r}, not {version}"
            if problem is None:
                wiring.completed(pick, loop.time() - began)
                return reply, peer
            self._ban(stage, peer, f"stage.evaluate returned a bad reply: {problem}")
        if others_than is not None:
            return None
        raise GiveUp(f"stage.evaluate of stage {stage} failed {self.config.max_attempts} times (max_attempts)")


def _check_loss(reply: Message) -> str | None:
    loss = reply.meta.get("loss_sum")
    if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return f"loss_sum is {loss!r}, not a finite number"
    if reply.tensors:
        return f"expected no tensors, got {len(reply.tensors)}"
    return None
