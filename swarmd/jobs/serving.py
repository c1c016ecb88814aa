"""The stages this daemon serves: one `StageService` per (job, stage), announced in the DHT.

The announcement is refreshed by the DHT node's announce loop (well inside its expiry) with the
service's live fields, and withdrawn before the service stops, so trainers stop routing to a
draining peer at their next directory refresh rather than at the record's expiry.

Joins, rebalancing moves and leaving an ended job's stage change the served set, each over many
awaits; one lock (`_joins`) serialises them, so a move never races a join of the stage it moves to
(two services for one stage) and a leave never stops a stage a move is replacing. A join asked for
during a move waits for it; a move asked for during a join is skipped with its reason (the
rebalancer checks again next period, on a view that then includes the join).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmd.directory import StagePeer
from swarmd.errors import Busy
from swarmd.dht.errors import DHTError
from swarmd.job.budget import check_stage_fits, default_stage_memory
from swarmd.jobs.directory import announcement_value, stage_key
from swarmd.jobs.moving import JOINING, MOVES_KEPT, MoveRecord, Moving, serving_peers
from swarmd.jobs.probing import Prober
from swarmd.model.export import ExportError
from swarmd.model.precision import PrecisionError
from swarmd.rebalance.mover import MoveFailed
import swarmd.stage.checkpoint as ckpt
from swarmd.stage.limits import StageLimits
from swarmd.stage.resume import ProgressAnchor
from swarmd.stage.service import StageService
from swarmd.stage.state import StateError
from swarmd.supervisor import Supervisor
from swarmd.values import DHTValues
from transport.errors import RpcError, TransportError

log = logging.getLogger(__name__)


@dataclass
class Served:
    service: StageService
    announcement: Any


class Serving:
    def __init__(self, dht: Any, router: Any, pool: Any, directory: Any, *, peer_id: bytes, address: str,
                 device: str, state_dir: Path, limits: StageLimits, max_stages: int, max_stage_memory: int = 0,
                 supervisor: Supervisor | None = None, prober: Prober | None = None) -> None:
        self.supervisor = supervisor or Supervisor("stages")
        self.prober = prober  # the daemon's: a move leaves a stage only to peers that answered
        self.dht, self.router, self.pool, self.directory = dht, router, pool, directory
        self.values = DHTValues(dht)
        self.peer_id, self.address, self.device = peer_id, address, device
        self.state_dir, self.limits, self.max_stages = state_dir, limits, max_stages
        self.max_stage_memory = max_stage_memory or default_stage_memory(device, max_stages)
        self.served: dict[tuple[bytes, int], Served] = {}
        self._joins = asyncio.Lock()
        self.moving: dict[bytes, Moving] = {}  # job id -> the rebalancing move under way
        self.moves: collections.deque[MoveRecord] = collections.deque(maxlen=MOVES_KEPT)

    async def serve(self, spec: Any, job_id: bytes, stage: int, *, submitter: bytes) -> StageService:
        """Join `stage` of the job (download state from a mate, else a checkpoint, else fresh init).
        `submitter`: the public key the job id was checked against (`Job.submitter`), whose signed
        progress alone lets the stage skip steps it lost. One join at a time: `swarmctl serve` and
        automatic joining may ask for the same stage at once."""
        async with self._joins:
            return await self._serve(spec, job_id, stage, submitter)

    async def _serve(self, spec: Any, job_id: bytes, stage: int, submitter: bytes) -> StageService:
        if (job_id, stage) in self.served:
            return self.served[(job_id, stage)].service
        if len(self.served) >= self.max_stages:
            raise Busy(f"already serving {len(self.served)} stages (jobs.max_stages = {self.max_stages})")
        check_stage_fits(spec, stage, self.max_stage_memory, microbatches_at_once=self.limits.max_batch * self.limits.workers)
        service = StageService(spec, job_id, stage, self.peer_id, self.router, self.pool, self.directory,
                               address=self.address, device=self.device, limits=job_limits(self.limits, spec),
                               state_dir=self.state_dir, supervisor=self.supervisor,
                               anchor=submitter_progress(self.values, job_id, submitter, spec.steps))
        await service.start()
        ann = self.dht.announce(stage_key(job_id, stage),
                                lambda: announcement_value(self.address, service.announcement()))
        self.served[(job_id, stage)] = Served(service, ann)
        return service

    async def move(self, job_id: bytes, from_stage: int, to_stage: int, *, drain_timeout_s: float = 30.0) -> MoveRecord:
        """Serve `to_stage` of the job instead of `from_stage` (rebalancing), losing no sample.

        Drain the old stage (`StageService.drain`: no new work, queued work finished, what it
        accumulated re-sent by the trainers), join the new one by downloading a live mate's state,
        announce it, then withdraw and stop the old one. Any failure raises `MoveFailed` with the
        old stage serving again; a cancelled move is undone the same way. Skipped (`MoveFailed`)
        while a join or a leave is under way here; joins and leaves asked for meanwhile wait.
        """
        if self._joins.locked():
            raise MoveFailed(f"a join or leave is under way on this daemon; not moving job {job_id.hex()[:16]} "
                             f"from stage {from_stage} to {to_stage} now")
        async with self._joins:
            return await self._move(job_id, from_stage, to_stage, drain_timeout_s)

    async def _move(self, job_id: bytes, from_stage: int, to_stage: int, drain_timeout_s: float) -> MoveRecord:
        old, mates = await self._check_move(job_id, from_stage, to_stage)
        moving = self.moving[job_id] = Moving(from_stage, to_stage, old.service.executor.samples_per_s)
        started = time.monotonic()
        drained_at = started
        key = stage_key(job_id, from_stage)
        new: StageService | None = None
        try:
            old.announcement = self.dht.announce(key, old.announcement.value_fn)  # say "draining" now
            if not await old.service.drain(drain_timeout_s):
                log.warning("stage %d: work still queued after %g s of draining; moving anyway", from_stage,
                            drain_timeout_s)
            drained_at = time.monotonic()
            moving.phase = JOINING
            new = StageService(old.service.spec, job_id, to_stage, self.peer_id, self.router, self.pool,
                               self.directory, address=self.address, device=self.device,
                               limits=job_limits(self.limits, old.service.spec), state_dir=self.state_dir,
                               supervisor=self.supervisor, anchor=old.service.anchor)
            await self._join_from_mates(new, to_stage, mates)
            ann = self.dht.announce(stage_key(job_id, to_stage),
                                    lambda: announcement_value(self.address, new.announcement()))
            self.served[(job_id, to_stage)] = Served(new, ann)
            del self.served[(job_id, from_stage)]
        except BaseException as exc:
            await self._undo_move(old, key, new, job_id, to_stage)
            self._record_move(job_id, from_stage, to_stage, started, drained_at, -1, str(exc) or type(exc).__name__)
            if isinstance(exc, (DHTError, TransportError, RpcError, StateError, OSError)):
                raise MoveFailed(f"moving to stage {to_stage}: {exc}") from exc
            raise
        finally:
            del self.moving[job_id]
        await self.dht.withdraw(old.announcement)
        await old.service.stop()
        record = self._record_move(job_id, from_stage, to_stage, started, drained_at, new.committed)
        log.info("moved from stage %d to stage %d of job %s in %.1f s (%.1f s draining), at step %d", from_stage,
                 to_stage, job_id.hex()[:16], record.total_s, record.drain_s, new.committed)
        return record

    async def _check_move(self, job_id: bytes, from_stage: int, to_stage: int) -> tuple[Served, list[StagePeer]]:
        """The served stage to move and the live mates of the target stage, or `MoveFailed` saying
        why this move cannot be made now."""
        old = self.served.get((job_id, from_stage))
        if old is None:
            raise MoveFailed(f"not serving stage {from_stage} of job {job_id.hex()[:16]}")
        stages = old.service.spec.pipeline.stages
        if not 0 <= to_stage < stages or to_stage == from_stage:
            raise MoveFailed(f"no move from stage {from_stage} to stage {to_stage} of a {stages}-stage pipeline")
        if (job_id, to_stage) in self.served or job_id in self.moving:
            raise MoveFailed(f"already serving stage {to_stage}, or already moving, in job {job_id.hex()[:16]}")
        try:
            stays = await serving_peers(self.directory, job_id, from_stage, self.peer_id, self.prober)
            mates = await serving_peers(self.directory, job_id, to_stage, self.peer_id, self.prober)
        except (DHTError, TransportError, OSError) as exc:
            raise MoveFailed(f"the stage directory did not answer: {exc}") from exc
        if not stays:
            raise MoveFailed(f"no other peer of stage {from_stage} answered as serving it: moving would empty it")
        if not mates:
            raise MoveFailed(f"no live peer serves stage {to_stage} to download its state from")
        return old, mates

    @staticmethod
    async def _join_from_mates(new: StageService, to_stage: int, mates: list[StagePeer]) -> None:
        """Start the moved-to stage; it must have downloaded a mate's state, not begun afresh behind them."""
        try:
            await new.start()
        except (TransportError, RpcError, StateError, OSError, ExportError, PrecisionError) as exc:
            raise MoveFailed(f"stage {to_stage} did not start: {exc}") from exc
        behind = min(m.step for m in mates)
        if new.committed < behind:
            raise MoveFailed(f"no mate of stage {to_stage} gave its state (at step {new.committed}, "
                             f"mates at {behind}+)")

    async def _undo_move(self, old: Served, key: bytes, new: StageService | None, job_id: bytes, to_stage: int) -> None:
        """Serve the old stage again: the new one stopped (unless it already replaced the old), the
        old one undrained and announced at `key` as serving."""
        if new is not None and (job_id, to_stage) not in self.served:
            await asyncio.shield(new.stop())
        if old.service.state == "draining":
            old.service.undrain()  # behind its mates now: its sync catches up by download
            old.announcement = self.dht.announce(key, old.announcement.value_fn)

    def _record_move(self, job_id: bytes, from_stage: int, to_stage: int, started: float, drained_at: float,
                     step: int, error: str = "") -> MoveRecord:
        """Keep the move's phase times among the recent moves (`MOVES_KEPT`) and return its record."""
        total = time.monotonic() - started
        record = MoveRecord(job_id.hex(), from_stage, to_stage, drained_at - started, total - (drained_at - started),
                            total, step, error)
        self.moves.append(record)
        return record

    async def leave(self, job_id: bytes, stage: int) -> bool:
        """Stop serving a stage of an ended job: announcement withdrawn (trainers and mates stop
        using us), a final checkpoint of its state, then the service stopped and dropped (its memory
        goes with it; `served-stages.json` forgets it at the next check). False if not served."""
        async with self._joins:
            item = self.served.get((job_id, stage))
            if item is None:
                return False
            await self.dht.withdraw(item.announcement)
            try:
                await final_checkpoint(item.service)
            except OSError as exc:
                log.warning("stage %d of job %s: no final checkpoint: %s", stage, job_id.hex()[:16], exc)
            finally:
                del self.served[(job_id, stage)]
                await item.service.stop()
            return True

    def outliers(self, job_id: bytes) -> list[tuple[int, int, tuple[str, ...]]]:
        """(stage, step, hex peer ids) of the recent steps in which a stage served here found
        outliers in its all-reduce, oldest first. Only what this daemon's own stages saw, from
        their step records (so at most `StageLimits.records_kept` steps per stage, and nothing once
        the stage is left)."""
        found = [(stage, r.step, r.outliers) for (job, stage), item in self.served.items() if job == job_id
                 for r in item.service.records if r.outliers]
        return sorted(found, key=lambda f: (f[1], f[0]))

    def stages(self) -> list[str]:
        return [f"{job_id.hex()[:16]}/{stage}" for job_id, stage in sorted(self.served)]

    async def close(self) -> None:
        """Drain: withdraw every announcement first, then stop the services."""
        served, self.served = list(self.served.values()), {}
        for item in served:
            await self.dht.withdraw(item.announcement)
        for item in served:
            await item.service.stop()


