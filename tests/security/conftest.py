"""Shared by the hostile-peer tests: a tiny two-stage job, honest stage peers in this process on
loopback, and one hostile peer (tests/security/hostile_peer.py) in a process of its own: a stage
peer that lies, or an attacker aimed at one honest peer's address.

With `rpc` settings (e.g. a rate limit) every honest server, pool and the trainer's pool is built
with them and with an identity of its own, as in the daemon, so the transport can tell peers apart.

For hostile peers against real daemons, the job tests' daemon fixtures are here too (`daemons`,
`jobs_kit`, `swarmctl`), and `start_hostile` runs a hostile stage peer that joins through the DHT."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import jobswarm
import pytest
import torch
from jobspec import job_spec, write_job
from jobswarm import swarm_root, swarmctl  # noqa: F401 (fixtures)
from waiting import wait_for

from swarmd.directory import StagePeer, StaticDirectory
from swarmd.job import load_spec, open_training_data
from swarmd.stage import StageLimits, StageServer, StageService
from swarmd.train.trainer import TrainerConfig
from swarmd.train.wiring import WiringConfig
from transport.identity import Identity
from transport.rpc import Message, Pool, Router, RpcConfig, RpcServer

torch.set_num_threads(1)


HOSTILE = Path(__file__).with_name("hostile_peer.py")
REPO = Path(__file__).resolve().parents[2]
JOB_ID = hashlib.sha256(b"hostile-test-job").digest()


def hostile_job(steps: int) -> str:
    """Two stages of TINY_JOB's model, four heads wide, on the stdlib's json package (`{stdlib}`,
    which the daemon expands), SGD with momentum, tensors shipped uncompressed."""
    return job_spec("hostile", seed=7, steps=steps, files=["{stdlib}/json/*.py"], model={"n_heads": 4},
                    batch={"global_samples": 16, "microbatch_samples": 4},
                    optim={"lr": 0.2, "momentum": 0.9, "weight_decay": 0.0, "clip_norm": 1.0},
                    wire={"activations": "none", "gradients": "none"},
                    pipeline={"stages": 2, "microbatches_in_flight": 2, "delayed_updates": False})


# allreduce_codec "none": the honest swarm's losses are compared with the fp32 reference.
LIMITS = StageLimits(sync_interval_s=0.02, progress_timeout_s=1.0, round_timeout_s=5.0, max_wait_s=5.0,
                     allreduce_codec="none")
TRAINER = TrainerConfig(forward_timeout_s=20.0, backward_timeout_s=20.0, info_timeout_s=2.0, refresh_s=0.5,
                        wait_initial_s=0.01, wait_max_s=0.2, commit_poll_s=0.01, commit_poll_max_s=0.05,
                        resend_grace_s=1.0, uncovered_grace_s=0.5, wiring=WiringConfig(seed=3))


@dataclass
class Honest:
    peer_id: bytes
    stage: int
    service: StageService
    rpc: RpcServer
    pool: Pool
    identity: Identity | None  # with `rpc` settings: the key its connections prove (peer_id is its id)

    @property
    def addr(self) -> str:
        return f"{self.rpc.address[0]}:{self.rpc.address[1]}"


@dataclass
class HostileProcess:
    peer_id: bytes
    stage: int
    addr: str
    announcement: dict
    process: asyncio.subprocess.Process
    transport_id: bytes | None  # the peer id its connections prove, when it dials as itself
    finished: dict | None = None

    async def finish(self) -> dict | None:
        """Close its stdin and wait for it; an attacker's report of what it saw (None for a stage peer)."""
        if self.process.returncode is None and not self.process.stdin.is_closing():
            self.process.stdin.close()
            line = await asyncio.wait_for(self.process.stdout.readline(), 30)
            self.finished = json.loads(line) if line.strip() else None
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        return self.finished


@dataclass
class Swarm:
    spec: object
    job_path: Path
    limits: StageLimits
    rpc: dict = field(default_factory=dict)
    directory: StaticDirectory = field(default_factory=StaticDirectory)
    honest: list[Honest] = field(default_factory=list)
    hostile: list[HostileProcess] = field(default_factory=list)

    async def announce(self, stage: int, peer_id: bytes, addr: str) -> None:
        current = await self.directory.peers(JOB_ID, stage)
        self.directory.set(JOB_ID, stage, [*current, StagePeer(peer_id, addr, stage)])

    def rpc_config(self, seed: bytes | None = None) -> RpcConfig:
        if not self.rpc:
            return RpcConfig()
        identity = Identity.from_seed(seed) if seed is not None else Identity.generate()
        return RpcConfig(identity=identity, **self.rpc)

    async def add_honest(self, stage: int, k: int) -> Honest:
        router = Router()
        seed = bytes([stage, k]) * 16
        config = self.rpc_config(seed)
        peer_id = config.identity.peer_id if config.identity is not None else seed
        rpc = await RpcServer.serve_tcp(router, "127.0.0.1", 0, config=config)
        pool = Pool(config)
        addr = f"{rpc.address[0]}:{rpc.address[1]}"
        service = StageService(self.spec, JOB_ID, stage, peer_id, StageServer(router), pool, self.directory,
                               address=addr, limits=self.limits)
        await service.start()
        await self.announce(stage, peer_id, addr)
        peer = Honest(peer_id, stage, service, rpc, pool, config.identity)
        self.honest.append(peer)
        return peer

    async def add_hostile(self, stage: int, mode: str, target: str = "", victim_key: bytes = b"") -> HostileProcess:
        """Start the hostile peer after its honest mates: it is told them on its command line. An
        attacker (`target` set) is not announced: it is no stage peer, only a peer of the swarm."""
        peer_id = bytes([stage, 0xEE]) * 16
        mates = ",".join(f"{p.peer_id.hex()}@{p.addr}" for p in self.honest if p.stage == stage)
        limits = {k: v for k, v in asdict(self.limits).items() if v is not None}
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(HOSTILE), "--job", str(self.job_path), "--job-id", JOB_ID.hex(),
            "--stage", str(stage), "--peer-id", peer_id.hex(), "--mode", mode, "--mates", mates,
            "--limits", json.dumps(limits), "--target", target,
            "--victim-key", victim_key.hex(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(REPO)})
        line = await asyncio.wait_for(process.stdout.readline(), 60)
        if not line:
            raise RuntimeError(f"the hostile peer ({mode}) exited with {await process.wait()}")
        ready = json.loads(line)
        if not target:
            await self.announce(stage, peer_id, ready["addr"])
        transport_id = bytes.fromhex(ready["transport_id"]) if ready["transport_id"] else None
        hostile = HostileProcess(peer_id, stage, ready["addr"], ready["announcement"], process, transport_id)
        self.hostile.append(hostile)
        return hostile

    async def close(self) -> None:
        for h in self.hostile:
            try:
                await h.finish()
            except (TimeoutError, ValueError):
                h.process.kill()
                await h.process.wait()
        for p in self.honest:
            await p.service.stop()
            await p.rpc.close()
            await p.pool.close()


