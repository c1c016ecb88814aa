"""The round protocol's version (sync.ROUND_PROTOCOL), over real loopback sockets: peers whose
round RPCs would not interoperate (an older peer without owners, plans or scaled fp16 pieces)
refuse each other's rounds with their own error code, and a leader leaves such a mate out."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
import torch
from waiting import until

from swarmd.directory import StaticDirectory
from swarmd.model import build_stage
from swarmd.optim import StageOptimizer
from swarmd.stage.sync import ROUND_PROTOCOL
from transport.errors import RemoteError
from transport.rpc import Message

B, T, C = 2, 16, 32
STAGE = 1
MATE = b"\xff" * 32  # a stage-mate played by the test; sorts after every test peer


def inputs(step, m):
    g = torch.Generator().manual_seed(1000 * step + m)
    return torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)


async def send(kit, client, peer, m):
    return await kit.call(client, peer, "stage.backward", STAGE, 0, m, list(inputs(0, m)))


def reference(spec):
    """Step 0 in one module on every microbatch: what the stage must equal."""
    module = build_stage(spec.model.config, STAGE, spec.pipeline.stages, spec.seed)
    for m in range(spec.batch.microbatches_per_step):
        x, gy = inputs(0, m)
        module(x).backward(gy)
    StageOptimizer(module, spec.optim, spec.steps).step(spec.batch.global_samples)
    return module


def max_rel_diff(module, ref_module):
    return max(((p - q).abs().max() / q.abs().max().clamp_min(1e-12)).item()
               for p, q in zip(module.parameters(), ref_module.parameters()))


@pytest.mark.parametrize("version", [None, 1, ROUND_PROTOCOL + 1, "2"])
async def test_a_round_rpc_of_another_protocol_is_refused_with_its_own_code(kit, client, version):
    """Steps: one peer; the test, as a mate of another round protocol (none given: version 1, an
    older peer), sends it an invitation and then a first all-reduce part of a round. Expected: both
    are answered `protocol_mismatch` naming both versions, and no round box is opened for the part
    (before the version, the part opened a box and the invitation failed on whatever field differed)."""
    spec = kit.make_spec(stages=3)
    peer = await kit.start_peer(spec, STAGE, 1, StaticDirectory())
    members = sorted([peer.service.peer_id, MATE])
    versioned = {} if version is None else {"protocol": version}
    try:
        invitation = {**kit.meta(STAGE), **versioned, "round": os.urandom(16), "step": 0,
                      "digest": peer.service.digest, "members": members, "addrs": [peer.addr, "127.0.0.1:1"]}
        part = {**kit.meta(STAGE), **versioned, "round": os.urandom(16), "step": 0, "members": members,
                "src": members.index(MATE), "offset": 0, "ids": [[0, 1]], "samples": B}
        with pytest.raises(RemoteError) as info:
            await client.call(peer.addr, "stage.sync.round", Message(invitation, codec="none"), timeout=5)
        assert info.value.code == "protocol_mismatch"
        assert repr(version if version is not None else 1) in info.value.message
        assert str(ROUND_PROTOCOL) in info.value.message
        assert await kit.code_of(client, peer.addr, "stage.sync.reduce", part, [torch.zeros(1)]) == "protocol_mismatch"
        assert peer.service.sync.mailbox.open_rounds == 0
    finally:
        await peer.close()


async def test_a_leader_leaves_a_mate_of_another_protocol_out(kit, client, caplog):
    """Steps: two peers of a stage; the second shows an older round protocol with its progress (its
    reply lacks the version). Microbatches 0, 1 go to the first (the leader: smaller id), 2, 3 to
    the second. Expected: the leader never invites it: its stage.info reports 2 and 3 uncovered,
    and names its own round protocol; the test re-sends them to the leader, which commits the step
    alone (one member), equal to the fp32 reference within 1e-5 (FAST's allreduce_codec is
    "none"); the other committed in no round (it may download the leader's state: this one reads
    it). The mismatch is logged once, not once per poll."""
    caplog.set_level(logging.WARNING, logger="swarmd.stage.sync")
    spec = kit.make_spec(stages=3, optim="sgd")
    directory = StaticDirectory()
    leader = await kit.start_peer(spec, STAGE, 1, directory)
    older = await kit.start_peer(spec, STAGE, 2, directory)
    reply = older.service.sync.progress_reply

    def unversioned() -> Message:
        message = reply()
        return Message({k: v for k, v in message.meta.items() if k != "protocol"}, codec="none")

    older.service.sync.progress_reply = unversioned
    try:
        await asyncio.gather(*(send(kit, client, p, m) for m, p in enumerate([leader, leader, older, older])))

        async def uncovered():
            info = await client.call(leader.addr, "stage.info", Message(kit.meta(STAGE)), timeout=5)
            return info.meta if info.meta["uncovered"] == [2, 3] else None

        info = await until(uncovered, 15, "the leader to report the older mate's microbatches uncovered")
        assert info["round_protocol"] == ROUND_PROTOCOL and info["allreduce_codec"] == "none"
        await asyncio.gather(*(send(kit, client, leader, m) for m in (2, 3)))
        await until(lambda: leader.service.records, 15, "the leader's commit of step 0")
        assert leader.service.records[-1].members == 1
        assert not older.service.records and older.service.sync.last_failure is None  # in no round
        assert max_rel_diff(leader.service.stage, reference(spec)) <= 1e-5
        warned = [r for r in caplog.records if "speaks round protocol 1" in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    finally:
        await leader.close()
        await older.close()
