"""Automatic joining: the daemon notices jobs in the DHT and serves a stage of each one it should.

Every `jobs.join_interval_s` (jittered, so daemons started together do not decide together) the
loop reads the `jobs` index (`JobRegistry.refresh`) and, for every listed job that `jobs.serve`
admits, joins the stage with the least capacity, a stage with fewer than `jobs.min_stage_peers`
peers first: the rebalancer's own join rule (`choose_join_stage`), fed from the stages' DHT
announcements. Only peers that answered a call count (`swarmd.jobs.probing`: a record alone is a
claim anyone can store), and capacity is their announced samples/s bounded by the others'
(`swarmd.rebalance.table.bounded_speeds`); a peer that has measured nothing yet counts at the
job's median measured speed (1 when none is measured), so a stage with an idle new peer still
ranks above a stage with none. A daemon takes one stage per job, and a second one only while some
stage of the job has no peer at all: an empty stage stalls the whole job, which outweighs
spreading. `jobs.max_stages` bounds it all.

What the daemon serves is remembered (`RememberedStages`) and, after a restart, rejoined first,
whatever `jobs.serve` says (a stage pinned by hand is remembered too): by download from a live mate,
else from this daemon's checkpoint, as any join. A remembered job that is not in the index (gone,
or cancelled by its submitter) is forgotten after `jobs.rejoin_wait_s`, the time a restarted
daemon needs to find the swarm again.

The same loop ends what has ended: on the submitter it publishes the end of a job whose steps are
all done (`JobRegistry.settle`) and, while it runs, its progress (`JobRegistry.publish_progress`), and on every daemon it leaves the stages of a job whose submitter
signed its end (finished or cancelled): a final checkpoint, announcements withdrawn, the stage
stopped and forgotten (`Serving.leave`). An ended job is never joined or rejoined.

Both loops (polling the jobs, remembering what is served) run under the daemon's `Supervisor`: an
error nobody foresaw is logged with its traceback, shown in `swarmctl status` and the loop restarted.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from typing import Any

from swarmd.dht.errors import DHTError
from swarmd.errors import SwarmdError
from swarmd.jobs.directory import announcement_value, stage_key
from swarmd.jobs.registry import FINAL_STATES, Job, JobRegistry
from swarmd.jobs.remembered import Key, RememberedStages
from swarmd.rebalance.policy import choose_join_stage
from swarmd.rebalance.table import DRAINING, JOINING, SERVING, PeerLoad, StageTable, bounded_speeds
from swarmd.supervisor import Supervisor
from transport.errors import RpcError, TransportError
from transport.identity import peer_id_of

log = logging.getLogger(__name__)

#: How often the served set is compared with the file (a dict-key comparison; writes only on change).
REMEMBER_CHECK_S = 0.5
#: Jobs one tick tries to join that this daemon serves nothing of (each costs a read of every stage,
#: its probes and a start): with `jobs.serve = "all"` every job a stranger publishes is a candidate,
#: and one identity may list 64. The least recently tried go first, so every job gets its turn.
MAX_JOIN_TRIES_PER_TICK = 8
#: A job whose join failed (its stage over `jobs.max_stage_memory`, a start that failed) is not tried
#: again for this many join intervals (10 s at the default 5 s), doubled per further failure up to
#: JOIN_RETRY_MAX_S; its failure is logged at WARNING once, then at debug: a stranger's unservable
#: jobs must not grow the log every tick.
JOIN_RETRY_INTERVALS = 2
JOIN_RETRY_MAX_S = 600.0
#: What joining or leaving a stage is expected to fail with: swarmd's own errors (a stage too large,
#: a state download or checkpoint that failed, a precision this device lacks, a DHT call), the
#: transport's and the socket's, a timeout. Those are logged and tried again later; anything else is
#: a bug, which ends the tick and reaches the `Supervisor` running the loop (traceback logged, shown
#: in `swarmctl status`, loop restarted after its backoff).
STAGE_FAILURES = (SwarmdError, TransportError, RpcError, OSError, TimeoutError)
#: Announced peer states as the join rule counts them; anything else is not counted.
STATES = {"serving": SERVING, "joining": JOINING, "draining": DRAINING, "stopping": DRAINING}


def admits(rule: str | frozenset[str], job: Job) -> bool:
    """Does `jobs.serve` cover `job`? A list names jobs or their submitters (public key or peer id, hex)."""
    if rule == "all":
        return True
    if rule == "none":
        return False
    return bool({job.spec.name, job.submitter.hex(), peer_id_of(job.submitter).hex()} & rule)


def _counted(stages: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any], str]]:
    """(stage, announcement, table state) for the peers that answered a call (a "serving" one only
    if it said so when called): a record alone is a claim anyone can store."""
    return [(s["stage"], p, STATES[p["state"]]) for s in stages for p in s["peers"]
            if p["reachable"] and p["state"] in STATES and (p["state"] != "serving" or p["serves"])]


def _rates(counted: list[tuple[int, dict[str, Any], str]]) -> tuple[list[bytes], dict[bytes, float], float]:
    """One row per (peer, stage) (a daemon may serve two stages of a job), each claim bounded by
    the others', and the speed an unmeasured peer counts at (the median measured one, else 1)."""
    rows = [bytes.fromhex(p["peer_id"]) + stage.to_bytes(4, "big") for stage, p, _ in counted]
    rates = bounded_speeds({row: p["samples_per_s"] for row, (_, p, _) in zip(rows, counted)})
    measured = [r for r in rates.values() if r > 0]
    return rows, rates, statistics.median(measured) if measured else 1.0


