"""Trainers running inside the daemon, their events buffered on the job for `job.logs`.

A job submitted with `trainers = K` runs shards 0..K-1 here; `job.train {job, data, shard, shards}`
runs one more shard in another daemon (shard k of K: each trainer starts every step with its share of
the microbatches and takes over shares that stay undone, so a dead trainer's work is done by the
others; docs/trainer.md).

The bans this daemon's trainers of a job made are kept for `job.get` (`bans`): a live trainer's from
the trainer itself, a finished one's copied onto the job (bounded by `TrainerConfig.ban_log_kept`)
so its data can go. Only this daemon's trainers: bans are what one trainer saw, not swarm-wide.

Each trainer runs under the daemon's `Supervisor`: a `TrainerError` (the trainer's own verdict that
it cannot go on: inputs refused, a step lost) fails the job here as before, while any other error
(a bug, a value nobody foresaw) is logged with its traceback, shown in `swarmctl status` and the
trainer run again after a backoff, from the swarm's current step.

A trainer stops when its job ends swarm-wide (the submitter's signed end record, learned by the
joining loop): a cancelled job's trainers on other daemons would otherwise retry forever against
stages that have left.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from typing import Any

from swarmd.job import TokenDataset, TrainingData, read_tokens
from swarmd.jobs.registry import FINAL_STATES, Job
from swarmd.metrics import EVAL_OUTCOMES
from swarmd.supervisor import Supervisor
from swarmd.train.errors import TrainerError
from swarmd.train.events import StatusEvent, StepEvent
from swarmd.train.trainer import BanRecord, Trainer, TrainerConfig
from transport.tasks import TaskSet

log = logging.getLogger(__name__)

#: Step commits the job's samples/s is measured over (a minute or so of a typical run's steps).
RATE_WINDOW = 10
#: Seconds a trainer still gets once its job is recorded finished: the submitter's trainer saw the
#: last step committed, and this one, polling the same stages, is about to (its last step's event
#: would be lost otherwise); the stages leave at their daemons' next join tick, so it is short.
FINISH_GRACE_S = 10.0


async def _expire_on_end(job: Job, scope: asyncio.Timeout) -> None:
    """Expire `scope`, stopping the trainer inside it, once the job ends swarm-wide: at once, or
    `FINISH_GRACE_S` later when it ended done (the trainer is about to see the last commit)."""
    await job.end_seen.wait()
    grace = FINISH_GRACE_S if job.ended is not None and job.ended.state == "done" else 0.0
    scope.reschedule(asyncio.get_running_loop().time() + grace)


class Training:
    def __init__(self, pool: Any, directory: Any, config: TrainerConfig = TrainerConfig(),
                 supervisor: Supervisor | None = None) -> None:
        self.pool, self.directory, self.config = pool, directory, config
        self.supervisor = supervisor or Supervisor("trainers")
        self._tasks = TaskSet("trainers")
        self._running: dict[bytes, int] = {}
        self._trainers: dict[bytes, list[asyncio.Task]] = {}
        self._commits: dict[bytes, collections.deque[tuple[int, float]]] = {}  # job -> (step, commit time)
        self._live: dict[bytes, list[Trainer]] = {}  # job -> its trainers still running here
        self._past_bans: dict[bytes, collections.deque[BanRecord]] = {}  # job -> bans of its finished trainers
        # Held-out evaluations this daemon's trainers ran, by outcome, and the last loss (any job):
        # read by the metrics at scrape time.
        self.evaluations: dict[str, int] = dict.fromkeys(EVAL_OUTCOMES, 0)
        self.last_eval_loss = math.nan

    async def start(self, job: Job, shards: range, of: int) -> None:
        """Open the job's data (off the loop) and run the given shards in supervised tasks."""
        assert job.sources is not None
        spec = job.spec
        tokens = await asyncio.to_thread(read_tokens, job.sources)
        vocab = spec.model.config.vocab
        held_out = None
        if job.eval_sources is not None and 0 in shards:  # eval.files, for shard 0 which evaluates
            held_out = TokenDataset(await asyncio.to_thread(read_tokens, job.eval_sources), spec.data.seq_len, vocab)
        data = TrainingData(TokenDataset(tokens, spec.data.seq_len, vocab), spec.batch, spec.seed, spec.eval, held_out)
        for shard in shards:
            trainer = Trainer(spec, job.job_id, self.directory, self.pool, data, shard=shard, shards=of,
                              config=self.config, on_event=lambda e, s=shard: self._on_event(job, s, e))
            self._running[job.job_id] = self._running.get(job.job_id, 0) + 1
            self._live.setdefault(job.job_id, []).append(trainer)
            task = self._tasks.spawn(self._run(job, trainer), f"trainer {job.spec.name}#{shard}")
            self._trainers.setdefault(job.job_id, []).append(task)
        if job.state == "waiting":
            job.state = "running"

    async def _run(self, job: Job, trainer: Trainer) -> None:
        """`_until_ended`, supervised: restarted on unexpected errors; a TrainerError fails the job."""
        try:
            await self.supervisor.run(f"trainer {job.spec.name}#{trainer.shard}",
                                      lambda: self._until_ended(job, trainer), final=(TrainerError,))
        except asyncio.CancelledError:
            raise
        except TrainerError as exc:
            log.warning("trainer of %s failed: %s", job.spec.name, exc)
            job.state = "failed"
            job.event("done", f"trainer {trainer.shard} failed: {exc}")
            return
        finally:
            self._running[job.job_id] -= 1
            self._retire(job.job_id, trainer)
        if self._running[job.job_id] == 0 and job.state not in FINAL_STATES:
            job.state = "done"
            job.event("done", f"trained {job.spec.steps} steps")

    @staticmethod
    async def _until_ended(job: Job, trainer: Trainer) -> None:
        """Run the trainer until it finishes or the job ends, whichever comes first.

        Structured, so neither side outlives the other: the trainer runs in this task inside a
        cancel scope (`asyncio.timeout`) that `_expire_on_end`, a task of the group around it,
        expires when the job ends; the watcher is cancelled when the trainer returns. The trainer's
        own error reaches the supervisor as itself (a `TrainerError` stays final), not as a group."""
        if job.end_seen.is_set():
            return
        failure: BaseException | None = None
        try:
            async with asyncio.timeout(None) as scope, asyncio.TaskGroup() as race:
                watcher = race.create_task(_expire_on_end(job, scope))
                try:
                    await trainer.run()
                finally:
                    watcher.cancel()
        except TimeoutError:  # only the expired scope raises it bare: the group wraps the trainer's own
            log.info("trainer %d of %s stopped: the job %s", trainer.shard, job.spec.name, job.ended.text())
        except BaseExceptionGroup as group:  # the trainer's error: the watcher only waits
            failure = group.exceptions[0] if len(group.exceptions) == 1 else group
        if failure is not None:
            raise failure  # outside the handler: its traceback is the trainer's, not the group's

    def _on_event(self, job: Job, shard: int, event: StepEvent | StatusEvent) -> None:
        if isinstance(event, StatusEvent):
            job.event("warning" if event.message else "info", event.message or "training flows again")
            return
        job.step = event.step + 1
        job.loss = event.global_loss if event.global_loss is not None else event.shard_loss
        job.samples_per_s = self._rate(job, event)
        evaluated = self._evaluated(job, event)
        job.event("step", f"shard {shard}: step {event.step} committed", tokens_per_s=event.tokens_per_s, **evaluated,
                  samples_per_s=job.samples_per_s,
                  shard=shard, shard_loss=event.shard_loss, samples=event.samples, retries=event.retries,
                  peers_per_stage=list(event.peers_per_stage), stage_samples=list(event.stage_samples),
                  duplicates=list(event.duplicates), taken_over=event.taken_over,
                  answers_lost=event.answers_lost)

    def _evaluated(self, job: Job, event: StepEvent) -> dict[str, Any]:
        """The step event's evaluation fields (none when the step had no evaluation): `eval_loss`
        (None: given up, `eval_failed` says why), the step it evaluated, its samples and seconds."""
        result = event.evaluation
        if result is None:
            return {}
        self.evaluations["ok" if result.loss is not None else "given_up"] += 1
        if result.loss is not None:
            job.eval_loss, job.eval_step = result.loss, result.version
            self.last_eval_loss = result.loss
        return {"eval_loss": result.loss, "eval_step": result.version, "eval_samples": result.samples,
                "eval_s": result.elapsed_s, **({"eval_failed": result.why} if result.why else {})}

    def _rate(self, job: Job, event: StepEvent) -> float:
        """The job's samples/s: global batches over the time between the last RATE_WINDOW steps'
        commits (each step counted once, whichever local shard saw it first). Why commits and not a
        shard's own rate: shards on other daemons are invisible here, but every commit means a whole
        global batch went through every stage. Until two steps are seen: the first step's own time."""
        commits = self._commits.setdefault(job.job_id, collections.deque(maxlen=RATE_WINDOW))
        if not commits or event.step > commits[-1][0]:
            commits.append((event.step, time.monotonic()))
        if len(commits) < 2:
            return job.spec.batch.global_samples / event.elapsed_s if event.elapsed_s > 0 else 0.0
        (first_step, first), (last_step, last) = commits[0], commits[-1]
        return job.spec.batch.global_samples * (last_step - first_step) / max(last - first, 1e-9)

    def _retire(self, job_id: bytes, trainer: Trainer) -> None:
        """Keep a finished trainer's bans, drop the trainer (and with it its data)."""
        self._live[job_id].remove(trainer)
        kept = self._past_bans.setdefault(job_id, collections.deque(maxlen=self.config.ban_log_kept))
        kept.extend(trainer.banned_peers)

    def bans(self, job_id: bytes) -> list[BanRecord]:
        """The bans this daemon's trainers of the job made, across shards, newest last, at most
        `TrainerConfig.ban_log_kept`."""
        merged = [*self._past_bans.get(job_id, ()), *(b for t in self._live.get(job_id, ()) for b in t.banned_peers)]
        merged.sort(key=lambda b: b.at)
        return merged[-self.config.ban_log_kept:]

    @property
    def started(self) -> set[bytes]:
        """Jobs this daemon has run trainers for."""
        return set(self._trainers)

    def cancel(self, job: Job) -> None:
        """Stop this daemon's trainers of `job` (swarmctl cancel)."""
        for task in self._trainers.pop(job.job_id, []):
            task.cancel()

    async def close(self) -> None:
        await self._tasks.aclose("daemon stopping")
