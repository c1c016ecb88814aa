"""Stage peers computing on CUDA (the cuda lane: a compute stream, copy streams, pinned buffers),
against the same stage trained on CPU. Needs a GPU: skipped with the reason elsewhere, run by
scripts/gpu-check.sh (`-m cuda`).

What it guards: each backward adds its gradients into the accumulator on the lane's compute
stream, while the all-reduce flattens the sums from another thread on the default stream. If a
batch were answered before its additions finished (`Lane.finish`), a round could read a sum missing
microbatches: the parameters would drift from the reference by whole microbatches' gradients, far
beyond the float noise this test allows."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarmd.directory import StaticDirectory
from swarmd.model import build_stage
from swarmd.optim import StageOptimizer

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device, none here (scripts/gpu-check.sh runs it on a GPU)")]

B, T, C = 2, 16, 32
STAGE = 1  # the middle stage of three: backward takes and returns activations
MICROBATCHES = 16
STEPS = 4
#: CUDA's fp32 kernels sum in another order than CPU's (no TF32: torch's default for matmul):
#: ~1e-6 relative per step; a missed microbatch moves a parameter by ~1/16 of the step's update.
TOLERANCE = 1e-4


def inputs(step: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + m)
    return torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)


def max_rel_diff(module: torch.nn.Module, ref: torch.nn.Module) -> float:
    return max(((p.detach().cpu() - q.detach()).abs().max() / q.detach().abs().max().clamp_min(1e-12)).item()
               for p, q in zip(module.parameters(), ref.parameters()))


async def test_cuda_stage_peers_step_together_and_equal_the_cpu_reference(kit, client):
    """Steps: 2 peers of the middle stage on cuda:0; each of 4 steps sends all 16 microbatches at
    once, alternating peers, so backwards overlap on the lane while rounds flatten.
    Expected: after each step both peers are bit-identical and within TOLERANCE of one module
    trained on CPU with every microbatch; each step record holds 32 samples, no duplicates."""
    spec = kit.make_spec(global_samples=B * MICROBATCHES, microbatch=B, stages=3, optim="sgd")
    directory = StaticDirectory()
    peers = [await kit.start_peer(spec, STAGE, i + 1, directory, device="cuda") for i in range(2)]
    ref = build_stage(spec.model.config, STAGE, spec.pipeline.stages, spec.seed)
    opt = StageOptimizer(ref, spec.optim, spec.steps)
    try:
        for step in range(STEPS):
            async def send(m: int):
                x, gy = inputs(step, m)
                return await kit.call(client, peers[m % 2], "stage.backward", STAGE, step,
                                      step * MICROBATCHES + m, [x, gy], timeout=60)

            answers = await asyncio.gather(*(send(m) for m in range(MICROBATCHES)))
            assert all(a.tensors[0].device.type == "cpu" and a.tensors[0].shape == (B, T, C) for a in answers)
            async with asyncio.timeout(60):
                while not all(p.service.committed > step and p.service.records for p in peers):
                    await asyncio.sleep(0.01)
            for m in range(MICROBATCHES):
                x, gy = inputs(step, m)
                ref(x).backward(gy)
            opt.step(spec.batch.global_samples)
            diffs = [max_rel_diff(p.service.stage, ref) for p in peers]
            print(f"step {step}: max relative difference to the CPU reference per peer {diffs}")
            assert max(diffs) <= TOLERANCE
            for a, b in zip(peers[0].service.stage.parameters(), peers[1].service.stage.parameters()):
                assert a.device.type == "cuda" and torch.equal(a, b)
            record = peers[0].service.records[-1]
            assert record.step == step and record.samples == B * MICROBATCHES and record.summed_duplicates == 0
    finally:
        for p in peers:
            await p.close()
