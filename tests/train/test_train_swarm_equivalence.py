"""Trainers driving real stage peers (StageServer + StageService) over loopback TCP, in one process,
against the single-process reference trainer. The swarm all-reduces in fp32 (conftest's
STAGE_LIMITS: allreduce_codec "none") except where a test says otherwise."""

import asyncio
import dataclasses
import math
import threading

import pytest
import torch
from waiting import until

from swarmd.reference import ReferenceTrainer
from swarmd.stage import StageLimits
from swarmd.train.trainer import Trainer

pytestmark = pytest.mark.slow


def global_losses(events, global_samples):
    """The step's mean loss from every shard's events: Σ shard_loss × samples / global_samples."""
    by_step = {}
    for e in events:
        by_step[e.step] = by_step.get(e.step, 0.0) + e.shard_loss * e.samples
    return [by_step[s] / global_samples for s in sorted(by_step)]


async def mates_identical_at(swarm_, steps: int) -> None:
    """Every stage's two peers committed `steps` and hold the same parameters, bit for bit (I2). A
    trainer moves on once one peer reports the commit; its mate applies it a moment later."""
    for _ in range(100):
        if all(peer.service.committed == steps for peer in swarm_.peers):
            break
        await asyncio.sleep(0.1)
    for stage in range(swarm_.spec.pipeline.stages):
        first, second = swarm_.of_stage(stage)
        assert first.service.committed == second.service.committed == steps
        for a, b in zip(first.service.stage.parameters(), second.service.stage.parameters()):
            assert torch.equal(a, b), stage


async def run_trainers(spec, data, swarm_, pools, kit, shards=2, steps=5):
    events = []
    trainers = [Trainer(spec, kit.JOB_ID, swarm_.directory, pool, data, shard=k, shards=shards,
                        config=kit.TRAINER_CONFIG, on_event=events.append)
                for k, pool in enumerate(pools(shards))]
    results = await asyncio.wait_for(asyncio.gather(*(t.run(0, steps) for t in trainers)), timeout=60)
    return trainers, results, [e for e in events if hasattr(e, "step")]


async def test_sgd_with_momentum_matches_the_reference(tiny_job, swarm, pools, kit):
    """Steps: 3 stages × 2 peers, 2 trainers (shards 0 and 1 of 2), codec none, SGD with momentum,
    delayed_updates = false; train 5 steps. Expected: every peer of every stage holds the
    reference's parameters within 1e-5 relative; each step's loss equals the reference's; every
    stage's step record has exactly global_samples and no duplicates."""
    spec, data = tiny_job(optim="sgd", lr=0.1)
    swarm_ = await swarm(spec, peers_per_stage=2)
    trainers, results, events = await run_trainers(spec, data, swarm_, pools, kit)
    reference = ReferenceTrainer(spec, data)
    ref_losses = [r.loss for r in reference.train(5)]

    assert [[e.step for e in r] for r in results] == [list(range(5))] * 2
    losses = global_losses(events, spec.batch.global_samples)
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, ref_losses)
    for e in events:
        assert e.stage_samples == (spec.batch.global_samples,) * 3 and e.duplicates == (0, 0, 0), e
    await kit.all_committed(swarm_, 5)
    worst = kit.max_relative_difference(swarm_, reference)
    print(f"SGD+momentum, 5 steps, 3 stages x 2 peers, 2 trainers: max relative difference {worst:.2e}")
    assert worst <= 1e-5
    # Both peers of every stage did work: the wiring spread it.
    for stage in range(3):
        assert all(t.wiring[stage].samples_per_s(p.peer_id) < math.inf
                   for t in trainers for p in swarm_.of_stage(stage)), stage


async def test_the_fp16_all_reduce_default_keeps_every_steps_loss_near_the_reference(tiny_job, swarm, pools, kit):
    """Steps: as above (3 stages x 2 peers, 2 trainers, SGD with momentum, 5 steps), with the
    stage all-reduce left at its default, fp16. Expected: each step's global mean loss within
    1e-4 relative of the fp32 reference's, the parameters within 2e-3, and the mates of every
    stage bit-identical (I2: one averaged gradient on every member).
    Why these tolerances: each element of the averaged gradient is rounded to fp16 at most twice
    (a member's sum, the owner's total), 2^-11 = 4.9e-4 relative each, unbiased; a step moves a
    weight by lr x gradient, so the parameters drift from the reference by a few 1e-4 of their
    update, and the loss, which the forward pass takes from them, far less (4 runs: loss 6.1e-7 to
    1.1e-6, parameters 4.9e-4 to 5.7e-4)."""
    assert StageLimits().allreduce_codec == "fp16"
    spec, data = tiny_job(optim="sgd", lr=0.1)
    swarm_ = await swarm(spec, peers_per_stage=2, limits=dataclasses.replace(kit.STAGE_LIMITS, allreduce_codec="fp16"))
    _, results, events = await run_trainers(spec, data, swarm_, pools, kit)
    reference = ReferenceTrainer(spec, data)
    ref_losses = [r.loss for r in reference.train(5)]
    losses = global_losses(events, spec.batch.global_samples)
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    await kit.all_committed(swarm_, 5)
    worst = kit.max_relative_difference(swarm_, reference)
    print(f"fp16 all-reduce: losses {[round(v, 5) for v in losses]}, reference {[round(v, 5) for v in ref_losses]}, "
          f"max relative loss difference {loss_diff:.2e}, parameters {worst:.2e}")
    assert len(losses) == 5 and loss_diff <= 1e-4
    assert worst <= 2e-3
    await mates_identical_at(swarm_, 5)


