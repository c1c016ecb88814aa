"""A stage-mate with a slow uplink (issue 14, item 3): real stage peers on loopback, B's all-reduce
sends shaped to a fixed byte rate (one uplink: its parts leave one after another), the trainer
played by the test. Each of these failed on the code before per-phase deadlines and shard owners."""

from __future__ import annotations

import asyncio
import time

import torch
from jobspec import job_spec
from stageref import reference_stage

from swarmd.directory import StaticDirectory
from swarmd.job import parse_toml
from swarmd.model import build_stage
from swarmd.stage import StageLimits

STAGE = 1
D = 96  # 111,840 parameters: 447 KB of fp32 gradient, parts of a third of it are measured (>= 64 KiB)
B, T = 2, 16
#: Three stages of TINY_JOB's model, D wide with four heads, without clipping, tensors uncompressed.
SPEC = job_spec("straggler-test", seed=5, steps=20, files=["unused.txt"], model={"d_model": D, "n_heads": 4},
                data={"seq_len": T}, batch={"global_samples": 8}, optim={"momentum": 0.9, "clip_norm": 0.0},
                wire={"activations": "none", "gradients": "none"}, pipeline={"stages": 3})
CAP_S = 3.0  # round_timeout_s: the cap of each phase's deadline (of the whole round, before)
# allreduce_codec "none": the survivors are compared with the fp32 reference at 1e-5.
LIMITS = StageLimits(sync_interval_s=0.02, progress_timeout_s=1.0, round_timeout_s=CAP_S, max_wait_s=5.0,
                     resume_after_s=1.0, allreduce_codec="none")


def inputs(step, m):
    g = torch.Generator().manual_seed(700 + 10 * step + m)
    return torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)


def reference(spec, steps):
    """A single-process stage that applied every microbatch of each step once."""
    return reference_stage(spec, STAGE, 3, steps, inputs)


def shape_uplink(peer, rate: float) -> list[float]:
    """B's all-reduce parts leave at `rate` bytes/s, one at a time; returns the list the seconds
    its parts spent on the link are added to."""
    real, link, spent = peer.service.pool.call, asyncio.Lock(), []

    async def shaped(addr, method, message, **kw):
        if method in ("stage.sync.reduce", "stage.sync.gather"):
            size = sum(t.numel() * t.element_size() for t in message.tensors)
            async with link:
                await asyncio.sleep(size / rate)
            spent.append(size / rate)
        return await real(addr, method, message, **kw)

    peer.service.pool.call = shaped
    return spent


async def test_a_mate_whose_round_outlasts_one_deadline_keeps_contributing_every_step(kit, client):
    """Steps: A, B, C serve stage 1; B's uplink carries its whole gradient in 2.5 s. As a shard
    owner B sends 2/3 of it in the reduce-scatter and 2/3 again in the all-gather (3.3 s: past a
    3 s round timeout, so every round with it used to fail, it was benched, and its microbatches
    were never summed). The trainer sends each microbatch once, round robin over A, B and C.
    Expected: each phase gets its own deadline, and once B's rate is measured it owns no shard
    (sends its vector once, 2.5 s, and the all-gather does not wait on it): three steps commit on
    every peer (none fails the round and downloads instead), each from all three members' sums
    (B's included: nothing is re-sent), every peer equal to the single-process reference and to
    each other."""
    spec = parse_toml(SPEC)
    numel = sum(p.numel() for p in build_stage(spec.model.config, STAGE, 3, spec.seed).parameters())
    directory = StaticDirectory()
    peers = [await kit.start_peer(spec, STAGE, i, directory, limits=LIMITS) for i in (1, 2, 3)]
    a, b, c = peers
    spent = shape_uplink(b, rate=numel * 4 / 2.5)
    try:
        began = time.monotonic()
        for step in range(3):
            for m in range(4):
                x, gy = inputs(step, m)
                target = peers[(step + m) % 3]
                reply = await kit.call(client, target, "stage.backward", STAGE, step, step * 4 + m, [x, gy],
                                       timeout=30)
                assert reply.meta["added"] is True
            async with asyncio.timeout(30):
                while not all(p.service.committed > step for p in peers):
                    await asyncio.sleep(0.02)
        took = time.monotonic() - began
        print(f"3 steps in {took:.1f} s; B's uplink busy {sum(spent):.1f} s; (step, members) committed by A, B, "
              f"C: {[[(r.step, r.members) for r in p.service.records] for p in peers]}")
        for peer in peers:  # each committed every step itself (a member that failed would download instead)
            records = list(peer.service.records)
            assert [(r.step, r.members) for r in records] == [(0, 3), (1, 3), (2, 3)]
            assert all(r.samples == spec.batch.global_samples and r.summed_duplicates == 0 for r in records)
        assert a.service.digest == b.service.digest == c.service.digest
        ref = reference(spec, 3)
        for peer in peers:
            for p, q in zip(peer.service.stage.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    finally:
        for peer in peers:
            await peer.close()