def capacity_table(stages: list[dict[str, Any]]) -> StageTable:
    """The join rule's view of a job from its `stage_peers` announcements: peers that answered a
    call only, their claims bounded, joining peers where they announced themselves."""
    counted = _counted(stages)
    rows, rates, unmeasured = _rates(counted)
    table = StageTable(len(stages))
    for row, (stage, _, state) in zip(rows, counted):
        table.put(PeerLoad(row, stage, rates[row] or unmeasured, state))
    return table


def join_stage(stages: list[dict[str, Any]], me: bytes, min_peers: int = 1) -> int:
    """The stage `me` joins: the join rule applied to every daemon joining the job now, one by one
    in peer-id order, from the stages as they stand without them.

    Why not simply count each joiner where it announced itself: daemons that decide within the
    time an announcement takes to spread do not see each other and pile onto one stage (five
    daemons started together put four on one stage of two, and the rebalancer is minutes away).
    A joiner announces where it means to go, lets the others' announcements arrive, and decides
    again with this rule (`Joining._join`); every joiner with the same view of who is joining
    computes the same placement, whatever stages they first announced, so they spread as if they
    had come one at a time. A joiner's announced stage is ignored here; a peer joining a stage for
    the rebalancer (a move) is placed by the rule too, a small error the rebalancer corrects."""
    counted = _counted(stages)
    rows, rates, unmeasured = _rates(counted)
    table = StageTable(len(stages))
    joiners: set[bytes] = set()
    for row, (stage, _, state) in zip(rows, counted):
        if state == JOINING:
            joiners.add(row[:-4])
        else:
            table.put(PeerLoad(row, stage, rates[row] or unmeasured, state))
    for ahead in sorted(j for j in joiners if j < me):
        stage = choose_join_stage(table, me=ahead, min_peers=min_peers)
        table.put(PeerLoad(ahead + stage.to_bytes(4, "big"), stage, unmeasured, JOINING))
    return choose_join_stage(table, me=me, min_peers=min_peers)


