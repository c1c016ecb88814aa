"""Adaptive rebalancing inside the daemon: per served job, a load gossip and a move check.

For every job this daemon serves a stage of, a `JobRebalancer` runs the two pure-logic pieces of
`swarmd.rebalance` over the daemon's own transport: a `GossipService` (this peer's signed load entry,
refreshed from the served stage every round; partners and membership from the DHT stage directory,
which stays the source of membership) and a `RebalanceLoop` (the policy on its own jittered period,
its table built from the gossip view) whose moves `Serving.move` carries out.

Which jobs get one follows what `Serving` serves: a small reconcile loop starts a rebalancer when a
job's first stage is served and stops it when the job's last stage is gone. Polling rather than a
hook keeps `Serving.serve` unaware of rebalancing; a second of delay is nothing next to a period.

A daemon that serves several stages of one job describes itself by its lowest stage and never
moves for that job: a load entry names one stage per peer (docs/rebalancing.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from swarmd.errors import ConfigError
from swarmd.jobs.moving import DRAINING, JOINING, SERVING
from swarmd.rebalance.gossip import CODE_UNAVAILABLE, METHOD, GossipConfig, GossipService, OwnLoad
from swarmd.rebalance.mover import MoveFailed, RebalanceLoop
from swarmd.rebalance.policy import PolicyConfig
from swarmd.supervisor import Supervisor
from transport.errors import RpcError
from transport.identity import Identity
from transport.message import Message, Request
from transport.tasks import TaskSet

log = logging.getLogger(__name__)

#: Seconds between two looks at what `Serving` serves.
RECONCILE_S = 1.0


@dataclass(frozen=True)
class RebalanceSettings:
    """The `[rebalance]` section turned into the parts' own configs (validated by them)."""

    enabled: bool
    policy: PolicyConfig
    gossip: GossipConfig
    drain_timeout_s: float

    @classmethod
    def from_section(cls, section: Any) -> "RebalanceSettings":
        """Raises `ConfigError` with the section's own key (`[rebalance] gossip_interval_s`, not the
        gossip's `period_s`) when the parts refuse a value or a combination (a jitter of 1 or more),
        so the daemon's start and `--check-config` report it like any other setting."""
        try:
            policy = PolicyConfig(period_s=section.period_s, jitter=section.jitter,
                                  confirm_after_s=section.confirm_after_s, margin=section.margin,
                                  max_moves=section.max_moves, speed_tolerance=section.speed_tolerance)
        except ConfigError as exc:
            raise ConfigError(exc.key, exc.message, source="[rebalance]") from None
        try:
            gossip = GossipConfig(period_s=section.gossip_interval_s, fanout=section.gossip_fanout,
                                  call_timeout_s=section.gossip_timeout_s, members_ttl_s=section.membership_ttl_s,
                                  max_exchange_entries=section.gossip_max_entries)
        except ConfigError as exc:
            key = _GOSSIP_KEYS.get(exc.key, exc.key)
            raise ConfigError(key, exc.message, source="[rebalance]") from None
        return cls(section.enabled, policy, gossip, section.drain_timeout_s)


#: `GossipConfig` fields by the `[rebalance]` keys they are set from (the policy's keys are its own).
_GOSSIP_KEYS = {"period_s": "gossip_interval_s", "fanout": "gossip_fanout", "call_timeout_s": "gossip_timeout_s",
                "members_ttl_s": "membership_ttl_s", "max_exchange_entries": "gossip_max_entries"}


