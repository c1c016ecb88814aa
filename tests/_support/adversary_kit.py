"""In-process stage peers with identities of their own on loopback, and a stranger that talks to
them through the project's own transport: what the adversary tests (test_adversary_*.py) attack.

Every peer, honest or not, proves an Ed25519 identity in its hello, as in the daemon, so a
handler can tell who called; the honest peers' stage peer id is their transport peer id."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sysconfig

import torch
import jobspec
from stagepeer import Peer, start_stage_peer

from swarmd.directory import StaticDirectory
from swarmd.job import load_spec, open_training_data, parse_toml
from swarmd.stage import StageLimits
from transport.identity import Identity
from transport.rpc import Message, Pool, RpcConfig

JOB = hashlib.sha256(b"adversary-test-job").digest()
B, T, C = 2, 16, 32
STAGE = 1  # the middle stage of three: backward takes and returns activations

#: Three stages of TINY_JOB's model, four heads wide, SGD without clipping, tensors shipped uncompressed.
SPEC = jobspec.job_spec("adversary", seed=5, steps=20, files=["unused.txt"], model={"n_heads": 4},
                        batch={"global_samples": 8}, optim={"momentum": 0.9, "clip_norm": 0.0},
                        wire={"activations": "none", "gradients": "none"}, pipeline={"delayed_updates": False})

# allreduce_codec "none": the honest peers' parameters and losses are compared with the fp32
# reference, which the fp16 default would blur by ~5e-4.
FAST = StageLimits(sync_interval_s=0.02, progress_timeout_s=1.0, round_timeout_s=3.0, max_wait_s=5.0,
                   resume_after_s=1.0, allreduce_codec="none")


#: Two stages a trainer can run on the stdlib's json package (filled in by `training_job`).
TRAIN_SPEC = jobspec.job_spec("adversary-train", seed=7, steps=8, files=["{stdlib}/json/*.py"],
                              model={"n_heads": 4}, batch={"global_samples": 8, "microbatch_samples": 4},
                              optim={"lr": 0.2}, wire={"activations": "none", "gradients": "none"},
                              pipeline={"stages": 2, "microbatches_in_flight": 2})


def training_job(where):
    """The two-stage job a trainer can run (its data: the stdlib's json package), and its data."""
    job_path = where / "job.toml"
    job_path.write_text(TRAIN_SPEC.replace("{stdlib}", sysconfig.get_paths()["stdlib"]))
    job_spec = load_spec(job_path)
    return job_spec, open_training_data(job_spec.data, job_spec.batch, job_spec.model.config.vocab, job_spec.seed,
                                        where)


def spec():
    return parse_toml(SPEC)


async def start_peer(job_spec, stage: int, directory: StaticDirectory, limits: StageLimits = FAST,
                     identity: Identity | None = None) -> Peer:
    """An honest stage peer proving `identity` (a fresh one by default) in its hello."""
    identity = Identity.generate() if identity is None else identity
    return await start_stage_peer(job_spec, JOB, stage, directory, limits, identity=identity)


def stranger_pool(identity: Identity | None = None) -> tuple[Pool, Identity]:
    """A peer of the swarm with a fresh identity (free to make) that announces nothing."""
    identity = Identity.generate() if identity is None else identity
    return Pool(RpcConfig(identity=identity)), identity


def ordered_identities(n: int) -> list[Identity]:
    """`n` fresh identities sorted by peer id: a test that needs one peer sorted before another
    (a round's leader is its smallest id) assigns them, rather than drawing until one sorts low
    (with the other drawn first and near the bottom of the id space, that can take any number)."""
    return sorted((Identity.generate() for _ in range(n)), key=lambda identity: identity.peer_id)


def inputs(step: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + m)
    return torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)


async def backward(pool: Pool, peer: Peer, step: int, m: int, timeout: float = 10.0) -> Message:
    """The trainer's `stage.backward` of microbatch `m` of `step` (4 microbatches a step)."""
    x, gy = inputs(step, m)
    meta = {"job": JOB, "stage": STAGE, "step": step, "mb": step * 4 + m, "samples": B}
    return await pool.call(peer.addr, "stage.backward", Message(meta, [x, gy], codec="none"), timeout=timeout)


async def committed_within(peers: list[Peer], steps: int, timeout: float) -> bool:
    """Whether every peer has committed `steps` steps within `timeout` seconds."""
    try:
        async with asyncio.timeout(timeout):
            while not all(p.service.committed >= steps for p in peers):
                await asyncio.sleep(0.02)
    except TimeoutError:
        return False
    return True


async def progress(pool: Pool, peer: Peer) -> dict:
    """What anyone may ask a stage peer: its step, digest and held ids."""
    reply = await pool.call(peer.addr, "stage.sync.progress", Message({"job": JOB, "stage": STAGE}, codec="none"),
                            timeout=5)
    return reply.meta


def fake_id(low: bool = True) -> bytes:
    """A member id of the attacker's choosing: sorted first (`low`) or anywhere."""
    return b"\x00" * 31 + os.urandom(1) if low else os.urandom(32)
