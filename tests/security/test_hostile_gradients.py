"""A stage-mate that brings an outlier gradient to the all-reduce: the CenteredClip aggregate
(swarmd/stage/robust.py) bounds its pull and every member reports it. The formula is checked
directly; the defence end to end against a real `outlier` process."""

import asyncio
import math

import pytest
import torch

from swarmd.stage import StageLimits
from swarmd.stage.robust import centered_clip
from swarmd.train.trainer import Trainer


def test_without_outliers_centered_clip_is_the_exact_sum():
    """Steps: three gradient sums over 4, 8 and 2 samples, all close to one per-sample mean;
    τ far above their spread. Expected: the result equals their plain sum (to 1e-6) and
    nobody is reported."""
    torch.manual_seed(0)
    base = torch.randn(50)
    samples = [4, 8, 2]
    parts = [(base + 0.01 * torch.randn(50)) * n for n in samples]
    robust = centered_clip(parts, samples, numel=50, tau=10.0, iterations=3, outlier_factor=2.0)
    assert torch.allclose(robust.total, sum(parts), rtol=1e-6, atol=1e-6)
    assert robust.outliers == frozenset()


def test_an_outlier_is_clipped_reported_and_the_sum_rescaled():
    """Steps: two honest sums (4 samples each, per-sample mean ~base) and one multiplied by 1e3;
    τ = 1. Expected: the result is within 2τ·N of the honest per-sample mean times N (N = 12
    samples, the outlier's included: the re-weighting keeps the step's scale), the outlier (index
    2) alone is reported; a non-finite part and a peer with no samples take no part."""
    torch.manual_seed(1)
    base = torch.randn(40)
    honest = [(base + 0.01 * torch.randn(40)) * 4 for _ in range(2)]
    robust = centered_clip([*honest, base * 4 * 1e3], [4, 4, 4], numel=40, tau=1.0, iterations=3, outlier_factor=2.0)
    assert robust.outliers == frozenset({2})
    assert (robust.total / 12 - base).norm() <= 2.0
    nan = centered_clip([*honest, torch.full((40,), math.nan), torch.zeros(40)], [4, 4, 4, 0], numel=40, tau=1.0,
                        iterations=3, outlier_factor=2.0)
    assert nan.outliers == frozenset({2}) and bool(torch.isfinite(nan.total).all())


def test_the_aggregate_setting_is_checked():
    with pytest.raises(ValueError, match="aggregate"):
        StageLimits(aggregate="median")
    with pytest.raises(ValueError, match="clip_tau"):
        StageLimits(clip_tau=0)


@pytest.mark.slow
async def test_an_outlier_peer_is_clipped_and_reported_while_training_goes_on(hostile_swarm, kit):
    """Steps: stage 0 = 2 honest peers + an `outlier` process (its gradient sums × 1e3 before the
    all-reduce), every stage all-reducing with centered_clip (τ 10); 6 steps. Expected: every
    step commits, the loss stays finite and goes down; the honest peers' step records report the
    outlier peer, and only it, whenever it contributed; its pull is bounded: every stage-0
    step's gradient norm stays below clip_iterations·τ + 10 = 40 (the honest norms are ~2-4;
    the plain mean of a ×1e3 part would be in the thousands)."""
    limits = StageLimits(**{**kit.LIMITS.__dict__, "aggregate": "centered_clip", "clip_tau": 10.0})
    swarm, data, pool = await hostile_swarm(2, 0, "outlier", limits=limits, steps=6)
    bad = swarm.hostile[0]
    trainer = Trainer(swarm.spec, kit.JOB_ID, swarm.directory, pool, data, config=kit.TRAINER)
    events = await asyncio.wait_for(trainer.run(0, 6), 90)
    got = [e.global_loss for e in events]
    stage0 = [p for p in swarm.honest if p.stage == 0][0].service.records
    stage1 = [p for p in swarm.honest if p.stage == 1][0].service.records
    print("losses", got)
    print("stage 0", [(r.step, round(r.grad_norm, 3), r.outliers) for r in stage0])
    print("stage 1", [(r.step, round(r.grad_norm, 3)) for r in stage1])
    assert [e.step for e in events] == list(range(6))
    assert all(math.isfinite(x) for x in got) and got[-1] < got[0]
    flagged = {o for r in stage0 for o in r.outliers}
    assert flagged == {bad.peer_id.hex()}, flagged
    info = await kit.stage_info(pool, [p for p in swarm.honest if p.stage == 0][0].addr, 0)
    assert isinstance(info["last_step"]["outliers"], list)
    assert trainer.banned_peers == []
    assert max(r.grad_norm for r in stage0) <= 3 * 10.0 + 10