def submitter_progress(values: DHTValues, job_id: bytes, submitter: bytes, steps: int) -> ProgressAnchor:
    """The steps committed that the job's submitter signed in its progress record (None: no record):
    what a stage that lost steps may take up (`swarmd.stage.resume`). Read through the node's short
    cache (`get_cache_max_s`) rather than looked up afresh at every look: the record changes only
    at its submitter's join pace (`jobs.join_interval_s`)."""
    async def anchored() -> int | None:
        progress = await values.progress(job_id, submitter, steps, latest=False)
        return None if progress is None else progress.step

    return anchored


def job_limits(limits: StageLimits, spec: Any) -> StageLimits:
    """The daemon's stage limits with the job's all-reduce aggregate (`[optim] aggregate`, `clip_tau`,
    `clip_iterations`, `outlier_factor`) and codec (`[wire] allreduce`). Every member of a round must
    combine its parts alike, or their verdicts on the same peer differ, and the codec decides how
    close the job's steps are to exact; the spec, hashed into the job id, is what they share, so a
    daemon's own setting of these fields never reaches a job's stage."""
    optim = spec.optim
    return dataclasses.replace(limits, aggregate=optim.aggregate, clip_tau=optim.clip_tau,
                               clip_iterations=optim.clip_iterations, outlier_factor=optim.outlier_factor,
                               allreduce_codec=spec.wire.allreduce)


async def final_checkpoint(service: StageService) -> Path | None:
    """Write the stage's current state to its checkpoint dir (None without a state dir). Taken
    under the stage's checkpoint lock, so it never overlaps (or is pruned by) a periodic write."""
    if service.state_dir is None:
        return None
    snapshot = await service.in_aux(service.snapshot)
    async with service._checkpoint_lock:
        path = await asyncio.to_thread(ckpt.write_checkpoint, service.state_dir, snapshot, service.stage_index,
                                       service.limits.checkpoints_kept)
    log.info("stage %d wrote its final checkpoint %s", service.stage_index, path)
    return path
