"""A stage whose every peer died comes back from an older checkpoint than the swarm's step: it takes
up the step the rest of the swarm committed when the job's submitter signed it in its progress
record and another stage's live peer shows it, and only then (swarmd/stage/resume.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from swarmd.directory import StagePeer, StaticDirectory
from swarmd.model import build_stage
from swarmd.optim import StageOptimizer
from swarmd.stage.checkpoint import checkpoint_dir, write_checkpoint
from swarmd.stage.state import take_snapshot
from transport.errors import RemoteError
from transport.rpc import Message

B, T, C = 2, 16, 32
STAGE = 1


def inputs(step, m):
    g = torch.Generator().manual_seed(9000 + 10 * step + m)
    return torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)


class SubmitterRecord:
    """The steps committed that the job's submitter signed in its progress record, as a stage's
    anchor reads them (None: no record); a test moves it as the submitter's trainers would."""

    def __init__(self, step: int | None) -> None:
        self.step = step

    async def __call__(self) -> int | None:
        return self.step


def plant_checkpoint(spec, tmp_path, kit, stage, step):
    """A checkpoint of `stage` at `step` (seeded parameters), as a peer that got that far writes."""
    module = build_stage(spec.model.config, stage, spec.pipeline.stages, spec.seed, torch.device("cpu"))
    opt = StageOptimizer(module, spec.optim, spec.steps)
    opt.step_count = step
    write_checkpoint(checkpoint_dir(tmp_path, kit.JOB, stage), take_snapshot(module, opt), stage, keep=2)
    return module


async def test_a_restored_stage_takes_up_the_step_another_stage_committed(kit, client, tmp_path):
    """Steps: stage 0's peer restores step 4, stage 1's peer a checkpoint of step 2 (what a wiped
    stage has); a backward for step 4 reaches stage 1. Expected: it is accepted (stage 1 jumps to
    step 4, keeping its step-2 parameters, and says so in stage.info `skipped`), the step commits
    with all its microbatches, and a request for step 7, which no stage has reached, is refused
    (not_ready) without moving the stage."""
    spec = kit.make_spec(stages=3, every=2)
    witness_dir, wiped_dir = tmp_path / "witness", tmp_path / "wiped"
    plant_checkpoint(spec, witness_dir, kit, 0, 4)
    kept = plant_checkpoint(spec, wiped_dir, kit, STAGE, 2)
    directory = StaticDirectory()
    witness = await kit.start_peer(spec, 0, 1, directory, state_dir=witness_dir)
    restored = await kit.start_peer(spec, STAGE, 2, directory, state_dir=wiped_dir, anchor=SubmitterRecord(4))
    try:
        assert witness.service.committed == 4 and restored.service.committed == 2
        for name, p in restored.service.stage.state_dict().items():
            assert torch.equal(p, kept.state_dict()[name]), name
        await asyncio.gather(*(kit.call(client, restored, "stage.backward", STAGE, 4, 16 + m, list(inputs(4, m))
                                        ) for m in range(4)))
        async with asyncio.timeout(10):
            while restored.service.committed < 5:
                await asyncio.sleep(0.02)
        record = restored.service.records[-1]
        assert (record.step, record.samples) == (4, spec.batch.global_samples)
        info = await client.call(restored.addr, "stage.info", Message(kit.meta(STAGE), codec="none"), timeout=5)
        assert info.meta["skipped"] == [[2, 4]]
        with pytest.raises(RemoteError) as refused:
            await kit.call(client, restored, "stage.backward", STAGE, 7, 28, list(inputs(7, 0)), timeout=3.0)
        assert refused.value.code == "not_ready"
        assert restored.service.committed == 5 and list(restored.service.skipped) == [(2, 4)]
    finally:
        await restored.close()
        await witness.close()


async def test_a_restored_stage_takes_up_no_step_its_submitter_has_not_signed(kit, client, tmp_path):
    """Steps: stage 0's peer at step 4, stage 1's restored at 2 (as above); the submitter's record
    is first absent, then signs 3 steps (published before the last commit); a backward for step 4
    reaches stage 1 each time; then the record signs 4 and the call is sent again.
    Expected: while the record is absent or below 4 the call is refused not_ready at once and
    nothing is skipped, though stage 0 answers step 4 (one answer is anyone's word); once it signs
    4 the call is accepted and [2, 4] is skipped."""
    spec = kit.make_spec(stages=3, every=2)
    witness_dir, wiped_dir = tmp_path / "witness", tmp_path / "wiped"
    plant_checkpoint(spec, witness_dir, kit, 0, 4)
    plant_checkpoint(spec, wiped_dir, kit, STAGE, 2)
    directory, record = StaticDirectory(), SubmitterRecord(None)
    witness = await kit.start_peer(spec, 0, 1, directory, state_dir=witness_dir)
    restored = await kit.start_peer(spec, STAGE, 2, directory, state_dir=wiped_dir, anchor=record)
    try:
        for signed in (None, 3):
            record.step = signed
            with pytest.raises(RemoteError) as refused:
                await kit.call(client, restored, "stage.backward", STAGE, 4, 16, list(inputs(4, 0)), timeout=3.0)
            assert refused.value.code == "not_ready", signed
            assert restored.service.committed == 2 and not restored.service.skipped, signed
        record.step = 4
        reply = await kit.call(client, restored, "stage.backward", STAGE, 4, 16, list(inputs(4, 0)), timeout=10.0)
        assert reply.meta["added"] is True
        assert restored.service.committed == 4 and list(restored.service.skipped) == [(2, 4)]
    finally:
        await restored.close()
        await witness.close()