@pytest.mark.parametrize("offload", [False, True], ids=["on_device", "optimizer_offload"])
async def test_adamw_losses_match_the_reference_every_step(tiny_job, swarm, pools, kit, offload):
    """Steps: the same swarm with AdamW (lr 3e-3); 5 steps; with `[compute] optimizer_offload` the
    stage peers step their optimizer state on the host (the reference does not). Expected: each
    step's global mean loss within 1e-3 relative of the reference's."""
    spec, data = tiny_job(optim="adamw", lr=3e-3)
    served = dataclasses.replace(spec, compute=dataclasses.replace(spec.compute, optimizer_offload=offload))
    swarm_ = await swarm(served, peers_per_stage=2)
    _, _, events = await run_trainers(served, data, swarm_, pools, kit)
    ref_losses = [r.loss for r in ReferenceTrainer(spec, data).train(5)]
    losses = global_losses(events, spec.batch.global_samples)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    print(f"AdamW losses {[round(v, 4) for v in losses]}, reference {[round(v, 4) for v in ref_losses]}, "
          f"max relative difference {worst:.2e}")
    assert len(losses) == 5 and worst <= 1e-3


async def test_one_trainer_reports_the_global_loss(tiny_job, swarm, pools, kit):
    """Steps: 2 stages × 1 peer, one trainer (K = 1), 4 microbatches in flight, 2 steps; then a new
    trainer with no start step. Expected: `global_loss` of each event equals the reference's loss;
    tokens/s and peers per stage reported; the new trainer starts at the swarm's step, 2."""
    spec, data = tiny_job(optim="sgd", lr=0.1, stages=2, in_flight=4)
    swarm_ = await swarm(spec, peers_per_stage=1)
    _, results, events = await run_trainers(spec, data, swarm_, pools, kit, shards=1, steps=2)
    ref_losses = [r.loss for r in ReferenceTrainer(spec, data).train(2)]
    assert [e.global_loss for e in events] == [e.shard_loss for e in events]
    for e, want in zip(events, ref_losses):
        assert abs(e.global_loss - want) <= 1e-5 * want
        assert e.tokens_per_s > 0 and e.peers_per_stage == (1, 1) and e.samples == spec.batch.global_samples
    # A trainer joining now starts where the swarm is: step 2.
    late = Trainer(spec, kit.JOB_ID, swarm_.directory, pools(1)[0], data, config=kit.TRAINER_CONFIG)
    assert [e.step for e in await asyncio.wait_for(late.run(stop_step=3), 30)] == [2]


class GatedData:
    """The training data, whose microbatches of `step` and later are handed out only once `gate`
    is set (read in a thread, `asyncio.to_thread`, so the event loop runs on meanwhile)."""

    def __init__(self, data, step: int, gate: threading.Event) -> None:
        self._data, self._step, self._gate = data, step, gate

    def microbatch(self, step: int, index: int):
        if step >= self._step:
            assert self._gate.wait(60), "the gate was never opened"
        return self._data.microbatch(step, index)

    def __getattr__(self, name: str):
        return getattr(self._data, name)


async def test_a_peer_announced_mid_run_is_found_and_used(tiny_job, swarm, pools, kit):
    """Steps: 2 stages × 1 peer, one trainer, 12 steps in one `run`; after step 1 commits, a second
    peer of stage 0 starts (downloading the stage's state from its mate) and is announced; step 2
    waits until the trainer knows it (a step takes tens of milliseconds here, and the whole run
    could end before the refresher's first read). No peer is withheld for slowness (`slow_factor`
    1e9): a newcomer's first, cold replies can be many times its mate's, and withheld on them it
    got no work in the 10 fast steps left before its first probe (a loaded fresh-clone run).
    Expected: the trainer's background refresher finds it within a few `refresh_s`, the wiring
    sends it work (it computes microbatches), it commits every remaining step with its mate, and
    all 12 losses and the final parameters still equal the reference's."""
    spec, data = tiny_job(optim="sgd", lr=0.1, stages=2, steps=12)
    swarm_ = await swarm(spec, peers_per_stage=1)
    committed = asyncio.Event()
    gate = threading.Event()

    def on_event(event):
        if getattr(event, "step", -1) == 1:
            committed.set()

    wiring = dataclasses.replace(kit.TRAINER_CONFIG.wiring, slow_factor=1e9)
    config = dataclasses.replace(kit.TRAINER_CONFIG, wiring=wiring)
    trainer = Trainer(spec, kit.JOB_ID, swarm_.directory, pools(1)[0], GatedData(data, 2, gate),
                      config=config, on_event=on_event)
    task = asyncio.create_task(trainer.run(0, 12))
    try:
        await asyncio.wait_for(committed.wait(), 30)
        newcomer = await swarm_.add_peer(0, b"\x99" * 32)
        await until(lambda: trainer.wiring[0].peer_count == 2, 10 * kit.TRAINER_CONFIG.refresh_s,
                    "the trainer's refresher to find the newcomer")
    finally:
        gate.set()
    events = await asyncio.wait_for(task, 60)
    assert [e.step for e in events] == list(range(12))
    # Found: some step counted it usable.
    assert any(e.peers_per_stage == (2, 1) for e in events), [e.peers_per_stage for e in events]
    # Used: it computed microbatches. (Not "the trainer holds a measure of it at the end": a
    # directory read that briefly misses its announcement drops the measure with the peer.)
    assert newcomer.service.executor.samples_per_s > 0
    await kit.all_committed(swarm_, 12)  # the newcomer among them: it committed every step
    reference = ReferenceTrainer(spec, data)
    for e, r in zip(events, reference.train(12)):
        assert abs(e.global_loss - r.loss) <= 1e-5 * r.loss
    worst = kit.max_relative_difference(swarm_, reference)
    print(f"peer joined mid-run: max relative difference {worst:.2e}")
    assert worst <= 1e-5