@pytest.fixture
async def hostile_swarm(tmp_path):
    """`await hostile_swarm(honest_per_stage, hostile_stage, mode, limits)`: the honest peers of
    both stages, then the hostile one; everything is closed at the end of the test. `target(swarm)`
    picks the address an attacking mode attacks, `victim(swarm)` the public key `spoof` claims; `rpc` is RpcConfig settings for every honest
    server and pool (and the returned trainer pool)."""
    made: list[Swarm] = []
    pools: list[Pool] = []

    async def start(honest_per_stage: int, hostile_stage: int, mode: str, limits: StageLimits = LIMITS,
                    steps: int = 6, rpc: dict | None = None, target=None, victim=None) -> tuple[Swarm, object, Pool]:
        job_path = tmp_path / "job.toml"
        job_path.write_text(hostile_job(steps))
        spec = load_spec(job_path)
        data = open_training_data(spec.data, spec.batch, spec.model.config.vocab, spec.seed, tmp_path)
        swarm = Swarm(spec, job_path, limits, rpc or {})
        made.append(swarm)
        for stage in range(spec.pipeline.stages):
            for k in range(honest_per_stage):
                await swarm.add_honest(stage, k)
        await swarm.add_hostile(hostile_stage, mode, target(swarm) if target else "",
                                victim(swarm) if victim else b"")
        pools.append(Pool(swarm.rpc_config()))
        return swarm, data, pools[-1]

    try:
        yield start
    finally:
        for pool in pools:
            await pool.close()
        for swarm in made:
            await swarm.close()


async def stage_info(pool: Pool, addr: str, stage: int) -> dict:
    reply = await pool.call(addr, "stage.info", Message({"job": JOB_ID, "stage": stage}, codec="none"), timeout=5)
    return reply.meta


@pytest.fixture
def kit():
    """Constants and helpers (importlib mode cannot import conftest from a test module)."""
    return SimpleNamespace(JOB_ID=JOB_ID, LIMITS=LIMITS, TRAINER=TRAINER, stage_info=stage_info)


@pytest.fixture(scope="module")
def daemons(swarm_root):
    """The job tests' real `swarmd` processes (`daemons.start(name, *flags)`), killed at the end."""
    started = jobswarm.Swarm(swarm_root)
    try:
        yield started
    finally:
        started.close()


@pytest.fixture(scope="session")
def jobs_kit():
    """The job tests' helpers: writing a job and its corpus, waiting, a finished job, its step events."""
    return SimpleNamespace(write_job=write_job, wait_for=wait_for, finished=jobswarm.finished,
                           step_events=jobswarm.step_events)


@pytest.fixture
async def start_hostile():
    """`await start_hostile(job_path, job_id, stage, mode, bootstrap)`: a hostile stage peer that
    joins `stage` through the DHT node at `bootstrap` (its peer id: `transport_id`); finished at
    the end of the test."""
    started: list[HostileProcess] = []

    async def start(job_path: Path, job_id: bytes, stage: int, mode: str, bootstrap: str) -> HostileProcess:
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(HOSTILE), "--job", str(job_path), "--job-id", job_id.hex(), "--stage", str(stage),
            "--mode", mode, "--bootstrap", bootstrap, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(REPO)})
        line = await asyncio.wait_for(process.stdout.readline(), 90)
        if not line:
            raise RuntimeError(f"the hostile peer ({mode}) exited with {await process.wait()}")
        ready = json.loads(line)
        peer_id = bytes.fromhex(ready["transport_id"])
        hostile = HostileProcess(peer_id, stage, ready["addr"], ready["announcement"], process, peer_id)
        started.append(hostile)
        return hostile

    try:
        yield start
    finally:
        for hostile in started:
            try:
                await hostile.finish()
            except (TimeoutError, ValueError):
                hostile.process.kill()
                await hostile.process.wait()
