"""Jobs this daemon knows: the ones submitted here, and the ones other daemons published in the DHT.

DHT layout (every record signed; the subkey is the signer's peer id, the default DHT rule; the
schemas, and the one place they are decoded, are in `swarmd.values`):
- `("job", job_id, "spec")`: the canonical spec (msgpack), announced by its submitter. Any daemon
  can verify a spec it reads: `job_id` must equal `spec.job_id(record.public_key)`, so nobody can
  publish a different spec under someone else's job id.
- `("jobs",)`: one entry per submitter, the msgpack list of the job ids it submitted; daemons poll
  this index to notice new jobs.
- `("job", job_id, "stage", i)`: one entry per peer serving stage i, a msgpack map
  `{addr, samples_per_s, queue, step, state}` (written by the stage servers).
- `("job", job_id, "end")`: the job's end (finished or cancelled), signed by its submitter. Only
  the record signed by the job's submitter counts (the job id hashes the spec with that public
  key), so nobody else can end a job; a record anyone else stores there is refused and logged
  once. An ended job stays in its submitter's index, so every daemon learns it ended rather than
  only that it is gone.
- `("job", job_id, "progress")`: the step, loss and samples/s the job is at (and, with `[eval]`, its
  recent held-out losses), as the submitter's
  daemon knows them from its trainers, re-stored when they change (at the join loop's pace, about
  every `jobs.join_interval_s`). Only the submitter's record is read, as for the end: a daemon
  that did not submit the job shows these in `swarmctl jobs`/`job` (read when asked, at most every
  `PROGRESS_READ_S`) instead of `waiting, step 0`.

Reading the index is bounded (`IndexLimits`, from `[jobs]`): a submitter's entry lists at most
`max_ids_per_submitter` ids; one refresh looks up at most `lookups_per_refresh` specs and as many
end records; an id whose spec was not found (or not valid) is not looked up again for `miss_ttl_s`;
a learned job the index has not listed for `forget_after_s` is forgotten, so what a daemon knows
is bounded by what the index holds, not by how many ids it ever listed.
Eight index entries listing 512 made-up ids each used to make an idle daemon run ~51 lookups a
second for ever.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from swarmd.errors import LocalError
from swarmd.jobs.probing import Prober
from swarmd.job import DataSpec, JobSpec, SpecError
from swarmd.job.spec import eval_data_spec
from swarmd.job.opening import AccessDenied, Reader
from swarmd.job.sources import GlobLimits, Sources, named_sources, resolve_sources
from swarmd.values import (
    MAX_PROGRESS_POINTS, DHTValues, JobEnd, JobProgress, encode_index, end_key, index_key, progress_key, spec_key,
)
from transport.identity import peer_id_of

log = logging.getLogger(__name__)

#: Lifecycle: waiting (some stage has no peer, or no trainer runs yet), running, then one of the
#: three final states.
JOB_STATES = ("waiting", "running", "done", "cancelled", "failed")
FINAL_STATES = frozenset({"done", "cancelled", "failed"})
#: Events held per job for `job.logs`; older ones are dropped first.
MAX_EVENTS = 1000
#: Job ids remembered as refused by `accept_from` (so `find` can say why, and refresh skips them).
MAX_REFUSED_JOBS = 1024
#: (job, forger) pairs remembered so a forged end record is logged once, not at every refresh.
MAX_FORGERIES_LOGGED = 1024
#: Job ids remembered as misses (no valid spec found): bounds the negative cache.
MAX_MISSES_KEPT = 4096


@dataclass(frozen=True)
class IndexLimits:
    """How much work the `jobs` index may make a daemon do (config `[jobs]`, documented there)."""

    max_ids_per_submitter: int = 64
    lookups_per_refresh: int = 16
    miss_ttl_s: float = 300.0
    #: A job learned from the index and missing from it this long is forgotten (learned again,
    #: one lookup, if it comes back). Without it a stranger listing fresh ids at every refresh grew
    #: `jobs` by `lookups_per_refresh` per refresh for ever; long enough that a few failed reads
    #: of the index forget nothing.
    forget_after_s: float = 600.0


class JobRequestError(LocalError):
    """A job request cannot be served; `code` is the control API's typed error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


