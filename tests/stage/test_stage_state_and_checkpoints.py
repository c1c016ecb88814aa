"""Joining a stage: download-and-verify of a live mate's state (stage.state stream), and atomic
checkpoints restored when no mate is alive."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarmd.directory import StaticDirectory
from swarmd.model import build_stage
from swarmd.optim import StageOptimizer, export_state
from swarmd.stage.checkpoint import checkpoint_dir, checkpoints, newest_checkpoint, read_checkpoint, write_checkpoint
from swarmd.stage.state import StateError, _Assembly, snapshot_messages, take_snapshot

B, T, C = 2, 16, 32
STAGE = 1


def inputs(step, m):
    g = torch.Generator().manual_seed(7000 + 10 * step + m)
    return torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)


async def run_step(kit, client, peers, step, owners):
    async def one(m, peer):
        x, gy = inputs(step, m)
        await kit.call(client, peer, "stage.backward", STAGE, step, step * 4 + m, [x, gy])

    await asyncio.gather(*(one(m, peers[o]) for m, o in enumerate(owners)))
    async with asyncio.timeout(10):
        while not all(p.service.committed > step and p.service.records and p.service.records[-1].step >= step
                      for p in peers):
            await asyncio.sleep(0.01)


def assert_same_state(a, b):
    assert a.committed == b.committed
    for (name, p), q in zip(a.stage.state_dict().items(), b.stage.state_dict().values()):
        assert torch.equal(p, q), name
    sa, sb = export_state(a.opt), export_state(b.opt)
    assert sa.meta == sb.meta and sa.tensors.keys() == sb.tensors.keys()
    for key in sa.tensors:
        assert torch.equal(sa.tensors[key], sb.tensors[key]), key


async def test_a_joining_peer_downloads_state_and_then_steps_with_the_others(kit, client):
    """Steps: 2 peers (AdamW) take 2 steps; a third starts with them in its directory. Expected:
    before serving it holds exactly their parameters, AdamW moments and step (2); it then takes
    part in step 2 and all three stay bit-identical."""
    spec = kit.make_spec(stages=3, optim="adamw")
    directory = StaticDirectory()
    peers = [await kit.start_peer(spec, STAGE, i + 1, directory) for i in range(2)]
    try:
        await run_step(kit, client, peers, 0, [0, 1, 0, 1])
        await run_step(kit, client, peers, 1, [1, 1, 0, 0])
        joiner = await kit.start_peer(spec, STAGE, 9, directory)
        peers.append(joiner)
        assert joiner.service.state == "serving"
        assert_same_state(joiner.service, peers[0].service)
        await run_step(kit, client, peers, 2, [2, 2, 0, 1])
        assert all(p.service.records[-1].members == 3 for p in peers)
        assert_same_state(joiner.service, peers[0].service)
        assert_same_state(peers[1].service, peers[0].service)
    finally:
        for p in peers:
            await p.close()


def _digested(snapshot):
    snapshot.digest = bytes(16)  # a served state always travels with its digest
    return snapshot


def test_a_state_from_another_model_is_refused_before_allocation():
    spec_big = {"d_model": 64}
    ours = build_stage(_config(32), STAGE, 3, 5)
    theirs = build_stage(_config(spec_big["d_model"]), STAGE, 3, 5)
    messages = list(snapshot_messages(_digested(take_snapshot(theirs, StageOptimizer(theirs, _optim(), 10))), 4096))
    with pytest.raises(StateError, match="differ"):
        _Assembly(messages[0].meta, ours)


def test_state_pieces_must_fill_every_element_once():
    module = build_stage(_config(32), STAGE, 3, 5)
    messages = list(snapshot_messages(_digested(take_snapshot(module, StageOptimizer(module, _optim(), 10))), 4096))
    assert len(messages) > 3  # a 4 KiB chunk splits the larger tensors
    assembly = _Assembly(messages[0].meta, module)
    for message in messages[1:-2]:  # drop the last pieces
        assembly.put(message.meta["pieces"], list(message.tensors))
    with pytest.raises(StateError, match="elements arrived"):
        assembly.finish(messages[-1].meta["step"])
    repeat = _Assembly(messages[0].meta, module)
    repeat.put(messages[1].meta["pieces"], list(messages[1].tensors))
    with pytest.raises(StateError, match="does not fit"):
        repeat.put(messages[1].meta["pieces"], list(messages[1].tensors))


async def test_checkpoints_are_written_atomically_and_restored_exactly(kit, client, tmp_path):
    """Steps: one peer with every_steps=1 takes 3 steps (AdamW); a damaged newer checkpoint and a
    leftover temp file are planted; the peer stops; a new peer with the same state dir and no live
    mate starts. Expected: 2 checkpoints kept, no temp file of ours left; the new peer skips the
    damaged file and restores step 3 with exactly the old peer's parameters and optimizer state."""
    spec = kit.make_spec(stages=3, optim="adamw", every=1)
    peer = await kit.start_peer(spec, STAGE, 1, StaticDirectory(), state_dir=tmp_path)
    directory = checkpoint_dir(tmp_path, kit.JOB, STAGE)
    try:
        for step in range(3):
            await run_step(kit, client, [peer], step, [0, 0, 0, 0])
        async with asyncio.timeout(10):
            # Step 3's file appears at its rename; step 1's is pruned right after.
            while [p.name for p in checkpoints(directory)] != ["step-0000000003.pt", "step-0000000002.pt"]:
                await asyncio.sleep(0.02)
        assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")]
        (directory / "step-0000000009.pt").write_bytes(b"PK\x03\x04 torn write")
        (directory / ".step-0000000010.pt.1.tmp").write_bytes(b"half")
    finally:
        await peer.close()
    restored = await kit.start_peer(spec, STAGE, 2, StaticDirectory(), state_dir=tmp_path)
    try:
        assert restored.service.committed == 3
        assert_same_state(restored.service, peer.service)
    finally:
        await restored.close()


def test_checkpoint_round_trip_is_exact(tmp_path):
    module = build_stage(_config(32), STAGE, 3, 5)
    opt = StageOptimizer(module, _optim(), 10)
    module(torch.randn(B, T, C)).sum().backward()
    opt.step(B)
    snapshot = take_snapshot(module, opt)
    path = write_checkpoint(tmp_path, snapshot, STAGE, keep=2)
    back = read_checkpoint(path, STAGE)
    assert back.step == 1 and back.optimizer.meta == snapshot.optimizer.meta
    for name, tensor in snapshot.params.items():
        assert torch.equal(back.params[name], tensor)
    for name, tensor in snapshot.optimizer.tensors.items():
        assert torch.equal(back.optimizer.tensors[name], tensor)
    with pytest.raises(StateError, match="stage"):
        read_checkpoint(path, STAGE + 1)
    assert newest_checkpoint(tmp_path / "nothing-here", STAGE) is None


def _config(d_model):
    from swarmd.model.transformer import parse_transformer_config

    return parse_transformer_config({"d_model": d_model, "n_heads": 4}, T)


def _optim():
    from swarmd.job import OptimSpec

    return OptimSpec(name="adamw", lr=0.01)
