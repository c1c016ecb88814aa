"""StageService: one served stage of one job on this peer, from joining to stopping.

It owns the stage module and its optimizer, the executor (bounded queue and compute threads), the
gradient accumulator, the stage-mate sync loop and checkpointing, and every task they run (one
supervised set, cancelled by `stop`). Requests reach it through a `StageServer` on the daemon's
Router. On `start` it joins: it downloads and verifies the state of a live stage-mate when one
answers, else restores the newest checkpoint in its state dir, else starts from the deterministic
init; only then does it accept work.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from swarmd.directory import StageDirectory
from swarmd.errors import SwarmdError
from swarmd.job import JobSpec
from swarmd.model.init import build_initial_stage
from swarmd.model.precision import LossScaler, Precision
from swarmd.optim import NonFiniteGradient, StageOptimizer, StepReport
import swarmd.stage.checkpoint as ckpt
from swarmd.stage.accumulator import Accumulator
from swarmd.stage.compute import (BACKWARD, EVALUATE, FORWARD, FORWARD_BACKWARD, Lane, ParamGuard, Previous,
                                  StageCompute, Work)
from swarmd.stage.core import (BEHIND, Admission, CoreConfig, Download, Phase, RoundPlan, StageCore,
                               initial_digest, jump_digest, next_digest)
from swarmd.stage.errors import RoundFailed, StaleStep, bad_input, busy, not_ready
from swarmd.stage.executor import Executor, QueueFull, join_threads
from swarmd.stage.limits import Slots, StageLimits
from swarmd.stage.resume import ProgressAnchor, proven_step
from swarmd.stage.robust import CENTERED_CLIP
from swarmd.stage.server import StageServer
from swarmd.stage.state import (Snapshot, StateError, apply_snapshot, content_digest, download, snapshot_messages,
                                take_snapshot)
from swarmd.stage.sync import ROUND_PROTOCOL, StageSync
from swarmd.supervisor import Supervisor
from transport.errors import RpcError, TransportError
from transport.rpc import Message, Pool, Request, Router
from transport.tasks import TaskSet

log = logging.getLogger(__name__)

INLINE_CHECK_ELEMENTS = 1 << 16
"""Inputs up to this many elements are checked for NaN/inf on the event loop (tens of
microseconds); larger ones in a thread, so a big activation never stalls other calls."""


class Look(enum.Enum):
    """What `StageService._resume_at` found for a step past this peer's."""

    TAKEN = "taken"  # this peer now accepts work for the step
    PENDING = "pending"  # its looks find the swarm there; it takes the step up once resume_after_s agreed
    NO = "no"  # no sign that the swarm is there


@dataclass(frozen=True)
class StepRecord:
    """What one committed step was made of (kept for `stage.info` and logs)."""

    step: int
    members: int
    samples: int  # behind the summed gradient: global_samples (I1, docs/stage-rpc.md)
    # Microbatches summed more than once: 0 by construction (the round plan keeps disjoint sums),
    # kept in the record so a trainer that checks it sees the invariant hold.
    summed_duplicates: int
    # Copies of microbatches this peer saw but did not sum: repeats it refused (it or a mate
    # already held that id) and arrivals after the round took its sum (covered by a mate), plus,
    # stage-wide, the ids of members the round left out. Harmless: not in `samples`, not in the
    # gradient; many of them mean a trainer re-sends what the stage holds.
    dropped_repeats: int
    lr: float
    grad_norm: float
    clipped: bool
    # Hex peer ids whose gradient the robust aggregate (StageLimits.aggregate) clipped past
    # outlier_factor·τ or left out as non-finite; always empty with the exact mean.
    outliers: tuple[str, ...] = ()
    left_out: int = 0  # members whose sums the round left out (they overlapped a kept member's)
    digest: str = ""  # hex digest of the state this step produced (equal on every member)