class Joining:
    def __init__(self, registry: JobRegistry, serving: Any, memory: RememberedStages, *, peer_id: bytes,
                 serve: str | frozenset[str], max_stages: int, interval_s: float, rejoin_wait_s: float,
                 settle_s: float, min_stage_peers: int, supervisor: Supervisor | None = None) -> None:
        self.registry, self.serving, self.memory = registry, serving, memory
        self.peer_id, self.rule, self.max_stages = peer_id, serve, max_stages
        self.interval_s, self.rejoin_wait_s, self.settle_s = interval_s, rejoin_wait_s, settle_s
        self.min_stage_peers = min_stage_peers
        self.pending: dict[Key, float] = {}  # remembered, not rejoined yet -> monotonic deadline
        self.ticks = 0  # looks at the jobs index completed (tests wait on it instead of sleeping)
        self._saved: frozenset[Key] | None = None
        self._random = random.Random()
        self._tried_at: dict[bytes, float] = {}  # job id -> monotonic time of its last join try
        self._failed: dict[bytes, tuple[int, float]] = {}  # job id -> (failures in a row, retry at)
        self.supervisor = supervisor or Supervisor("joining")

    def start(self) -> None:
        self.supervisor.spawn("automatic joining", self._run)

    async def close(self) -> None:
        await self.supervisor.aclose("daemon stopping")

    async def _run(self) -> None:
        remembered = await asyncio.to_thread(self.memory.load)
        self._saved = frozenset(remembered)
        deadline = time.monotonic() + self.rejoin_wait_s
        self.pending = {key: deadline for key in remembered}
        if remembered:
            log.info("rejoining %d remembered stage(s): %s", len(remembered),
                     ", ".join(f"{job.hex()[:16]}/{stage}" for job, stage in remembered))
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.supervisor.run("remember served stages", self._remember_forever))
            tasks.create_task(self.supervisor.run("poll jobs", self._poll_forever))

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.tick()
            except (DHTError, TransportError, OSError, TimeoutError) as exc:  # the next tick retries
                log.warning("automatic joining: %s", exc)
            self.ticks += 1
            # Sooner while remembered stages wait: a restarted daemon should be back quickly.
            base = self.interval_s if not self.pending else min(self.interval_s, 1.0)
            await asyncio.sleep(base * self._random.uniform(0.5, 1.5))

    async def tick(self) -> None:
        await self.registry.refresh()
        await self.registry.settle()
        self.registry.publish_progress()
        await self._leave_ended()
        await self._rejoin()
        if self.rule == "none":
            return
        for table in (self._tried_at, self._failed):
            for gone in [j for j in table if j not in self.registry.jobs]:
                del table[gone]
        now = time.monotonic()
        candidates = [job for job in self.registry.jobs.values()
                      if job.job_id in self.registry.listed and job.ended is None and job.state not in FINAL_STATES
                      and admits(self.rule, job) and self._failed.get(job.job_id, (0, 0.0))[1] <= now]
        tries = 0
        for job in sorted(candidates, key=lambda j: self._tried_at.get(j.job_id, 0.0)):
            if len(self.serving.served) >= self.max_stages:
                break
            new = not any(job_id == job.job_id for job_id, _ in self.serving.served)
            if new:
                if tries >= MAX_JOIN_TRIES_PER_TICK:
                    continue
                tries += 1
                self._tried_at[job.job_id] = time.monotonic()
            await self._join(job)

    async def _leave_ended(self) -> None:
        for job_id, stage in list(self.serving.served):
            job = self.registry.jobs.get(job_id)
            if job is None or job.ended is None:
                continue
            try:
                await self.serving.leave(job_id, stage)
            except STAGE_FAILURES as exc:  # the next tick tries again; a bug goes to the supervisor
                log.warning("could not leave stage %d of ended job %s: %s", stage, job.spec.name, exc)
                continue
            log.info("left stage %d of job %s: the job %s", stage, job.spec.name, job.ended.text())

    async def _rejoin(self) -> None:
        for key, deadline in list(self.pending.items()):
            job_id, stage = key
            job = self.registry.jobs.get(job_id)
            if key in self.serving.served:
                del self.pending[key]
            elif job is not None and job.ended is not None:
                log.warning("forgetting stage %d of job %s: the job %s", stage, job.spec.name, job.ended.text())
                del self.pending[key]
            elif job is not None and job_id in self.registry.listed and job.state != "cancelled":
                if not 0 <= stage < job.spec.pipeline.stages:
                    log.warning("forgetting stage %d of job %s: it has %d stages", stage, job.spec.name,
                                job.spec.pipeline.stages)
                    del self.pending[key]
                    continue
                if await self._serve(job, stage, "rejoined (remembered)"):
                    del self.pending[key]
            elif time.monotonic() > deadline:
                log.warning("forgetting stage %d of job %s: not in the jobs index within %g s (gone or cancelled)",
                            stage, job_id.hex()[:16], self.rejoin_wait_s)
                del self.pending[key]

    async def _join(self, job: Job) -> None:
        stages = await self.registry.stage_peers(job)
        mine = {stage for job_id, stage in self.serving.served if job_id == job.job_id}
        mine |= {stage for job_id, stage in self.pending if job_id == job.job_id}
        if mine and all(any(p["reachable"] for p in s["peers"]) for s in stages):
            return
        stage = join_stage(stages, self.peer_id, self.min_stage_peers)
        if stage in mine:
            return
        intent = self._intent(job, stage)
        try:
            # Let the announcements of daemons deciding at the same moment arrive, then place
            # every joiner in peer-id order (`join_stage`): they spread instead of piling up.
            await asyncio.sleep(self.settle_s)
            settled = join_stage(await self.registry.stage_peers(job), self.peer_id, self.min_stage_peers)
        except BaseException:
            await asyncio.shield(self._drop(job, stage, intent))
            raise
        if settled != stage:
            await self._drop(job, stage, intent)
            if settled in mine:
                return
            log.debug("job %s: joining stage %d, not %d, beside the daemons joining with us",
                      job.job_id.hex()[:16], settled, stage)
            stage, intent = settled, self._intent(job, settled)
        failures = self._failed.get(job.job_id, (0, 0.0))[0]
        if await self._serve(job, stage, "joined", quiet=failures > 0, intent=intent):
            self._failed.pop(job.job_id, None)
        else:
            wait = min(JOIN_RETRY_MAX_S, JOIN_RETRY_INTERVALS * self.interval_s * 2 ** min(failures, 20))
            self._failed[job.job_id] = (failures + 1, time.monotonic() + wait)

    def _intent(self, job: Job, stage: int) -> Any:
        """Say "joining" in the stage's record before the seconds a start takes: daemons deciding
        meanwhile count this peer instead of piling onto the same stage. Trainers and stage-mates use
        only "serving" peers. Serving's own announcement of the same record replaces this one once
        the stage serves."""
        return self.registry.dht.announce(stage_key(job.job_id, stage), lambda: announcement_value(
            self.serving.address, {"samples_per_s": 0.0, "queue": 0, "step": 0, "state": "joining"}))

    async def _drop(self, job: Job, stage: int, intent: Any) -> None:
        """Withdraw a joining intent, unless the stage serves here after all (pinned by hand
        meanwhile): its announcement, under the same key and subkey, replaced the intent, and a
        withdrawal would tombstone it."""
        if (job.job_id, stage) not in self.serving.served:
            await self.registry.dht.withdraw(intent)

    async def _serve(self, job: Job, stage: int, how: str, quiet: bool = False, intent: Any = None) -> bool:
        if (job.job_id, stage) in self.serving.served:
            return True  # pinned by hand meanwhile: its own announcement replaced our intent
        intent = intent or self._intent(job, stage)
        try:
            await self.serving.serve(job.spec, job.job_id, stage, submitter=job.submitter)
        except BaseException as exc:
            await asyncio.shield(self._drop(job, stage, intent))
            if not isinstance(exc, STAGE_FAILURES):
                raise  # cancelled, or a bug: up to the supervisor, which logs and shows it
            log.log(logging.DEBUG if quiet else logging.WARNING, "could not serve stage %d of job %s (%s): %s",
                    stage, job.spec.name, job.job_id.hex()[:16], exc)
            return False
        log.info("%s stage %d of job %s (%s)", how, stage, job.spec.name, job.job_id.hex()[:16])
        return True

    async def _remember_forever(self) -> None:
        while True:
            await self.remember()
            await asyncio.sleep(REMEMBER_CHECK_S)

    async def remember(self) -> None:
        """Write the served (and still pending) stages when they changed."""
        now = frozenset(self.serving.served) | frozenset(self.pending)
        if now != self._saved:
            try:
                await asyncio.to_thread(self.memory.save, set(now))
            except OSError as exc:
                log.warning("cannot write %s: %s", self.memory.path, exc)
                return
            self._saved = now
