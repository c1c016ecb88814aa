"""Stage peers on loopback for the stage tests: each with its own RpcServer, Router and Pool."""

from __future__ import annotations

import hashlib

import pytest
import torch
from jobspec import job_spec
from stagepeer import Peer, start_stage_peer

from swarmd.directory import StaticDirectory
from swarmd.job import parse_toml
from swarmd.stage import StageLimits
from transport.errors import RemoteError
from transport.rpc import Message, Pool, Router

torch.set_num_threads(1)

JOB = hashlib.sha256(b"stage-test-job").digest()
# allreduce_codec "none": the tests built on FAST compare the peers with the single-process fp32
# reference at 1e-5 (or bit-for-bit); the fp16 default would put them ~4e-4 off (its own tests
# say so: test_stage_allreduce_step.py's lossy-codec test).
FAST = StageLimits(sync_interval_s=0.02, progress_timeout_s=1.0, round_timeout_s=3.0, max_wait_s=5.0,
                   resume_after_s=1.0, allreduce_codec="none")


def make_spec(global_samples=8, microbatch=2, optim="sgd", stages=2, delayed=False, every=0):
    """TINY_JOB's model four heads wide, without clipping, tensors shipped uncompressed."""
    return parse_toml(job_spec("stage-test", seed=5, steps=20, files=["unused.txt"], model={"n_heads": 4},
                               batch={"global_samples": global_samples, "microbatch_samples": microbatch},
                               optim={"name": optim, "momentum": 0.9, "clip_norm": 0.0},
                               wire={"activations": "none", "gradients": "none"},
                               pipeline={"stages": stages, "delayed_updates": delayed},
                               checkpoint={"every_steps": every}))


async def start_peer(spec, stage, index, directory: StaticDirectory, limits=FAST, state_dir=None,
                     router: Router | None = None, announce=True, anchor=None, device="cpu") -> Peer:
    """A stage peer whose peer id is `index` repeated (tests/_support/stagepeer.py)."""
    return await start_stage_peer(spec, JOB, stage, directory, limits, peer_id=bytes([index]) * 32,
                                  state_dir=state_dir, router=router, announce=announce, anchor=anchor, device=device)


@pytest.fixture
async def client():
    pool = Pool()
    try:
        yield pool
    finally:
        await pool.close()


def meta(stage):
    return {"job": JOB, "stage": stage}


def call_meta(stage, step, mb, samples):
    return {"job": JOB, "stage": stage, "step": step, "mb": mb, "samples": samples}


async def call(pool, peer, method, stage, step, mb, tensors, timeout=10.0):
    samples = tensors[0].shape[0]
    return await pool.call(peer.addr, method, Message(call_meta(stage, step, mb, samples), tensors, codec="none"),
                           timeout=timeout)


async def code_of(pool, addr, method, meta, tensors=()) -> str:
    """The refusal code of one call ("ok" if it was answered), for tests of what a peer refuses."""
    try:
        await pool.call(addr, method, Message(meta, list(tensors), codec="none"), timeout=5)
        return "ok"
    except RemoteError as exc:
        return exc.code


@pytest.fixture
def kit():
    """The helpers above (pytest's importlib mode cannot import conftest from a test module)."""
    from types import SimpleNamespace

    return SimpleNamespace(FAST=FAST, JOB=JOB, call=call, call_meta=call_meta, code_of=code_of, meta=meta,
                           make_spec=make_spec, start_peer=start_peer)