async def test_a_stage_with_a_mate_ahead_downloads_rather_than_skips(kit, client, tmp_path):
    """Steps: stage 1 has a live peer at step 4 and a new peer restores step 2 from its own
    checkpoint while the mate is unannounced, then the mate is announced; a backward for step 4
    reaches the new peer. Expected: it downloads the mate's state (same parameters as the mate),
    and skips nothing."""
    spec = kit.make_spec(stages=3, every=2)
    ahead_dir, behind_dir = tmp_path / "ahead", tmp_path / "behind"
    plant_checkpoint(spec, ahead_dir, kit, STAGE, 4)
    plant_checkpoint(spec, behind_dir, kit, STAGE, 2)
    directory = StaticDirectory()
    ahead = await kit.start_peer(spec, STAGE, 1, directory, state_dir=ahead_dir, announce=False)
    behind = await kit.start_peer(spec, STAGE, 2, directory, state_dir=behind_dir)
    directory.set(kit.JOB, STAGE, [*await directory.peers(kit.JOB, STAGE), StagePeer(bytes([1]) * 32, ahead.addr, STAGE)])
    try:
        assert behind.service.committed == 2 and ahead.service.committed == 4
        await asyncio.gather(*(kit.call(client, behind, "stage.backward", STAGE, 4, 16 + m, list(inputs(4, m)))
                               for m in range(4)))
        async with asyncio.timeout(10):
            while behind.service.committed < 5 or ahead.service.committed < 5:
                await asyncio.sleep(0.02)
        assert not behind.service.skipped
        for (name, p), q in zip(behind.service.stage.state_dict().items(), ahead.service.stage.state_dict().values()):
            assert torch.equal(p, q), name
    finally:
        await behind.close()
        await ahead.close()


async def test_a_survivor_holding_gradients_of_a_lost_step_takes_up_the_swarms_step(kit, client, tmp_path):
    """Steps: as above (stage 0 at step 4, stage 1 restored at 2), but stage 1 first receives one
    microbatch of its own step 2 (as a survivor whose committing mates died holds); then a backward
    for step 4 arrives. Expected (I3): it is taken up after resume_after_s like any lost step (no
    live mate of the stage will ever complete step 2), the step-2 gradient is dropped, and the jump
    is recorded."""
    spec = kit.make_spec(stages=3, every=2)
    witness_dir, wiped_dir = tmp_path / "witness", tmp_path / "wiped"
    plant_checkpoint(spec, witness_dir, kit, 0, 4)
    plant_checkpoint(spec, wiped_dir, kit, STAGE, 2)
    directory = StaticDirectory()
    witness = await kit.start_peer(spec, 0, 1, directory, state_dir=witness_dir)
    restored = await kit.start_peer(spec, STAGE, 2, directory, state_dir=wiped_dir, anchor=SubmitterRecord(4))
    try:
        await kit.call(client, restored, "stage.backward", STAGE, 2, 8, list(inputs(2, 0)))
        reply = await kit.call(client, restored, "stage.backward", STAGE, 4, 16, list(inputs(4, 0)), timeout=5.0)
        assert reply.meta["added"] is True
        assert restored.service.committed == 4 and list(restored.service.skipped) == [(2, 4)]
        assert restored.service.accumulator.progress(2).ids == frozenset()
    finally:
        await restored.close()
        await witness.close()


async def test_a_lagging_peer_whose_mate_is_out_of_sight_for_a_moment_downloads_rather_than_skips(
        kit, client, tmp_path):
    """Steps: stage 0 at step 4; stage 1 has a peer at step 4 and a peer one step behind (3) whose
    directory read misses its mate (as a DHT read can); a backward for step 4 reaches the lagging
    peer and waits there; then its directory shows the mate again.
    Expected: the call is accepted for step 4 once the lagging peer has downloaded its mate's state
    (same parameters), and it skipped nothing: one look finding no mate ahead is not evidence that
    the stage lost steps (resume_after_s is 30 s here, far beyond the test)."""
    spec = kit.make_spec(stages=3, every=2)
    plant_checkpoint(spec, tmp_path / "witness", kit, 0, 4)
    plant_checkpoint(spec, tmp_path / "ahead", kit, STAGE, 4)
    plant_checkpoint(spec, tmp_path / "behind", kit, STAGE, 3)
    limits = dataclasses.replace(kit.FAST, resume_after_s=30.0, max_wait_s=60.0)
    directory, partial = StaticDirectory(), StaticDirectory()
    witness = await kit.start_peer(spec, 0, 1, directory, limits, state_dir=tmp_path / "witness")
    ahead = await kit.start_peer(spec, STAGE, 2, directory, limits, state_dir=tmp_path / "ahead")
    partial.set(kit.JOB, 0, [StagePeer(witness.service.peer_id, witness.addr, 0)])
    behind = await kit.start_peer(spec, STAGE, 3, partial, limits, state_dir=tmp_path / "behind")
    try:
        assert (behind.service.committed, ahead.service.committed) == (3, 4)
        call = asyncio.create_task(kit.call(client, behind, "stage.backward", STAGE, 4, 16, list(inputs(4, 0)),
                                            timeout=60.0))
        async with asyncio.timeout(30):
            while behind.service.parked.total == 0:  # it looked, found no mate ahead, and parked the call
                assert not call.done(), call.result()
                await asyncio.sleep(0.01)
            partial.set(kit.JOB, STAGE, [*await partial.peers(kit.JOB, STAGE),
                                         StagePeer(ahead.service.peer_id, ahead.addr, STAGE)])
            reply = await call
        assert reply.meta["duplicate"] is False
        assert not behind.service.skipped and behind.service.committed == 4
        for (name, p), q in zip(behind.service.stage.state_dict().items(), ahead.service.stage.state_dict().values()):
            assert torch.equal(p, q), name
    finally:
        for peer in (behind, ahead, witness):
            await peer.close()