#: A daemon that did not submit a job reads its progress record at most this often (each `jobs` or
#: `job` request reads it otherwise): one DHT read per job and period, asked for by a local user.
PROGRESS_READ_S = 2.0


@dataclass
class Job:
    job_id: bytes
    spec: JobSpec
    submitter: bytes  # public key
    local: bool
    state: str = "waiting"
    step: int = 0
    loss: float | None = None
    # The last held-out evaluation's mean loss ([eval]) and the steps committed it evaluated.
    eval_loss: float | None = None
    eval_step: int | None = None
    samples_per_s: float = 0.0
    sources: Sources | None = None
    eval_sources: Sources | None = None  # the data of `eval.files`, for this daemon's shard-0 trainer
    events: collections.deque = field(default_factory=lambda: collections.deque(maxlen=MAX_EVENTS))
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    emitted: int = 0  # events ever added; the deque holds the last MAX_EVENTS of them
    ended: JobEnd | None = None  # the swarm-wide end, signed by the submitter
    end_seen: asyncio.Event = field(default_factory=asyncio.Event)  # set once `ended` is
    end_checked_at: float = 0.0  # monotonic time its end record was last looked up
    progress_read_at: float = -PROGRESS_READ_S  # monotonic time its progress record was last read

    def event(self, kind: str, message: str, **fields: Any) -> None:
        self.events.append({"ts": time.time(), "kind": kind, "step": self.step, "loss": self.loss,
                            "tokens_per_s": None, "message": message, **fields})
        self.emitted += 1
        self.changed.set()
        self.changed = asyncio.Event()

    def summary(self) -> dict[str, Any]:
        return {"job": self.job_id.hex(), "name": self.spec.name, "submitter": self.submitter.hex(),
                "stages": self.spec.pipeline.stages, "step": self.step, "state": self.state}


