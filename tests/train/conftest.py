"""Shared by the trainer tests: a tiny job spec on disk, and a swarm of real stage peers on loopback."""

import hashlib
from dataclasses import dataclass, field

import pytest
import torch
from jobspec import job_spec
from waiting import until

from swarmd.directory import StagePeer, StaticDirectory
from swarmd.job import load_spec, open_training_data
from swarmd.stage import StageLimits, StageServer, StageService
from swarmd.train.trainer import TrainerConfig
from swarmd.train.wiring import WiringConfig
from transport.rpc import Pool, Router, RpcServer

torch.set_num_threads(1)

def write_job(tmp_path, *, steps=5, optim="sgd", lr=0.1, stages=3, global_samples=16, microbatch_samples=4,
              in_flight=2, delayed=False):
    """TINY_JOB's model four heads wide on the stdlib's json package (`{stdlib}`), tensors shipped
    uncompressed; its spec and training data."""
    path = tmp_path / "job.toml"
    path.write_text(job_spec("tiny-train", seed=5, steps=steps, files=["{stdlib}/json/*.py"], model={"n_heads": 4},
                             batch={"global_samples": global_samples, "microbatch_samples": microbatch_samples},
                             optim={"name": optim, "lr": lr, "momentum": 0.9, "weight_decay": 0.01, "clip_norm": 1.0},
                             wire={"activations": "none", "gradients": "none"},
                             pipeline={"stages": stages, "microbatches_in_flight": in_flight,
                                       "delayed_updates": delayed}))
    spec = load_spec(path)
    data = open_training_data(spec.data, spec.batch, spec.model.config.vocab, spec.seed, tmp_path)
    return spec, data


@pytest.fixture
def tiny_job(tmp_path):
    return lambda **kw: write_job(tmp_path, **kw)


# ---------------------------------------------------------------------------- a swarm on loopback

JOB_ID = hashlib.sha256(b"train-test-job").digest()
# Stage-mates poll each other often so steps commit within tens of milliseconds. The all-reduce
# in fp32 (allreduce_codec "none", not the fp16 default): the tests on this swarm compare it with
# the single-process fp32 reference at 1e-5; the fp16 default has a test of its own
# (test_train_swarm_equivalence.py) and a tolerance that says why.
STAGE_LIMITS = StageLimits(sync_interval_s=0.02, progress_timeout_s=1.0, round_timeout_s=5.0, max_wait_s=5.0,
                           allreduce_codec="none")
TRAINER_CONFIG = TrainerConfig(forward_timeout_s=20.0, backward_timeout_s=20.0, info_timeout_s=2.0, refresh_s=0.5,
                               wait_initial_s=0.01, wait_max_s=0.2, commit_poll_s=0.01, commit_poll_max_s=0.05,
                               resend_grace_s=1.0, uncovered_grace_s=0.5, wiring=WiringConfig(seed=11))


@dataclass
class ServedPeer:
    """One stage peer: its own Router, RpcServer, Pool and StageService, like one daemon."""

    stage: int
    peer_id: bytes
    service: StageService
    rpc: RpcServer
    pool: Pool
    closed: bool = False

    @property
    def addr(self) -> str:
        host, port = self.rpc.address
        return f"{host}:{port}"

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self.service.stop()
            await self.rpc.close()
            await self.pool.close()


@dataclass
class LoopbackSwarm:
    spec: object
    limits: StageLimits = STAGE_LIMITS
    device: str = "cpu"
    directory: StaticDirectory = field(default_factory=StaticDirectory)
    peers: list[ServedPeer] = field(default_factory=list)

    async def start(self, peers_per_stage: int) -> "LoopbackSwarm":
        for stage in range(self.spec.pipeline.stages):
            for k in range(peers_per_stage):
                await self.add_peer(stage, bytes([stage, k]) * 16)
        return self

    async def add_peer(self, stage: int, peer_id: bytes, router: Router | None = None) -> ServedPeer:
        """`router`: the one the peer serves on (a test's, e.g. one that stalls every call)."""
        router = Router() if router is None else router
        server = StageServer(router)
        rpc = await RpcServer.serve_tcp(router, "127.0.0.1", 0)
        pool = Pool()
        addr = f"{rpc.address[0]}:{rpc.address[1]}"
        service = StageService(self.spec, JOB_ID, stage, peer_id, server, pool, self.directory, address=addr,
                               device=self.device, limits=self.limits)
        await service.start()
        peer = ServedPeer(stage, peer_id, service, rpc, pool)
        announced = await self.directory.peers(JOB_ID, stage)
        self.directory.set(JOB_ID, stage, [*announced, StagePeer(peer_id, addr, stage)])
        self.peers.append(peer)
        return peer

    def of_stage(self, stage: int) -> list[ServedPeer]:
        return [p for p in self.peers if p.stage == stage]

    async def close(self) -> None:
        for peer in self.peers:
            await peer.close()


@pytest.fixture
async def swarm():
    """`await swarm(spec, peers_per_stage, limits)` starts one; all are closed at the end of the test."""
    started: list[LoopbackSwarm] = []

    async def start(spec, peers_per_stage=2, limits=STAGE_LIMITS, device="cpu"):
        started.append(LoopbackSwarm(spec, limits, device))
        return await started[-1].start(peers_per_stage)

    try:
        yield start
    finally:
        for s in started:
            await s.close()


@pytest.fixture
async def pools():
    """`pools(n)`: n client pools (one per trainer), closed at the end of the test."""
    made: list[Pool] = []

    def make(n):
        made.extend(Pool() for _ in range(n))
        return made[-n:]

    try:
        yield make
    finally:
        for pool in made:
            await pool.close()


def max_relative_difference(swarm_: LoopbackSwarm, reference) -> float:
    """Largest |p - q|.max / |q|.max over every parameter of every live peer against the reference."""
    worst = 0.0
    for peer in swarm_.peers:
        if peer.closed:
            continue
        for p, q in zip(peer.service.stage.parameters(), reference.model.stages[peer.stage].parameters()):
            worst = max(worst, ((p.detach() - q.detach()).abs().max() / q.abs().max().clamp_min(1e-12)).item())
    return worst


async def all_committed(swarm_: LoopbackSwarm, steps: int, timeout: float = 10.0) -> None:
    """Until every live peer has committed `steps`: a trainer moves on once a stage's voting peers
    committed, and a peer that was no member of the last round catches up by download a moment
    later (compare parameters only then)."""
    await until(lambda: all(p.service.committed == steps for p in swarm_.peers if not p.closed), timeout,
                f"every live peer at step {steps}")


@pytest.fixture
def kit():
    """The helpers above (importlib mode cannot import conftest from a test module)."""
    from types import SimpleNamespace

    return SimpleNamespace(JOB_ID=JOB_ID, TRAINER_CONFIG=TRAINER_CONFIG, STAGE_LIMITS=STAGE_LIMITS,
                           max_relative_difference=max_relative_difference, all_committed=all_committed)