class StageService:
    def __init__(self, spec: JobSpec, job_id: bytes, stage_index: int, peer_id: bytes,
                 server: StageServer | Router, pool: Pool, directory: StageDirectory, *, address: str,
                 device: str | torch.device = "cpu", limits: StageLimits = StageLimits(),
                 state_dir: str | Path | None = None, supervisor: Supervisor | None = None,
                 anchor: ProgressAnchor | None = None) -> None:
        self.spec, self.job_id, self.stage_index, self.peer_id = spec, job_id, stage_index, peer_id
        # The job's submitter's signed step (`swarmd.stage.resume`): the only evidence this peer
        # takes up a step it lost on. None (no submitter known here): it never skips a step.
        self.anchor = anchor
        self._unproven_logged = (-1, -math.inf)  # (step, loop time) a look last logged refusing to take up
        # The stage's loops restart on an unexpected error (logged, shown in `swarmctl status`)
        # rather than die silently while the stage stays announced.
        self.supervisor = supervisor or Supervisor(f"stage {stage_index}")
        # Given the daemon's Router, share the one StageServer registered on it.
        self.server = StageServer.for_router(server) if isinstance(server, Router) else server
        self.pool, self.directory = pool, directory
        self.address = address  # "host:port" mates dial to reach us, as announced (round member lists use it)
        self.device = torch.device(device)
        self.limits = limits
        self.state_dir = None if state_dir is None else ckpt.checkpoint_dir(Path(state_dir), job_id, stage_index)
        self.microbatches = spec.batch.microbatches_per_step
        self.core = StageCore(peer_id, address, CoreConfig(
            self.microbatches, limits.missing_grace_s, limits.resume_after_s, defer_s=limits.defer_s,
            bench_s=limits.bench_s, bench_max_s=limits.bench_max_s, exact=limits.aggregate != CENTERED_CLIP,
            idle_after_steps=limits.idle_after_steps, idle_catch_up_s=limits.idle_catch_up_s, job_steps=spec.steps),
            delayed=spec.pipeline.delayed_updates)
        self.records: deque[StepRecord] = deque(maxlen=limits.records_kept)
        self.sync = StageSync(self)
        # Its one-shot tasks (a checkpoint write, a round) are not restarted, but a failure of one
        # is shown in the supervisor's faults (`swarmctl status`), not only logged.
        self._tasks = TaskSet(f"stage {stage_index}", on_failure=self._task_failed)
        self._aux = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{stage_index}-aux")
        self._committed_event = asyncio.Event()
        # Compute calls parked for a later step, and `stage.info` long-polls: separate slots, each
        # counted in all and per caller (a stranger's long-polls leave the trainers' slots alone).
        self.parked = Slots("calls wait for a commit", limits.max_waiting, "max_waiting",
                            limits.max_waiting_per_peer, "max_waiting_per_peer")
        self.watchers = Slots("stage.info long-polls wait", limits.max_watchers, "max_watchers",
                              limits.max_watchers_per_peer, "max_watchers_per_peer")
        self._checkpoint_lock = asyncio.Lock()
        self._resume_lock = asyncio.Lock()
        # (from, to) for every jump over steps this stage lost (see `_resume_at`), shown by stage.info.
        self.skipped: deque[tuple[int, int]] = deque(maxlen=limits.records_kept)
        self.streams = Slots("state downloads running", limits.max_state_streams, "max_state_streams",
                             limits.max_state_streams_per_peer, "max_state_streams_per_peer")
        # The digest of the parameters now in the module: written with them under the guard (the
        # core's own copy follows on the event loop), so a snapshot always pairs the two.
        self._state_digest = b""
        # Bumped under the guard whenever the parameters are replaced (download, jump): a batch
        # admitted before that adds nothing (its claim died with the old state).
        self._state_epoch = 0
        # The parameters of the step committed last, kept for late calls of that step (replays).
        self._previous: Previous | None = None
        # Downloads of a mate's state after joining (`catch_up`), shown by stage.info: an idle peer
        # makes one every idle_catch_up_s rather than one a step.
        self.catch_ups = 0

    @property
    def state(self) -> Phase:
        """The phase (a `str`: "joining", "serving", "draining", "stopping", "stopped")."""
        return self.core.phase

    @state.setter
    def state(self, phase: str) -> None:
        self.core.phase = Phase(phase)

    # ------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Build the stage, join (download, checkpoint or fresh init), then serve."""
        if self.limits.torch_threads is not None:
            torch.set_num_threads(self.limits.torch_threads)
        self.state = "joining"
        await self.in_aux(self._build)
        self.server.add(self)
        try:
            await self._join()
        except BaseException:
            self.server.remove(self)
            raise
        self.core.worked(self.committed)  # a newcomer is not idle before work could reach it
        name = f"{self.job_id.hex()[:16]}/{self.stage_index}"
        self._tasks.spawn(self.supervisor.run(f"{name} executor", self.executor.run), "executor")
        self._tasks.spawn(self.supervisor.run(f"{name} sync", self.sync.run), "sync")
        self.state = "serving"

    async def stop(self) -> None:
        """Stop accepting, fail what is queued, cancel every task and wait for them, then for the
        compute and auxiliary threads (a batch or a commit under way ends first). The caller bounds
        the whole (the daemon's drain deadline); cancelled, the threads end on their own."""
        self.state = "stopping"
        self.server.remove(self)
        self.sync.mailbox.fail_all("the peer is stopping")
        if hasattr(self, "executor"):
            self.executor.close(busy("the stage is stopping"))
        await self._tasks.aclose("stage stopping")
        if hasattr(self, "executor"):
            await self.executor.join()
        await join_threads(self._aux)
        self.state = "stopped"

    async def drain(self, timeout_s: float) -> bool:
        """Stop taking new work and wait until the work this peer holds is done; False on timeout.

        While draining, compute calls are answered `busy` (trainers reroute them), and progress
        replies and the announcement say `draining`, so mates leave this peer out of new rounds and
        report the microbatch ids they saw it hold as `missing` (trainers re-send those to peers
        that stay): what it accumulated for the uncommitted step is not handed over, never counted
        twice. "Done" means nothing queued or computing and no round under way (a round already
        joined finishes and commits with this peer's gradients in it), and that for long enough (a
        few sync intervals plus a progress timeout) that every mate has polled us as draining, so
        none starts a round with us after we looked. A catch-up download running when the drain
        begins ends by setting the state back to serving; each look re-asserts draining.
        """
        quiet_s = 3 * self.limits.sync_interval_s + self.limits.progress_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        quiet_since: float | None = None
        while True:
            if self.state == "serving":
                self.state = "draining"
            now = loop.time()
            if self.executor.depth or self.sync.in_round or self.state != "draining":
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= quiet_s:
                return True
            if now >= deadline:
                return False
            await asyncio.sleep(self.limits.sync_interval_s)

    def undrain(self) -> None:
        """A drain given up (the move it was for failed): take work again. Behind its mates by now,
        maybe; the sync loop then catches up by download."""
        if self.state == "draining":
            self.state = "serving"

    def _build(self) -> None:
        precision = Precision(self.spec.compute.dtype)
        precision.check(self.device)
        model = self.spec.model
        self.stage = build_initial_stage(model.config, self.stage_index, self.spec.pipeline.stages, self.spec.seed,
                                         self.device, model.init, model.init_digest)
        compute = self.spec.compute
        self.opt = StageOptimizer(self.stage, self.spec.optim, self.spec.steps, offload=compute.optimizer_offload,
                                  scaler=LossScaler(compute.loss_scale, compute.growth_interval)
                                  if precision.scaled else None)
        self.params = self.opt.params
        self.numel = sum(p.numel() for p in self.params)
        self.guard = ParamGuard()
        self.accumulator = Accumulator(len(self.params))
        lane = Lane()
        workers = self.limits.workers
        if self.device.type == "cuda":
            from swarmd.stage.cuda import cuda_lane

            lane, workers = cuda_lane(self.device), 1  # one stream per stage: one thread feeds it
        self.compute = StageCompute(self.stage, self.params, self.accumulator, self.guard, lambda: self.opt.step_count,
                                    lambda: self._state_epoch, lane, lambda: self._previous,
                                    autocast=lambda: precision.autocast(self.device),
                                    loss_scale=lambda: self.opt.loss_scale)
        self.executor = Executor(self.compute.run, self.limits, workers, f"stage{self.stage_index}")

    async def _join(self) -> None:
        self._state_digest = initial_digest(self.spec.seed, self.stage_index)
        self.core.replaced(0, self._state_digest)
        mates = [m for m in await self.sync.poll() if m.state == Phase.SERVING]
        if mates:
            ordered = sorted(mates, key=lambda m: -m.step)
            if await self._download([(m.peer_id, m.addr) for m in ordered]):
                return
        if self.state_dir is not None:
            snapshot = await asyncio.to_thread(ckpt.newest_checkpoint, self.state_dir, self.stage_index)
            if snapshot is not None:
                snapshot.digest = await self.in_aux(content_digest, snapshot)
                await self._apply(snapshot)
                log.info("stage %d restored checkpoint of step %d", self.stage_index, snapshot.step)

    async def catch_up(self, download: Download) -> None:
        """The core says our state is not the stage's (a mate is ahead, or the visible peers at our
        step agree on another digest): stop serving and replace it with a mate's."""
        log.info("stage %d at step %d downloads: %s", self.stage_index, self.committed, download.reason)
        self.state = Phase.JOINING
        try:
            if await self._download(list(download.sources)):
                self.catch_ups += 1
        finally:
            if self.state == Phase.JOINING:
                self.state = Phase.SERVING

    async def _download(self, mates: list[tuple[bytes, str]]) -> bool:
        for peer_id, addr in mates:
            try:
                snapshot = await download(self.pool, addr, self.job_id, self.stage_index, self.stage,
                                          self.limits.state_timeout_s)
                await self._apply(snapshot)
            except (TransportError, RpcError, StateError, ValueError) as exc:
                log.warning("stage %d: state from %s refused: %s", self.stage_index, addr, exc)
                continue
            log.info("stage %d downloaded the state of step %d from %s", self.stage_index, snapshot.step, addr)
            return True
        return False

    async def _apply(self, snapshot: Snapshot) -> None:
        if snapshot.digest is None:
            raise StateError("a state without its digest")

        def apply() -> None:
            with self.guard.write():
                apply_snapshot(snapshot, self.stage, self.opt)
                self.accumulator.clear()
                self._state_digest = snapshot.digest
                self._state_epoch += 1
                self._previous = None
                self._settle()

        await self.in_aux(apply)
        self.core.replaced(snapshot.step, snapshot.digest)
        self._notify_commit()

    # ------------------------------------------------------------------------ what others read

    @property
    def committed(self) -> int:
        """Optimizer steps this peer has taken: the step it accepts work for."""
        return self.core.step

    @property
    def digest(self) -> bytes:
        """The digest of this peer's state (equal on every peer of the stage that agrees: I2)."""
        return self.core.digest

    def announcement(self) -> dict[str, Any]:
        """The fields of this peer's DHT announcement for the stage."""
        return {"samples_per_s": self.executor.samples_per_s, "queue": self.executor.depth,
                "step": self.committed, "state": self.state}

    def meta(self) -> dict[str, Any]:
        return {"job": self.job_id, "stage": self.stage_index}

    def step_ids(self, step: int) -> frozenset[int]:
        return self.core.step_ids(step)

    def spawn(self, coro: Coroutine, name: str) -> asyncio.Task:
        return self._tasks.spawn(coro, name)

    def _task_failed(self, name: str, exc: BaseException) -> None:
        """A spawned task failed with an unexpected error (TaskSet logged it with its traceback)."""
        faults = self.supervisor.faults
        faults.failed(f"{self.supervisor.owner}: {name}", exc, 0.0)
        faults.restarted(f"{self.supervisor.owner}: {name}")  # a one-shot task: no retry is due

    async def in_aux(self, fn: Callable, *args: Any) -> Any:
        """Run `fn` on the stage's one auxiliary thread (builds, flattens, commits, snapshots)."""
        return await asyncio.get_running_loop().run_in_executor(self._aux, fn, *args)

    # ------------------------------------------------------------------------ compute RPCs

    async def forward(self, req: Request) -> Message:
        if self.stage.is_last:
            raise bad_input("the last stage answers stage.forward_backward, not stage.forward")
        answer, admitted = await self._compute_call(req, FORWARD)
        meta = {"replayed": admitted.get("replayed", False), "version": admitted["version"]}
        if "caught_up_s" in admitted:
            meta["caught_up_s"] = admitted["caught_up_s"]
        return Message(meta, [answer.tensor], codec=self.spec.wire.activations)

    async def backward(self, req: Request) -> Message:
        if self.stage.is_last:
            raise bad_input("the last stage answers stage.forward_backward, not stage.backward")
        answer, admitted = await self._compute_call(req, BACKWARD)
        tensors = [] if answer.tensor is None else [answer.tensor]
        return Message(admitted, tensors, codec=self.spec.wire.gradients)

    async def forward_backward(self, req: Request) -> Message:
        if not self.stage.is_last:
            raise bad_input(f"stage.forward_backward is for the last stage; this is stage {self.stage_index}")
        answer, admitted = await self._compute_call(req, FORWARD_BACKWARD)
        tensors = [] if answer.tensor is None else [answer.tensor]
        return Message({"loss_sum": answer.loss_sum, **admitted}, tensors, codec=self.spec.wire.gradients)

    async def evaluate(self, req: Request) -> Message:
        """`stage.evaluate {version, samples}` with [x] (and [targets] at the last stage): held-out
        samples forward on the parameters of `version` (steps committed), for a trainer's evaluation
        (swarmd/train/evaluation.py). Forward only: no graph, no claim, nothing accumulated, so the
        step's sums are what they are without it. It queues on the stage's executor like any compute
        call (`busy` when the queue is full) and never waits for a commit: `version` must be the
        live parameters or the step just committed (kept for replays); older is `stale_step`,
        newer `not_ready` (this peer lags its mates: the trainer asks another)."""
        if self.state != Phase.SERVING:
            raise busy(f"this peer is {self.state}")
        if self.core.behind():
            raise not_ready(f"this peer is behind its stage-mates (at step {self.committed}, idle: it catches up "
                            f"every {self.limits.idle_catch_up_s:g} s, idle_catch_up_s); evaluate on another")
        version, samples = req.meta.get("version"), req.meta.get("samples")
        if type(version) is not int or version < 0 or type(samples) is not int:
            raise bad_input("stage.evaluate needs int 'version' >= 0 and int 'samples'")
        if not 1 <= samples <= self.spec.batch.microbatch_samples:
            raise bad_input(f"samples is {samples}, must be 1..{self.spec.batch.microbatch_samples}")
        x, targets = await self._check_tensors(FORWARD_BACKWARD if self.stage.is_last else FORWARD, req.tensors,
                                               samples)
        committed, kept = self.committed, self._previous
        if version > committed:
            raise not_ready(f"the parameters of step {version} were asked; this peer has committed {committed}")
        if version < committed and (kept is None or kept.step != version):
            raise StaleStep(version, committed).to_rpc()
        # `replay`: computed alone, on the kept parameters when `version` is the step just committed.
        work = Work(EVALUATE, version, -1, x, targets, False, asyncio.get_running_loop().create_future(),
                    epoch=self._state_epoch, replay=True, deadline=req.deadline)
        answer = await self._run_work(work)
        if work.used != version:  # the state was replaced meanwhile (a download)
            raise StaleStep(version, self.committed).to_rpc()
        if self.stage.is_last:
            return Message({"version": version, "loss_sum": answer.loss_sum}, codec="none")
        return Message({"version": version}, [answer.tensor], codec=self.spec.wire.activations)

    async def _run_work(self, work: Work) -> Any:
        """Queue `work` and wait for its answer: `busy` when the queue is full, a stale step as the
        RPC error; the caller gone, the work is left to a worker that skips it (and settles it)."""
        try:
            self.executor.submit(work)
        except QueueFull as exc:
            work.future.cancel()
            raise busy(str(exc)) from None
        try:
            return await asyncio.shield(work.future)
        except StaleStep as exc:
            raise exc.to_rpc() from None
        except asyncio.CancelledError:
            work.abandoned = True
            raise

    async def _compute_call(self, req: Request, kind: str) -> tuple[Any, dict[str, Any]]:
        """Run one call; returns its answer and the reply's admission meta (`duplicate`: this peer
        already held the microbatch; `added`: this call's gradient went into its sum; `held_by_mate`:
        a mate of its lineage holds or computes it, so it was not added here; `caught_up_s`: this
        idle peer first caught up with its mates for the call, so long: not its compute, which a
        trainer's probe of a peer withheld for slowness judges, StageWiring.completed)."""
        if self.state != Phase.SERVING:
            raise busy(f"this peer is {self.state}")
        step, mb, samples = self._check_meta(req.meta)
        version = req.meta.get("version")
        if version is not None and (type(version) is not int or version < 0):
            raise bad_input("version, when given, must be an int >= 0 (the one a forward reply named)")
        x, other = await self._check_tensors(kind, req.tensors, samples)
        loop = asyncio.get_running_loop()
        arrived, catching_up = loop.time(), self._wanted(step)
        replay = await self._gate(step, req.deadline, req.peer.peer_id)
        gated_s = loop.time() - arrived
        if self.state != Phase.SERVING:
            raise busy(f"this peer is {self.state}")
        admission = self.core.admit(loop.time(), step, mb) if kind != FORWARD and not replay else Admission.REPEAT
        # Batched losses are split per microbatch with `sample_losses`; a stage without it runs alone.
        solo = kind == FORWARD_BACKWARD and not hasattr(self.stage, "sample_losses")
        work = Work(kind, step, mb, x, other, admission == Admission.ACCUMULATE, loop.create_future(),
                    epoch=self._state_epoch, solo=solo, replay=replay, version=version, deadline=req.deadline)
        # Whatever becomes of the call (answered, failed, refused, its caller gone), its claim is
        # released once its compute is over unless the gradient went in (I3: no claim leak).
        epoch = self.core.epoch
        work.future.add_done_callback(lambda future: self._settled(work, epoch, future))
        answer = await self._run_work(work)
        admitted = {"duplicate": admission == Admission.REPEAT, "added": work.added,
                    "held_by_mate": admission == Admission.HELD_BY_MATE, "version": work.used}
        if catching_up:
            admitted["caught_up_s"] = gated_s
        return answer, {**admitted, "replayed": True} if replay else admitted

    def _settled(self, work: Work, epoch: int, future: asyncio.Future) -> None:
        if not future.cancelled():
            future.exception()  # retrieved here: its caller may be gone
        if work.accumulate:
            self.core.settled(work.step, work.mb, epoch, work.added)

    def _check_meta(self, meta: dict) -> tuple[int, int, int]:
        step, mb, samples = meta.get("step"), meta.get("mb"), meta.get("samples")
        if type(step) is not int or type(mb) is not int or type(samples) is not int:
            raise bad_input("meta must carry int 'step', 'mb' and 'samples'")
        if mb not in self.step_ids(step):
            raise bad_input(f"microbatch {mb} does not belong to step {step} "
                            f"({self.microbatches} microbatches per step)")
        if not 1 <= samples <= self.spec.batch.microbatch_samples:
            raise bad_input(f"samples is {samples}, must be 1..{self.spec.batch.microbatch_samples}")
        return step, mb, samples

    async def _check_tensors(self, kind: str, tensors: list[torch.Tensor], samples: int):
        """Count, shapes and dtypes (cheap, here), then values: finite floats, ids in the vocabulary
        (a pass over the data: off the event loop when the tensors are large)."""
        expected = 1 if kind == FORWARD else 2
        if len(tensors) != expected:
            raise bad_input(f"stage.{kind} takes {expected} tensor(s), got {len(tensors)}")
        T = self.spec.data.seq_len
        named = [(tensors[0], self.stage.input_spec(samples, T), "x")]
        if kind == BACKWARD:
            named.append((tensors[1], self.stage.output_spec(samples, T), "grad_y"))
        elif kind == FORWARD_BACKWARD:
            named.append((tensors[1], self.stage.target_spec(samples, T), "targets"))
        for tensor, spec, what in named:
            reason = spec.mismatch(tensor)
            if reason is not None:
                raise bad_input(f"{what}: {reason}")
        if sum(t.numel() for t, _, _ in named) > INLINE_CHECK_ELEMENTS:
            problem = await asyncio.to_thread(self._value_problem, named)
        else:
            problem = self._value_problem(named)
        if problem is not None:
            raise bad_input(problem)
        return tensors[0], (tensors[1] if kind != FORWARD else None)

    def _value_problem(self, named: list) -> str | None:
        vocab = self.spec.model.config.vocab
        for tensor, _, what in named:
            if tensor.is_floating_point():
                if not bool(torch.isfinite(tensor).all()):
                    return f"{what} holds non-finite values"
            elif tensor.numel() and (int(tensor.min()) < 0 or int(tensor.max()) >= vocab):
                return f"{what}: token ids must be in [0, {vocab})"
        return None

    async def _gate(self, step: int, deadline: float | None, caller: bytes | None) -> bool:
        """Work for a later step waits here for this peer's commit, up to the call's deadline, in one
        of the `parked` slots (`max_waiting`, `max_waiting_per_peer` of them for `caller`); a call
        more than `max_steps_ahead` steps ahead parks only while this peer is taking that step up
        (`_resume_at`) or has a mate ahead to download from, else it is answered `not_ready` at once.
        True: the step was just committed and this peer still holds its parameters (a replay)."""
        loop = asyncio.get_running_loop()
        ahead = 1 if self.spec.pipeline.delayed_updates else 0
        while True:
            committed = self.committed
            if step < committed:
                previous = self._previous
                if previous is not None and previous.step == step:
                    return True
                raise StaleStep(step, committed).to_rpc()
            if self.core.accepts(step):
                return False
            look = await self._resume_at(step - ahead)
            if look is Look.TAKEN or self.committed != committed:
                continue
            # Further ahead, a call waits only while this peer is about to move: taking the swarm's
            # step up, or behind a mate it will download from (the sync loop's catch-up).
            moving = look is Look.PENDING or self.core.mate_ahead()
            if step - ahead - committed > self.limits.max_steps_ahead and not moving:
                raise not_ready(f"step {step} is {step - ahead - committed} steps past this peer's step {committed}; "
                                f"calls wait for at most {self.limits.max_steps_ahead} (max_steps_ahead)")
            now = loop.time()
            until = now + self.limits.max_wait_s
            if deadline is not None:
                # Answer before the transport's own deadline does, so the caller learns why.
                until = min(until, deadline - min(0.25, (deadline - now) / 10))
            if until <= now:
                raise not_ready(f"step {step} arrived; this peer has committed {committed} steps")
            # Wake at least every progress_timeout_s to look again whether the stage lost steps
            # (`_resume_at`): a look can fail on a slow or unreachable peer, and no commit may come.
            wake = min(until, now + self.limits.progress_timeout_s)
            with self.parked.hold(caller):
                try:
                    async with asyncio.timeout_at(wake):
                        await self._committed_event.wait()
                except TimeoutError:
                    if wake >= until:
                        raise not_ready(f"step {step} arrived; this peer has committed {self.committed} steps "
                                        f"and did not commit in time") from None

    def _wanted(self, step: int) -> bool:
        """Tell the core a call for `step` came; True when this peer, idle and behind it
        (`StageCore.wanted`), starts catching up now, in a task of the stage's (the call, parked in
        `_gate` like any call for a later step, must not cancel it by leaving). Its state says
        `joining` at once, so the sync loop does not download as well."""
        held = self.accumulator.progress(self.committed).ids
        download = self.core.wanted(asyncio.get_running_loop().time(), step, held)
        if download is None:
            return False
        self.state = Phase.JOINING
        self.spawn(self.catch_up(download), "catch-up for a call")
        return True

    async def _resume_at(self, target: int) -> Look:
        """Skip the steps this stage lost, when the rest of the swarm shows they were committed.

        A stage whose every peer died restarts from its newest checkpoint (step c), while the other
        stages and the trainers went on to step s > c. Nobody will ever send work for steps c..s-1
        again (the trainers hold only step s), so waiting for their commits deadlocks the job. The
        updates of those steps are lost with the peers that held them; the stage takes up the
        swarm's step with its checkpointed parameters (the LR schedule continues at s), as a
        pipeline resumed from per-stage checkpoints must. Gradients this peer holds for its old
        step go with them: its mates that committed that step died, so nobody will complete it
        (I3: such a survivor is not stuck).

        Each look must find no stage-mate ahead nor silent (a mate ahead must be downloaded from,
        which the sync loop does: the everyday case of a peer that commits a moment after its
        mates, which must never skip), the job's submitter's signed progress at `target` or past it,
        and a peer of another stage answering that too (`swarmd.stage.resume.proven_step`: neither
        a trainer's call nor another stage's answer is evidence alone, anyone can send them,
        adversary R3); the core allows the jump once every look for `resume_after_s` agreed.
        `Look.TAKEN` when this peer now accepts work for `target`, `Look.PENDING` while its looks
        agree but not yet for that long.
        """
        async with self._resume_lock:
            if self.committed >= target:
                return Look.TAKEN
            looks_alone = await self._behind_alone(target)
            if not self.core.behind_alone(asyncio.get_running_loop().time(), looks_alone):
                return Look.TAKEN if self.committed >= target else Look.PENDING if looks_alone else Look.NO
            lost_from = self.committed

            def jump() -> None:
                with self.guard.write():
                    self.opt.step_count = target
                    self.accumulator.clear()
                    self._state_digest = jump_digest(self._state_digest, target)
                    self._state_epoch += 1
                    self._previous = None

            await self.in_aux(jump)
            self.core.jumped(target)
            self.skipped.append((lost_from, target))
            log.warning("stage %d resumed at step %d with the state of step %d: the swarm went on without "
                        "it, so its updates of steps %d to %d are lost", self.stage_index, target, lost_from,
                        lost_from, target - 1)
            self._notify_commit()
            return Look.TAKEN

    async def _behind_alone(self, target: int) -> bool:
        """Does this look find the swarm at `target` and no mate of this stage that may be ahead?"""
        if target >= self.spec.steps or self.core.round_id is not None or self.core.mate_ahead():
            return False
        # A directory backed by the DHT fails in many ways (its errors, the transport's, timeouts);
        # such a failed look is a "not now". Anything else is a bug and reaches the sync loop's
        # supervisor.
        try:
            await self.sync.poll()
            if self.core.mate_ahead() or self.core.mate_slow():
                return False  # a mate holds (or may hold) newer state: the sync loop downloads it
            anchored = await self.anchor() if self.anchor is not None else None
            if anchored is None or anchored < target:
                # Nothing proves more than the submitter's record: no other stage need be asked (a
                # stranger's calls for far steps cost one record read, not a call to every peer).
                self._unproven(target, anchored)
                return False
            answered = await self._other_stages_steps() if self.spec.pipeline.stages > 1 else None
        except (SwarmdError, TransportError, RpcError, OSError, TimeoutError) as exc:
            log.debug("stage %d: cannot check whether the swarm is ahead: %s", self.stage_index, exc)
            return False
        return proven_step(anchored, answered) >= target and self.committed < target

    def _unproven(self, target: int, anchored: int | None) -> None:
        """Say once per step why a call for it does not move this peer: a stage that waits here for
        good (its submitter publishes no progress) must show why in the log. At most one line per
        `resume_after_s`, whatever steps strangers call for."""
        now = asyncio.get_running_loop().time()
        last_target, last_at = self._unproven_logged
        if target != last_target and now - last_at >= self.limits.resume_after_s:
            self._unproven_logged = (target, now)
            signed = "publishes no progress" if anchored is None else f"signed {anchored} steps committed"
            log.info("stage %d at step %d: asked for step %d, but the job's submitter %s; not taking it up "
                     "(docs/security.md, R3)", self.stage_index, self.committed, target, signed)

    async def _other_stages_steps(self) -> list[int]:
        """The steps the live peers of the job's other stages answer (-1: a peer that did not)."""
        addrs = []
        for stage in range(self.spec.pipeline.stages):
            if stage != self.stage_index:
                addrs += [(stage, p.addr) for p in await self.directory.peers(self.job_id, stage)]

        async def step_of(stage: int, addr: str) -> int:
            try:
                reply = await self.pool.call(addr, "stage.info", Message({"job": self.job_id, "stage": stage},
                                                                         codec="none"),
                                             timeout=self.limits.progress_timeout_s)
            except (TransportError, RpcError):
                return -1
            step = reply.meta.get("step")
            return step if type(step) is int else -1

        return list(await asyncio.gather(*(step_of(stage, addr) for stage, addr in addrs)))

    def _notify_commit(self) -> None:
        self.sync.mailbox.retire(self.committed - 1)  # rounds of steps behind us can never finish
        event, self._committed_event = self._committed_event, asyncio.Event()
        event.set()

    # ------------------------------------------------------------------------ info and state

    async def info(self, req: Request) -> Message:
        """`stage.info`: this peer's progress. Given `until_step` and `wait_s`, a long-poll: while this
        peer has committed no step past `until_step`, the answer waits for a commit that does
        (`_wait_past`), so a trainer watching for a commit hears of it one reply leg after it happens
        instead of at its next poll."""
        until_step, wait_s = _long_poll(req.meta)
        if until_step is not None:
            await self._wait_past(until_step, wait_s, req)
        progress = self.accumulator.progress(self.committed) if self.state != "stopped" else None
        last = asdict(self.records[-1]) if self.records else None
        return Message({
            "step": self.committed, "state": BEHIND if self.core.behind() else str(self.state),
            "digest": self.digest, "queue": self.executor.depth, "catch_ups": self.catch_ups,
            "accumulated_samples": progress.samples if progress else 0,
            "samples_per_s": self.executor.samples_per_s,
            "missing": self.sync.missing, "uncovered": self.sync.uncovered,
            "dropped_repeats": self.core.repeats(self.committed),
            "last_step": last, "round_failure": self.sync.last_failure,
            "skipped": [list(jump) for jump in self.skipped],
            "round_protocol": ROUND_PROTOCOL, "allreduce_codec": self.limits.allreduce_codec,
        }, codec="none")

    async def _wait_past(self, step: int, wait_s: float, req: Request) -> None:
        """Until this peer has committed past `step`, for at most `wait_s`, `max_wait_s`, and until
        shortly before the call's deadline (the answer, not the transport's timeout, must reach the
        caller), in one of the `watchers` slots. With no slot free (in all, or for this caller) it
        returns at once: the caller gets a plain answer and polls again, where a `busy` would only
        make it retry sooner. An idle peer answers at once too: it holds nothing of the step and
        commits one only when it next catches up (`idle_catch_up_s`), so its wait would only hold
        the trainer's commit watch (its stragglers' clock: measured, every step of a slow-peer
        window 0.5 s longer once the withheld peer was idle)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self.core.idle():
            return
        until = now + min(wait_s, self.limits.max_wait_s)
        if req.deadline is not None:
            until = min(until, req.deadline - min(0.25, max(0.0, req.deadline - now) / 10))
        caller = req.peer.peer_id
        if self.committed > step or until <= now or not self.watchers.free(caller):
            return
        with self.watchers.hold(caller):
            while self.committed <= step and until > loop.time():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(until):
                        await self._committed_event.wait()

    async def state_stream(self, req: Request) -> AsyncIterator[Message]:
        """`stage.state`: this peer's state for a joiner, in one of the `streams` slots, ended
        (its slot and copy freed) when the reader stops taking it (`StallWatch`); refused while
        this peer is behind its mates (idle: StageCore.behind)."""
        if self.state != Phase.SERVING:
            raise busy(f"this peer is {self.state}")
        if self.core.behind():  # a joiner or an export must not take an old state for its stage's
            raise busy(f"this peer is behind its stage-mates (at step {self.committed}): download from one of them")
        with self.streams.hold(req.peer.peer_id):
            snapshot = await self.in_aux(self.snapshot)
            watch = StallWatch(self.limits.state_stall_s, self.limits.state_min_rate_bytes_s,
                               f"stage {self.stage_index} state stream to {_caller(req)}")
            try:
                for message in snapshot_messages(snapshot, self.limits.state_chunk_bytes):
                    watch.handing(sum(t.numel() * t.element_size() for t in message.tensors))
                    yield message
                    watch.taken()
            finally:
                watch.close()

    def snapshot(self) -> Snapshot:
        with self.guard.read():
            snapshot = take_snapshot(self.stage, self.opt)
            snapshot.digest = self._state_digest  # written under the guard with the parameters
            return snapshot

    # ------------------------------------------------------------------------ stage-mates

    async def sync_progress(self, req: Request) -> Message:
        return self.sync.progress_reply()

    async def sync_round(self, req: Request) -> Message:
        return self.sync.join(req)

    async def sync_reduce(self, req: Request) -> Message:
        return self.sync.receive(req, gather=False)

    async def sync_gather(self, req: Request) -> Message:
        return self.sync.receive(req, gather=True)

    async def sync_abort(self, req: Request) -> Message:
        return self.sync.abort(req)

    def flatten(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """The gradient sums as one fp32 CPU vector in parameter order (zeros where none arrived)."""
        parts = [torch.zeros(p.numel()) if g is None else g.detach().reshape(-1).float().cpu()
                 for p, g in zip(self.params, grads)]
        return torch.cat(parts) if parts else torch.zeros(0)

    async def commit(self, step: int, round_id: bytes, flat: torch.Tensor, members: list[bytes], plan: RoundPlan,
                     outliers: tuple[str, ...] = ()) -> None:
        """Take the optimizer step on the all-reduced gradient sum (every member does the same)."""
        def step_now():
            with self.guard.write():
                if self.committed != step or self.opt.step_count != step:
                    raise RoundFailed(f"step {step} is no longer current (at {self.committed})")
                if self.limits.replay_previous:
                    kept = {name: p.detach().clone() for name, p in self.stage.named_parameters()}
                    self._previous = Previous(step, kept)
                offset = 0
                for p in self.params:
                    n = p.numel()
                    p.grad = flat[offset: offset + n].view_as(p).to(p.device, p.dtype, copy=True)
                    offset += n
                try:
                    report = self.opt.step(self.spec.batch.global_samples)
                except NonFiniteGradient as exc:
                    report = self._skip_step(exc)
                self._settle()
                late = self.accumulator.finish(step)
                self._state_digest = next_digest(self._state_digest, step, round_id)
                # Copied here, under the guard, so the checkpoint holds exactly this step.
                return report, late, take_snapshot(self.stage, self.opt) if self._checkpoint_due() else None

        repeats = self.core.repeats(step)
        report, late, snapshot = await asyncio.shield(self.in_aux(step_now))
        self.core.committed(asyncio.get_running_loop().time(), step, round_id, members[0], members)
        record = StepRecord(step, len(members), plan.samples, 0, repeats + late, report.lr,
                            report.grad_norm, report.clipped, outliers, len(plan.left_out), self.digest.hex())
        self.records.append(record)
        if record.dropped_repeats or record.left_out:
            log.info("stage %d step %d: %d copies of microbatches not summed, %d members' sums left out",
                     self.stage_index, step, record.dropped_repeats, record.left_out)
        self._notify_commit()
        if snapshot is not None:
            snapshot.digest = self._state_digest
            self.spawn(self._checkpoint(snapshot), f"checkpoint {snapshot.step}")

    def _checkpoint_due(self) -> bool:
        every = self.spec.checkpoint.every_steps
        return self.state_dir is not None and every > 0 and self.opt.step_count % every == 0

    def _skip_step(self, exc: NonFiniteGradient) -> StepReport:
        """Every member reduced the same non-finite gradient: all skip the update alike (as AMP's
        GradScaler does) but commit the step, so the stage stays consistent and live instead of
        retrying a round that can only fail again. The record shows grad_norm inf. Under fp16 an
        overflow is how the loss scale finds its level (the optimizer has halved it already)."""
        if self.opt.scaler is not None:
            log.warning("stage %d step %d: %s; update skipped, loss scale now %g", self.stage_index,
                        self.committed, exc, self.opt.loss_scale)
        else:
            log.error("stage %d step %d: %s; update skipped", self.stage_index, self.committed, exc)
        lr = self.opt.lr
        self.opt.optimizer.zero_grad(set_to_none=True)
        report = StepReport(self.opt.step_count, lr, math.inf, False)
        self.opt.step_count += 1
        return report

    def _settle(self) -> None:
        """On CUDA the step's kernels are queued, not done: finish them before compute (on the
        stage's own stream) may read the parameters again."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    async def _checkpoint(self, snapshot: Snapshot) -> None:
        # One write at a time, in commit order: a later write prunes only older, finished files.
        async with self._checkpoint_lock:
            path = await asyncio.to_thread(ckpt.write_checkpoint, self.state_dir, snapshot, self.stage_index,
                                           self.limits.checkpoints_kept)
        log.info("stage %d wrote %s", self.stage_index, path)