class JobRegistry:
    """Submits, publishes and finds jobs; `dht` is a started `DHTNode`, `identity` signs specs.

    `accept_from` (config `jobs.accept_jobs_from`): public keys or peer ids of the submitters whose
    published jobs this daemon learns; empty accepts all. A job from anyone else is never learned,
    so it is never served or trained here; its spec is not even fetched. Jobs submitted through
    this daemon are its own and always accepted (the control socket's admission guards them).

    `prober` (the daemon's): with one, `stage_peers` says which peers answered a call, and only
    those count as serving in `describe`; without one (tests of the index alone) every peer counts.
    """

    def __init__(self, dht: Any, identity: Any, *, accept_from: frozenset[bytes] = frozenset(),
                 glob_limits: GlobLimits = GlobLimits(), index_limits: IndexLimits = IndexLimits(),
                 values: DHTValues | None = None, prober: Prober | None = None) -> None:
        self.dht, self.identity = dht, identity
        self.values = values or DHTValues(dht)
        self.prober = prober
        self.accept_from = accept_from
        self.glob_limits = glob_limits
        self.index_limits = index_limits
        self.misses: collections.OrderedDict[tuple[bytes, bytes], float] = collections.OrderedDict()  # (job id, submitter) -> retry at
        self.jobs: dict[bytes, Job] = {}
        self.refused: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()  # job id -> submitter
        self._announcements: list[Any] = []
        self._progress: dict[bytes, Any] = {}  # job id -> its progress announcement (jobs submitted here)
        self._progress_sent: dict[bytes, tuple] = {}  # job id -> (step, loss, samples/s) last stored
        self._index = None
        self.listed: set[bytes] = set()  # job ids in the `jobs` index at the last refresh
        self._unlisted: dict[bytes, float] = {}  # learned job id -> when the index stopped listing it
        self._forgeries: collections.OrderedDict[tuple[bytes, bytes], None] = collections.OrderedDict()

    # ------------------------------------------------------------------ submit

    async def submit(self, raw_spec: Any, data: Sequence[str], base: str | None,
                     peercred: tuple[int, int, int] | None,
                     start: Callable[[Job], Awaitable[None]] | None = None) -> Job:
        """Validate, check the submitter may read the data, run `start` (the local trainers), then
        publish; raises `JobRequestError`, or what `start` raised. A submission that fails at any of
        these steps publishes nothing and leaves no job behind: a job another daemon learned and
        joined should be one its submitter could start.

        The data check walks the submitter's globs and stats every file: filesystem work of a size
        the submitter chooses (within `glob_limits`), so it runs in a worker thread, not on the loop."""
        try:
            spec = JobSpec.from_dict(raw_spec)
        except SpecError as exc:
            raise JobRequestError("bad_request", f"{exc.field}: {exc.message}") from None
        sources = await self._off_loop(self._readable_sources, spec, data, base, peercred)
        eval_sources = None if spec.eval.files is None else \
            await self._off_loop(self._readable_eval_sources, spec, (), base, peercred)
        job_id = spec.job_id(self.identity.public_key)
        if job_id in self.jobs:
            return self.jobs[job_id]
        limit = self.index_limits.max_ids_per_submitter
        if sum(j.local for j in self.jobs.values()) >= limit:
            raise JobRequestError("busy", f"this daemon already submitted {limit} jobs (jobs.max_jobs_per_submitter)")
        job = Job(job_id, spec, self.identity.public_key, local=True, sources=sources, eval_sources=eval_sources)
        self.jobs[job_id] = job
        try:
            if start is not None:
                await start(job)
        except BaseException:
            del self.jobs[job_id]
            raise
        self._publish(job)
        job.event("info", f"submitted by uid {peercred[1]}: {spec.pipeline.stages} stages, {spec.steps} steps")
        return job

    async def attach_data(self, job: Job, data: Sequence[str], peercred: tuple[int, int, int] | None) -> None:
        """Local data for one more trainer of `job` (job.train), checked like a submission's."""
        job.sources = await self._off_loop(self._readable_sources, job.spec, data, None, peercred)

    async def attach_eval_data(self, job: Job, eval_data: Sequence[str], peercred: tuple[int, int, int] | None) -> None:
        """The data of the job's `eval.files` for the trainer that evaluates (shard 0, job.train):
        `eval_data` paths, or else the spec's patterns, which then must be absolute (no spec file
        here to start relative ones from)."""
        job.eval_sources = await self._off_loop(self._readable_eval_sources, job.spec, eval_data, None, peercred)

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    def _readable_sources(self, spec: JobSpec, data: Sequence[str], base: str | None,
                          peercred: tuple[int, int, int] | None) -> Sources:
        """The job's data as the connecting user (SO_PEERCRED) may open it: every path walked
        and checked by `swarmd.job.opening`, never judged by its text. `data` paths (from
        `swarmctl submit --data`) replace the spec's own; otherwise the spec's relative paths
        start at `base`, the spec file's directory as swarmctl resolved it."""
        return self._readable(spec.data, spec, data, base, peercred, "data")

    def _readable_eval_sources(self, spec: JobSpec, data: Sequence[str], base: str | None,
                               peercred: tuple[int, int, int] | None) -> Sources:
        """`_readable_sources` for `eval.files` (errors name `eval.files`)."""
        return self._readable(eval_data_spec(spec.data, spec.eval), spec, data, base, peercred, "eval.files")

    def _readable(self, wanted: DataSpec, spec: JobSpec, data: Sequence[str], base: str | None,
                  peercred: tuple[int, int, int] | None, what: str) -> Sources:
        if peercred is None:
            raise JobRequestError("forbidden", "no peer credentials: cannot tell whose data this is")
        reader = Reader.of_user(peercred[1], peercred[2])
        try:
            if data:
                return named_sources(data, spec.data.tokens is not None, reader, spec.data.token_dtype)
            if base is not None and not Path(base).is_absolute():
                raise SpecError("base", f"{base} is not an absolute directory")
            return resolve_sources(wanted, base or "/", self.glob_limits, reader)
        except SpecError as exc:
            field = exc.field if what == "data" or exc.field == "base" else what
            raise JobRequestError("bad_request", f"{field}: {exc.message}") from None
        except AccessDenied as exc:
            raise JobRequestError("forbidden", f"{what}: {exc}") from None
        except OSError as exc:
            raise JobRequestError("bad_request", f"{what}: {exc}") from None

    def _publish(self, job: Job) -> None:
        value = job.spec.to_msgpack()
        self._announcements.append(self.dht.announce(spec_key(job.job_id), lambda: value))
        # Announcing the same key again replaces the entry and stores it now: readers see the new
        # job at once rather than at the index's next refresh.
        self._index = self.dht.announce(index_key(), self._index_value)

    def publish_progress(self) -> None:
        """Re-store the progress record of each job submitted here whose step, loss or rate changed
        (announcing the same key again stores it now); the join loop calls this every tick."""
        for job in (j for j in self.jobs.values() if j.local and j.ended is None):
            now = (job.step, job.loss, job.samples_per_s, job.eval_step)
            if job.step == 0 or self._progress_sent.get(job.job_id) == now:
                continue
            self._progress_sent[job.job_id] = now
            recent = [(e["step"], e["loss"]) for e in job.events if e["kind"] == "step" and e["loss"] is not None
                      and math.isfinite(e["loss"])]
            recent = sorted(dict(recent).items())[-MAX_PROGRESS_POINTS:]  # one loss per step, the last said
            evaluated = sorted({e["eval_step"]: e["eval_loss"] for e in job.events
                                if e["kind"] == "step" and e.get("eval_loss") is not None}.items())[-MAX_PROGRESS_POINTS:]
            value = JobProgress(job.step, job.loss, job.samples_per_s, time.time(), tuple(recent),
                                tuple(evaluated)).to_msgpack()
            self._progress[job.job_id] = self.dht.announce(progress_key(job.job_id), lambda v=value: v)

    async def read_progress(self, job: Job) -> None:
        """For a job submitted elsewhere that no trainer here is ahead in: take the step, loss and
        rate its submitter published (at most every PROGRESS_READ_S)."""
        if job.local or job.ended is not None or time.monotonic() - job.progress_read_at < PROGRESS_READ_S:
            return
        job.progress_read_at = time.monotonic()
        progress = await self.values.progress(job.job_id, job.submitter, job.spec.steps)
        if progress is None or progress.step < job.step:
            return
        held_out = dict(progress.evaluated)
        if job.sources is None:  # no trainer here: its step events are the submitter's, as published
            for step, loss in (p for p in progress.recent if p[0] > job.step):
                job.step, job.loss = step, loss
                evaluated = {"eval_loss": held_out[step], "eval_step": step} if step in held_out else {}
                job.event("step", f"step {step - 1} committed (as its submitter published)",
                          samples_per_s=progress.samples_per_s, published=True, **evaluated)
        job.step, job.loss, job.samples_per_s = progress.step, progress.loss, progress.samples_per_s
        if progress.evaluated and (job.eval_step is None or progress.evaluated[-1][0] >= job.eval_step):
            job.eval_step, job.eval_loss = progress.evaluated[-1]
        if job.state == "waiting":
            job.state = "running"

    async def read_progress_of_listed(self) -> None:
        """`swarmctl jobs`: the progress of the listed jobs submitted elsewhere, the least recently
        read first, at most `lookups_per_refresh` reads (a stranger's many jobs cost no more)."""
        due = [j for j in self.jobs.values() if not j.local and j.ended is None and j.job_id in self.listed]
        due.sort(key=lambda j: j.progress_read_at)
        if due:
            await asyncio.gather(*(self.read_progress(j) for j in due[:self.index_limits.lookups_per_refresh]))

    def _index_value(self) -> bytes:
        # Ended jobs stay listed: readers then find their end record and show how they ended.
        return encode_index([j.job_id for j in self.jobs.values() if j.local])

    async def withdraw(self) -> None:
        """Drain: take our specs and index entry out of the DHT."""
        for ann in [*self._announcements, *self._progress.values(), *([self._index] if self._index else [])]:
            await self.dht.withdraw(ann)
        self._announcements, self._index = [], None
        self._progress.clear()

    # ------------------------------------------------------------------ discovery

    async def refresh(self, latest: bool = True) -> None:
        """Learn the jobs other daemons published, within `index_limits`; a spec that does not hash
        to its id is ignored. `listed` becomes the ids the index holds now: a job missing from it is
        gone or cancelled. Ids left over by the lookup budget are looked up at the next refresh."""
        listed = {j.job_id for j in self.jobs.values() if j.local}
        now = time.monotonic()
        entries = []
        for entry in await self.values.index(self.index_limits.max_ids_per_submitter, latest=latest):
            if self.accepts(entry.submitter):
                entries.append(entry)
            else:
                for job_id in entry.job_ids:
                    self._refuse(job_id, entry.submitter)
        await self._learn_fairly([[(j, e.submitter) for j in reversed(e.job_ids)
                                   if j not in self.jobs and self.misses.get((j, e.submitter), 0.0) <= now]
                                  for e in entries])
        for entry in entries:
            for job_id in entry.job_ids:
                known = self.jobs.get(job_id)
                if known is not None and known.submitter == entry.submitter:
                    listed.add(job_id)
        # Before `listed` changes, so automatic joining never sees a newly learned job that has ended.
        unended = [self.jobs[j] for j in listed if not self.jobs[j].local and self.jobs[j].ended is None]
        for job in sorted(unended, key=lambda j: j.end_checked_at)[:self.index_limits.lookups_per_refresh]:
            await self.check_end(job)
        self.listed = listed
        self._forget_unlisted(listed, now)

    def _forget_unlisted(self, listed: set[bytes], now: float) -> None:
        """Forget the jobs learned from the index that it has not listed for `forget_after_s`;
        one this daemon trains (data attached by `job.train`) is kept while its trainers may run."""
        for job_id in listed:
            self._unlisted.pop(job_id, None)
        for job_id in [j for j, job in self.jobs.items() if not job.local and job.sources is None and j not in listed]:
            if now - self._unlisted.setdefault(job_id, now) >= self.index_limits.forget_after_s:
                del self.jobs[job_id], self._unlisted[job_id]

    async def _learn_fairly(self, wanted: list[list[tuple[bytes, bytes]]]) -> None:
        """Spend the read's `lookups_per_refresh` one submitter at a time, in a random order, each
        one's newest ids first: else entries that come first (a stranger's, listing made-up ids)
        took every lookup of every read and an honest new job was never learned."""
        random.shuffle(wanted)
        budget = self.index_limits.lookups_per_refresh
        for depth in range(max(map(len, wanted), default=0)):
            for queue in wanted:
                if budget <= 0:
                    return
                if depth < len(queue) and queue[depth][0] not in self.jobs:
                    budget -= 1
                    await self._learn(*queue[depth])

    def accepts(self, submitter: bytes) -> bool:
        """Whether `jobs.accept_jobs_from` admits jobs signed by this public key."""
        return (not self.accept_from or submitter == self.identity.public_key
                or submitter in self.accept_from or peer_id_of(submitter) in self.accept_from)

    def _refuse(self, job_id: bytes, submitter: bytes) -> None:
        self.refused[job_id] = submitter
        self.refused.move_to_end(job_id)
        while len(self.refused) > MAX_REFUSED_JOBS:
            self.refused.popitem(last=False)

    async def _learn(self, job_id: bytes, submitter: bytes) -> None:
        published = await self.values.spec(job_id, submitter)
        if published is None:  # a miss of this submitter's only: another may list the same id honestly
            self.misses[job_id, submitter] = time.monotonic() + self.index_limits.miss_ttl_s
            self.misses.move_to_end((job_id, submitter))
            while len(self.misses) > MAX_MISSES_KEPT:
                self.misses.popitem(last=False)
            return
        self.misses.pop((job_id, submitter), None)
        self.jobs[job_id] = Job(job_id, published.spec, submitter, local=False)

    async def find(self, name_or_id: Any) -> Job:
        """A job by hex id, or by name when exactly one known job has it."""
        if not isinstance(name_or_id, str) or not name_or_id:
            raise JobRequestError("bad_request", "job: a job id (hex) or name is required")
        for attempt in range(2):
            match = self._match(name_or_id)
            if match is not None:
                return match
            if attempt == 0:
                await self.refresh()
        refused = self._refused_match(name_or_id)
        if refused is not None:
            raise JobRequestError("forbidden", f"job: {name_or_id} was submitted by peer {peer_id_of(refused).hex()}, "
                                               "which this daemon's jobs.accept_jobs_from does not list")
        raise JobRequestError("not_found", f"job: no job {name_or_id!r} is known to this daemon or the DHT")

    def _refused_match(self, name_or_id: str) -> bytes | None:
        try:
            return self.refused.get(bytes.fromhex(name_or_id))
        except ValueError:
            return None  # a name: refused specs are never fetched, so their names are unknown

    def _match(self, name_or_id: str) -> Job | None:
        try:
            job = self.jobs.get(bytes.fromhex(name_or_id))
        except ValueError:
            job = None
        if job is not None:
            return job
        named = [j for j in self.jobs.values() if j.spec.name == name_or_id]
        if len(named) > 1:
            raise JobRequestError("bad_request", f"job: {len(named)} jobs are named {name_or_id!r}; give the id")
        return named[0] if named else None

    async def stage_peers(self, job: Job) -> list[dict[str, Any]]:
        """Per stage, the peers announcing it in the DHT (the `job.get` payload's `stages`). With a
        prober, each says whether it answered a call (`reachable`) and serves as it claims (`serves`)."""
        stages = []
        for index in range(job.spec.pipeline.stages):
            found = await self.values.announcements(job.job_id, index, latest=False)
            probes = await self.prober.check_all(job.job_id, found) if self.prober is not None else {}
            peers = []
            for a in found:
                probe = probes.get((a.peer_id, index))
                # What the peer answered when probed (seconds old at most) over its announcement (30 s).
                step = a.step if probe is None or probe.step is None else probe.step
                rate = a.samples_per_s if probe is None or probe.samples_per_s is None else probe.samples_per_s
                peers.append({"peer_id": a.peer_id.hex(), "address": a.addr, "samples_per_s": rate,
                              "queue": a.queue, "step": step, "state": a.state,
                              "reachable": True if probe is None else probe.answered,
                              "serves": a.state == "serving" if probe is None else probe.serving})
            stages.append({"stage": index, "peers": peers})
        return stages

    async def check_end(self, job: Job) -> None:
        """Read the job's end record; believe only the one its submitter signed."""
        job.end_checked_at = time.monotonic()
        end, forgers = await self.values.end(job.job_id, job.submitter, job.spec.steps)
        for forger in forgers:
            if (job.job_id, forger) not in self._forgeries:
                log.warning("job %s: refused an end record signed by peer %s, not by the job's submitter",
                            job.spec.name, forger.hex()[:16])
                self._forgeries[(job.job_id, forger)] = None
                while len(self._forgeries) > MAX_FORGERIES_LOGGED:
                    self._forgeries.popitem(last=False)
        if end is not None:
            self._ended(job, end)

    def _ended(self, job: Job, end: JobEnd) -> None:
        if job.ended is not None:
            return
        job.ended = end
        job.step = max(job.step, end.step)
        if job.state != end.state:  # the local trainers' own "done" event already says it
            job.state = end.state
            job.event("done", f"job {end.text()}")
        job.end_seen.set()
        log.info("job %s (%s) %s", job.spec.name, job.job_id.hex()[:16], end.text())

    def end(self, job: Job, state: str, by: str, step: int | None = None) -> None:
        """End a job submitted here, swarm-wide: publish the signed end record (kept alive until
        drain) so every daemon serving or training it stops. Only the submitter can."""
        if not job.local:
            raise JobRequestError("not_found", f"job: {job.job_id.hex()} was not submitted through this daemon")
        if job.ended is not None:
            return
        end = JobEnd(state, max(job.step, step or 0), time.time(), by)
        value = end.to_msgpack()
        self._announcements.append(self.dht.announce(end_key(job.job_id), lambda: value))
        self._ended(job, end)

    async def settle(self) -> None:
        """End the jobs submitted here that finished: their trainers here finished every step, or
        (no trainer here: all run elsewhere) most serving peers of every stage committed the last step."""
        for job in [j for j in self.jobs.values() if j.local and j.ended is None]:
            if job.state == "done":
                self.end(job, "done", "its trainers finished every step")
            elif job.state == "waiting" and await self.swarm_step(job) >= job.spec.steps:
                # "waiting": no trainer runs here (those that do say "done" themselves).
                self.end(job, "done", f"every stage committed step {job.spec.steps}", job.spec.steps)

    async def swarm_step(self, job: Job) -> int:
        """The step every stage has committed, as its serving peers announce (0 if a stage has none).

        A stage's step is the lower median of its serving peers' claims, not the highest: one
        stranger announcing `step = steps` in every stage (and answering the probe) used to make
        the submitter end the job swarm-wide on its word alone. A liar now moves a stage's step only
        by being most of the stage's answering peers (docs/security.md)."""
        return min((_lower_median([p["step"] for p in s["peers"] if p["serves"]])
                    for s in await self.stage_peers(job)), default=0)

    async def describe(self, job: Job) -> dict[str, Any]:
        if job.ended is None and not job.local:
            await self.check_end(job)
            await self.read_progress(job)
        stages = await self.stage_peers(job)
        # A peer only announcing "joining" (automatic joining says so before it starts) or
        # "draining" takes no work yet, and one that did not answer a call serves nobody: its
        # stage still stalls the job.
        empty = {s["stage"]: _why_stalled(s["peers"]) for s in stages if not any(p["serves"] for p in s["peers"])}
        state = "waiting" if empty and job.state == "running" else job.state
        if job.ended is not None:
            status = f"job {job.ended.text()}"
        elif job.state in FINAL_STATES:
            status = f"job {job.state}"
        elif empty:
            status = "waiting: " + ", ".join(f"stage {i} has {why}" for i, why in empty.items())
        else:
            status = f"{job.state}: every stage has peers"
        return {"job": job.job_id.hex(), "name": job.spec.name, "state": state, "status": status,
                "submitter": job.submitter.hex(), "step": job.step, "steps": job.spec.steps, "loss": job.loss,
                "eval_loss": job.eval_loss, "eval_step": job.eval_step, "samples_per_s": job.samples_per_s, "stages": stages,
                "end": None if job.ended is None else job.ended.as_dict()}

    async def cancel(self, job: Job, by: str = "swarmctl cancel") -> None:
        """`swarmctl cancel`: end the job swarm-wide, unless it finished (a job whose trainers
        failed here is cancelled: its stages elsewhere should stop too)."""
        if not job.local:
            raise JobRequestError("not_found", f"job: {job.job_id.hex()} was not submitted through this daemon")
        if job.state != "done" and job.ended is None:
            self.end(job, "cancelled", by, await self.swarm_step(job))

    async def events(self, job: Job, follow: bool) -> AsyncIterator[dict[str, Any]]:
        """Held events, then (with `follow`) new ones until the job reaches a final state."""
        sent = job.emitted - len(job.events)
        while True:
            held, first = list(job.events), job.emitted - len(job.events)
            for event in held[max(0, sent - first):]:
                yield event
            sent = job.emitted
            if not follow or job.state in FINAL_STATES:
                return
            if job.local or job.sources is not None:
                await job.changed.wait()
                continue
            # Submitted elsewhere and no trainer here: its steps come from its progress record.
            changed = job.changed
            try:
                async with asyncio.timeout(PROGRESS_READ_S):
                    await changed.wait()
            except TimeoutError:
                await self.read_progress(job)


def _lower_median(steps: list[int]) -> int:
    """The claim at least half of `steps` reach or exceed, the smaller of two middles (0: none)."""
    return sorted(steps)[(len(steps) - 1) // 2] if steps else 0


def _why_stalled(peers: list[dict[str, Any]]) -> str:
    if not peers:
        return "no peers"
    if any(p["state"] == "serving" and not p["serves"] for p in peers):
        return "no serving peer that answers"
    return "no serving peer yet"