def emulate_fp16_on_cpu(monkeypatch) -> None:
    """fp16 runs on CUDA only (stage peers and the reference refuse it elsewhere); here torch's
    CPU float16 autocast stands in, the device check waived. It is faithful: on an H200 the fp16
    reference gave the same per-step losses as this stand-in to 4 decimals, overflows included
    (tests/model/test_model_precision.py, docs/models.md)."""
    from swarmd.model.precision import Precision

    monkeypatch.setattr(Precision, "check", lambda self, device: None)
    monkeypatch.setattr(Precision, "autocast", lambda self, device: torch.autocast("cpu", dtype=torch.float16))


def in_fp16(spec, loss_scale: float):
    compute = dataclasses.replace(spec.compute, dtype="fp16", loss_scale=loss_scale, growth_interval=1000)
    return dataclasses.replace(spec, compute=compute)


@pytest.mark.parametrize("device", [
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device, none here (scripts/gpu-check.sh runs it)")]),
    "cpu-float16"])
@pytest.mark.parametrize("loss_scale", [2.0 ** 12, 2.0 ** 24], ids=["fitting", "overflowing"])
async def test_fp16_stages_scale_losses_and_follow_the_fp16_reference(tiny_job, swarm, pools, kit, monkeypatch,
                                                                       loss_scale, device):
    """Steps: 3 stages x 2 peers, 2 trainers, SGD with momentum, `[compute] dtype = "fp16"` (CPU
    float16 autocast standing in for CUDA, or on CUDA), starting at S = 2^12 (the gradients fit) or 2^24 (they
    overflow: each stage skips its steps and halves its own S until they fit), 6 steps.
    Expected: each step's loss within 1e-3 relative of the fp16 reference's (fp16 rounds a
    microbatch computed alone and one batched with another differently); every stage's peers hold
    the reference stage's S and the same parameters, bit for bit (I2: one reduced gradient, one
    overflow verdict on every mate); from 2^24 some stage skipped a step (grad_norm inf) as the
    reference's did."""
    if device == "cpu-float16":
        emulate_fp16_on_cpu(monkeypatch)
        device = "cpu"
    spec, data = tiny_job(optim="sgd", lr=0.1, steps=6)
    spec = in_fp16(spec, loss_scale)
    swarm_ = await swarm(spec, peers_per_stage=2, device=device)
    _, results, events = await run_trainers(spec, data, swarm_, pools, kit, steps=6)
    reference = ReferenceTrainer(spec, data, device=device)
    ref_steps = reference.train(6)
    losses = global_losses(events, spec.batch.global_samples)
    worst = max(abs(a - b.loss) / b.loss for a, b in zip(losses, ref_steps))
    ref_skips = [[math.isinf(r.grad_norm) for r in s.reports] for s in ref_steps]
    print(f"fp16 from S={loss_scale:g}: losses {[round(v, 4) for v in losses]}, reference "
          f"{[round(s.loss, 4) for s in ref_steps]} ({worst:.1e}); reference skips {ref_skips}; scales "
          f"{[p.service.opt.loss_scale for p in swarm_.peers]} vs {[s.scale for s in reference.scalers]}")
    assert len(losses) == 6 and worst <= 1e-3
    await mates_identical_at(swarm_, 6)
    for stage in range(3):
        first, second = swarm_.of_stage(stage)
        assert first.service.opt.loss_scale == second.service.opt.loss_scale == reference.scalers[stage].scale
    skipped = [any(math.isinf(r.grad_norm) for r in p.service.records) for p in swarm_.peers]
    assert any(skipped) == any(any(s) for s in ref_skips) == (loss_scale > 2.0 ** 20)
