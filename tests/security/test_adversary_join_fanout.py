"""A daemon lending itself to every job (`jobs.serve = "all"`) against many strangers' jobs it
cannot serve, without processes: the join loop's work and log lines per tick.

Each tick tried every listed job it admits: a `stage_peers` read (one DHT read and the probes of
every stage), then a start that the stage-memory bound refuses, with a WARNING line. A spec is one
signed record and one identity may list 64, so a stranger's hundred oversized jobs cost an idle
daemon a hundred reads of every stage and a hundred warnings every `join_interval_s`, for ever.
Now a tick tries at most `MAX_JOIN_TRIES_PER_TICK` jobs it serves nothing of (the least recently
tried first), a job whose join failed waits `JOIN_RETRY_INTERVALS` join intervals (10 s), doubled per
failure up to
`JOIN_RETRY_MAX_S`, and its failure is logged at WARNING once, then at debug.
"""

from __future__ import annotations

import logging

from adversary_kit import spec

from swarmd.errors import Busy
from swarmd.jobs.joining import MAX_JOIN_TRIES_PER_TICK, Joining
from swarmd.jobs.registry import Job

JOBS = 100


class Registry:
    """What the join loop reads of the registry: `JOBS` listed jobs, each stage with one peer."""

    def __init__(self) -> None:
        job_spec = spec()
        self.jobs = {bytes([i]) * 32: Job(bytes([i]) * 32, job_spec, b"s" * 32, local=False) for i in range(JOBS)}
        self.listed = set(self.jobs)
        self.reads = 0
        self.dht = self

    async def refresh(self) -> None:
        return None

    async def settle(self) -> None:
        return None

    def publish_progress(self) -> None:
        return None

    async def stage_peers(self, job: Job) -> list[dict]:
        self.reads += 1
        return [{"stage": i, "peers": []} for i in range(job.spec.pipeline.stages)]

    def announce(self, key, value_fn):
        return key

    async def withdraw(self, announcement) -> None:
        return None


class Serving:
    address = "127.0.0.1:1"

    def __init__(self) -> None:
        self.served: dict = {}
        self.tries = 0

    async def serve(self, job_spec, job_id: bytes, stage: int, *, submitter: bytes) -> None:
        self.tries += 1
        raise Busy(f"stage {stage}: needs 9 GiB, over jobs.max_stage_memory (1 GiB)")


async def test_a_hundred_unservable_jobs_cost_a_bounded_join_tick(caplog):
    """Three ticks over 100 admitted jobs whose stages are too big. Expected: at most
    MAX_JOIN_TRIES_PER_TICK reads and starts per tick, and one WARNING per job at most (before:
    100 reads, 100 starts and 100 warnings a tick)."""
    registry, serving = Registry(), Serving()
    joining = Joining(registry, serving, None, peer_id=b"p" * 32, serve="all", max_stages=4, interval_s=5.0,
                      rejoin_wait_s=60.0, settle_s=0.0, min_stage_peers=1)
    with caplog.at_level(logging.DEBUG, logger="swarmd.jobs.joining"):
        for _ in range(3):
            await joining.tick()
    # Two reads a try: where to go, and again once simultaneous joiners announced themselves.
    assert registry.reads <= 2 * 3 * MAX_JOIN_TRIES_PER_TICK and serving.tries <= 3 * MAX_JOIN_TRIES_PER_TICK
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING and "could not serve" in r.getMessage()]
    jobs = [r.getMessage().split("(")[1].split(")")[0] for r in warned]  # the job id in each line
    assert len(jobs) == len(set(jobs)) <= serving.tries


async def test_the_tries_go_round_every_job(monkeypatch):
    """Fairness: with failures backed off, every one of the 100 jobs is tried within
    ceil(100 / MAX_JOIN_TRIES_PER_TICK) ticks, none twice meanwhile."""
    registry, serving = Registry(), Serving()
    joining = Joining(registry, serving, None, peer_id=b"p" * 32, serve="all", max_stages=4, interval_s=5.0,
                      rejoin_wait_s=60.0, settle_s=0.0, min_stage_peers=1)
    tried: list[bytes] = []

    async def serve(job_spec, job_id, stage, *, submitter):
        tried.append(job_id)
        raise Busy("too big")

    monkeypatch.setattr(serving, "serve", serve)
    for _ in range(-(-JOBS // MAX_JOIN_TRIES_PER_TICK)):
        await joining.tick()
    assert sorted(tried) == sorted(registry.jobs)