class GossipDispatch:
    """The daemon's one `gossip.exchange` handler, passing each call to its job's service.

    A Router cannot unregister a method, and a daemon gossips for every job it serves, so each
    `GossipService` registers on a per-job stand-in router (`for_job`) instead of the daemon's.
    """

    def __init__(self, router: Any) -> None:
        self._handlers: dict[bytes, Callable] = {}
        router.unary(METHOD, self._handle)

    def for_job(self, job_id: bytes) -> "_JobRouter":
        return _JobRouter(self, job_id)

    def drop(self, job_id: bytes) -> None:
        self._handlers.pop(job_id, None)

    async def _handle(self, request: Request) -> Message:
        job = request.meta.get("job") if isinstance(request.meta, dict) else None
        handler = self._handlers.get(job) if isinstance(job, bytes) else None
        if handler is None:
            raise RpcError(CODE_UNAVAILABLE, "this peer does not gossip for that job")
        return await handler(request)


@dataclass(frozen=True)
class _JobRouter:
    dispatch: GossipDispatch
    job_id: bytes

    def unary(self, name: str, handler: Callable) -> None:
        if name != METHOD:
            raise ValueError(f"a job's gossip registers only {METHOD}, not {name}")
        self.dispatch._handlers[self.job_id] = handler


class JobRebalancer:
    """Gossip and move checks for one job on this peer."""

    def __init__(self, job_id: bytes, num_stages: int, identity: Identity, serving: Any, dispatch: GossipDispatch,
                 pool: Any, directory: Any, settings: RebalanceSettings, on_move: Callable[[bool, float], None],
                 supervisor: Supervisor | None = None) -> None:
        self.job_id, self.serving, self.settings, self.on_move = job_id, serving, settings, on_move
        self._speed = 0.0  # last measured samples/s, kept across a move until the new stage measures
        self.gossip = GossipService(job_id, num_stages, identity, self.own_load, dispatch.for_job(job_id), pool,
                                    directory, settings.gossip, supervisor=supervisor)
        self.loop = RebalanceLoop(identity.peer_id, self.gossip.table, self._move, settings.policy,
                                  supervisor=supervisor, name=f"move checks {job_id.hex()[:16]}")
        self._dispatch = dispatch

    async def start(self) -> None:
        await self.gossip.start()
        self.loop.start()

    async def stop(self) -> None:
        """The loop first (a move in progress is undone by `Serving.move`), then the gossip."""
        await self.loop.stop()
        await self.gossip.stop()
        self._dispatch.drop(self.job_id)

    def stages(self) -> list[int]:
        return sorted(stage for job, stage in self.serving.served if job == self.job_id)

    def own_load(self) -> OwnLoad:
        """This peer's entry: where it is going while it moves, else its served stage's live load."""
        moving = self.serving.moving.get(self.job_id)
        if moving is not None:
            stage = moving.source if moving.phase == DRAINING else moving.target
            return OwnLoad(stage, moving.speed or self._speed, 0, moving.phase)
        stages = self.stages()
        if not stages:  # the last stage just went; this rebalancer is about to stop
            return OwnLoad(0, 0.0, 0, DRAINING)
        service = self.serving.served[(self.job_id, stages[0])].service
        live = service.announcement()
        if live["samples_per_s"] > 0:
            self._speed = float(live["samples_per_s"])
        state = {SERVING: SERVING, JOINING: JOINING}.get(service.state, DRAINING)
        return OwnLoad(stages[0], self._speed, int(live["queue"]), state)

    async def _move(self, to_stage: int) -> None:
        stages = self.stages()
        if len(stages) != 1:
            raise MoveFailed(f"this peer serves stages {stages} of the job; only a one-stage peer moves")
        started = time.monotonic()
        try:
            await self.serving.move(self.job_id, stages[0], to_stage, drain_timeout_s=self.settings.drain_timeout_s)
        except MoveFailed:
            self.on_move(False, time.monotonic() - started)
            raise
        self.on_move(True, time.monotonic() - started)

    def status(self) -> dict[str, Any]:
        last = self.loop.decisions[-1] if self.loop.decisions else None
        stats = self.gossip.stats
        checked = self.loop.last_check_at
        return {
            "job": self.job_id.hex(), "stages": self.stages(),
            "moves": self.loop.moves, "failed_moves": self.loop.failed_moves,
            "moving_s": round(self.loop.moving_s, 3),
            "last_check_s_ago": None if checked is None else round(self.loop.clock.time() - checked, 1),
            "last_decision": None if last is None else {"move_to": last.move_to, "reason": last.reason,
                                                         "next_check_in_s": round(last.next_check_at - time.time(), 1)},
            "gossip": {"rounds": stats.rounds, "exchanges_ok": stats.exchanges_ok,
                       "exchanges_failed": stats.exchanges_failed, "entries_accepted": stats.accepted},
        }