def _long_poll(meta: dict[str, Any]) -> tuple[int | None, float]:
    """`stage.info`'s optional long-poll fields, checked at the edge: (until_step, wait_s), or
    (None, 0) for a plain call. Both or neither; until_step an int, wait_s a number >= 0."""
    until_step, wait_s = meta.get("until_step"), meta.get("wait_s")
    if until_step is None and wait_s is None:
        return None, 0.0
    if type(until_step) is not int or isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) \
            or not wait_s >= 0:
        raise bad_input("stage.info's long-poll needs int until_step and wait_s >= 0, both")
    return until_step, float(wait_s)


def _caller(req: Request) -> str:
    """Who called, for a log line: the proven peer id (short hex), else the address."""
    peer_id = req.peer.peer_id
    return f"peer {peer_id.hex()[:16]}" if peer_id is not None else f"{req.peer.address}"


class StallWatch:
    """Ends a stream whose reader stops taking it. A stream handler runs in the transport's task for
    the call, suspended at each `yield` until the transport has taken the message (which waits for
    the reader's window), so the handler cannot time that wait itself; this watch cancels the task
    when a message is not taken by its deadline: `stall_s` after the previous one was, plus the
    time its bytes and the previous message's take at `min_rate` (the previous one must leave
    first). The transport then drops what is queued and the handler's `finally` frees its slot."""

    def __init__(self, stall_s: float, min_rate: float, what: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._stall_s, self._min_rate, self._what = stall_s, min_rate, what
        self._since = self._loop.time()
        self._previous = 0
        self._timer: asyncio.TimerHandle | None = None

    def handing(self, nbytes: int) -> None:
        """A message of `nbytes` payload bytes is handed to the transport now."""
        allowed = self._stall_s + (self._previous + nbytes) / self._min_rate
        self._previous = nbytes
        self._timer = self._loop.call_at(self._since + allowed, self._cut, allowed)

    def taken(self) -> None:
        self.close()
        self._since = self._loop.time()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _cut(self, allowed: float) -> None:
        self._timer = None
        log.info("%s ended: a message was not taken within %.1f s (state_stall_s, state_min_rate_bytes_s)",
                 self._what, allowed)
        if self._task is not None:
            self._task.cancel(f"{self._what} stalled")
