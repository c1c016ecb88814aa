"""A stranger's job spec cannot make an idle daemon do unbounded work (issue 13, hole 5).

One real daemon volunteers (`jobs.serve = "all"`, empty `accept_jobs_from`) with
`jobs.max_stage_memory` = 512 MiB. A stranger (a DHT node of its own in this process, with a fresh
identity) publishes three jobs straight into the DHT, as any peer may: `huge` (d_model 1024, four
layers per stage: about 50 M parameters a stage, some 1.3 GiB by the estimate), `endless`
(`pipeline.stages = 10^9`, which the old daemon looped DHT reads over for ever) and `tiny`. The
daemon must serve `tiny` (it does volunteer), refuse `huge` before building anything with the
estimate and the limit in its log, never learn `endless` (refused when its spec is parsed), and
its RSS must grow by less than `RSS_GROWTH_BOUND` while it does so (building `huge`'s stage, as
the old daemon did, costs over 200 MB of weights alone)."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import msgpack
import pytest

from swarmd.client import ControlError
from swarmd.dht import DHTNode, dht_key
from swarmd.dht.rpc_network import RpcNetwork
from swarmd.job import JobSpec
from transport.identity import Identity
from transport.rpc import Pool, Router, RpcConfig, RpcServer

pytestmark = pytest.mark.slow
MAX_STAGE_MEMORY = 512 * 2**20
#: What the daemon may grow by while it learns the three jobs and serves `tiny` (a 32-wide stage
#: of a few MB, plus the buffers of a job it serves): far below `huge`'s 200 MB of weights.
RSS_GROWTH_BOUND = 150 * 2**20
JOIN_TIMEOUT_S = 90.0


def raw_spec(name: str, **model) -> dict:
    return {"name": name, "seed": 1, "steps": 10,
            "model": {"arch": "transformer-lm", "d_model": 32, "n_heads": 2, "layers_per_stage": 1, **model},
            "data": {"tokens": "t.bin", "seq_len": 64}, "batch": {"global_samples": 8, "microbatch_samples": 4},
            "pipeline": {"stages": 1}}


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class Stranger:
    """A DHT node with an identity nobody listed, publishing job records the way a daemon's
    registry does: the spec under ("job", id, "spec"), the ids under ("jobs",)."""

    def __init__(self) -> None:
        self.identity = Identity.generate()
        self.config = RpcConfig(identity=self.identity)
        self.router, self.pool = Router(), Pool(self.config)
        self.announcements: list = []
        self.rpc = self.dht = None

    async def start(self, bootstrap: str) -> None:
        self.rpc = await RpcServer.serve_tcp(self.router, "127.0.0.1", 0, config=self.config)
        addr = f"{self.rpc.address[0]}:{self.rpc.address[1]}"
        self.dht = DHTNode(self.identity, RpcNetwork(self.router, self.pool, addr))
        await self.dht.start()
        assert await self.dht.bootstrap([bootstrap]) > 0

    def publish(self, specs: list[dict]) -> list[bytes]:
        ids = []
        for raw in specs:
            value = msgpack.packb(raw, use_bin_type=True)
            try:  # a valid spec gets its real id (daemons check it); an invalid one any id
                job_id = JobSpec.from_dict(raw).job_id(self.identity.public_key)
                value = JobSpec.from_dict(raw).to_msgpack()
            except ValueError:
                job_id = hashlib.sha256(value).digest()
            self.announcements.append(self.dht.announce(dht_key("job", job_id, "spec"), lambda v=value: v))
            ids.append(job_id)
        index = msgpack.packb(ids, use_bin_type=True)
        self.announcements.append(self.dht.announce(dht_key("jobs"), lambda: index))
        return ids

    async def close(self) -> None:
        if self.dht is not None:
            await self.dht.stop()
        if self.rpc is not None:
            await self.rpc.close()
        await self.pool.close()


@pytest.fixture
async def stranger():
    node = Stranger()
    try:
        yield node
    finally:
        await node.close()


async def test_a_strangers_huge_spec_is_refused_by_a_volunteer_whose_memory_stays_small(
        daemons, jobs_kit, stranger) -> None:
    volunteer = await asyncio.to_thread(daemons.start, "volunteer", env={
        "SWARMD_JOBS_SERVE": "all", "SWARMD_JOBS_MAX_STAGE_MEMORY": str(MAX_STAGE_MEMORY)})
    before = rss(volunteer.proc.pid)
    await stranger.start(volunteer.status["announce"])
    huge = raw_spec("huge", d_model=1024, n_heads=8, layers_per_stage=4)
    endless = {**raw_spec("endless"), "pipeline": {"stages": 10**9}}
    huge_id, _, tiny_id = stranger.publish([huge, endless, raw_spec("tiny")])

    def served(job_id: bytes) -> bool:
        try:
            stages = volunteer.client.job(job_id.hex())["stages"]
        except ControlError as exc:  # not learned yet: the index is read every join interval
            assert exc.code == "not_found", exc
            return False
        return any(p["peer_id"] == volunteer.status["peer_id"] for s in stages for p in s["peers"])

    # The stranger's DHT node answers on this loop: every blocking wait runs in a thread.
    await asyncio.to_thread(jobs_kit.wait_for, lambda: served(tiny_id), JOIN_TIMEOUT_S,
                            "the volunteer to serve the stranger's tiny job")
    await asyncio.to_thread(jobs_kit.wait_for, lambda: "stage 0 of job huge needs about" in volunteer.log.read_text(),
                            JOIN_TIMEOUT_S, "the volunteer to log why it refused the huge job")
    log = volunteer.log.read_text()
    print(log[-3000:])
    assert f"over this daemon's jobs.max_stage_memory ({MAX_STAGE_MEMORY / 2**20:.1f} MiB)" in log
    assert not await asyncio.to_thread(served, huge_id)
    assert all(j["name"] != "endless" for j in await asyncio.to_thread(volunteer.client.jobs))
    assert "Traceback" not in log
    grown = rss(volunteer.proc.pid) - before
    print(f"RSS {before / 2**20:.0f} MiB before, grew by {grown / 2**20:.0f} MiB")
    assert grown < RSS_GROWTH_BOUND