class Rebalancing:
    """Every job's rebalancer on this daemon, kept in step with what `Serving` serves."""

    def __init__(self, serving: Any, identity: Identity, router: Any, pool: Any, directory: Any,
                 settings: RebalanceSettings, metrics: Any, supervisor: Supervisor | None = None) -> None:
        self.serving, self.identity, self.pool, self.directory = serving, identity, pool, directory
        self.supervisor = supervisor or Supervisor("rebalancing")
        self.settings, self.metrics = settings, metrics
        self.dispatch = GossipDispatch(router)
        self.jobs: dict[bytes, JobRebalancer] = {}
        self.moves_total = self.failed_moves_total = 0  # since the daemon started, every job
        self._tasks = TaskSet("rebalancing")

    def start(self) -> None:
        if self.settings.enabled:
            self._tasks.spawn(self.supervisor.run("reconcile", self._reconcile_forever), "reconcile")

    async def close(self) -> None:
        """Drain: stop reconciling, then every job's loop (undoing a move under way) and gossip."""
        await self._tasks.aclose("daemon draining")
        jobs, self.jobs = list(self.jobs.values()), {}
        for job in jobs:
            await job.stop()

    async def _reconcile_forever(self) -> None:
        while True:
            await self.reconcile()
            await asyncio.sleep(RECONCILE_S)

    async def reconcile(self) -> None:
        served: dict[bytes, int] = {}
        for (job_id, _), item in list(self.serving.served.items()):
            served[job_id] = item.service.spec.pipeline.stages
        for job_id in [j for j in self.jobs if j not in served and j not in self.serving.moving]:
            await self.jobs.pop(job_id).stop()
            log.info("rebalancing stopped for job %s: no stage of it is served here", job_id.hex()[:16])
        for job_id, stages in served.items():
            if job_id in self.jobs:
                continue
            job = JobRebalancer(job_id, stages, self.identity, self.serving, self.dispatch, self.pool,
                                self.directory, self.settings, self._count_move, self.supervisor)
            started = f"start job {job_id.hex()[:16]}"
            try:
                await job.start()
            except Exception as exc:  # noqa: BLE001 - a bug or a broken part must not end rebalancing
                self.supervisor.record(started, exc, RECONCILE_S)  # for every job: shown, retried
                await job.stop()
                continue
            self.supervisor.recovered(started)
            self.jobs[job_id] = job
            log.info("rebalancing job %s every %g s (gossip every %g s)", job_id.hex()[:16],
                     self.settings.policy.period_s, self.settings.gossip.period_s)

    def _count_move(self, ok: bool, seconds: float) -> None:
        if ok:
            self.moves_total += 1
        else:
            self.failed_moves_total += 1
        self.metrics.rebalance_moves.labels("ok" if ok else "failed").inc()
        self.metrics.rebalance_moving_seconds.inc(seconds)

    def status(self) -> dict[str, Any]:
        """For `swarmctl status`: per job the loop's counters, and the daemon's recent moves."""
        return {"enabled": self.settings.enabled, "period_s": self.settings.policy.period_s,
                "moves_total": self.moves_total, "failed_moves_total": self.failed_moves_total,
                "jobs": [job.status() for job in self.jobs.values()],
                "moves": [asdict(m) for m in self.serving.moves]}
