"""Each bound a stage peer keeps against trainers and mates that push too much or lie, named for
the attack it stops; all over real loopback sockets."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from waiting import until

from swarmd.directory import StaticDirectory
from swarmd.stage import StageLimits
from transport.errors import RemoteError
from transport.rpc import Message

B, T, C = 2, 16, 32
STAGE = 1


def part_meta(kit, round_id, members, src=1, offset=0, step=0):
    return {**kit.meta(STAGE), "round": round_id, "step": step, "members": members, "src": src,
            "offset": offset, "ids": [[0, 1]], "samples": B}


async def test_unknown_rounds_past_max_open_rounds_are_refused(kit, client):
    """A mate inventing round ids cannot make us allocate a round buffer per id."""
    spec = kit.make_spec(stages=3)
    # progress_timeout_s long: boxes of rounds never joined here are dropped after it (to make room).
    peer = await kit.start_peer(spec, STAGE, 1, StaticDirectory(),
                                StageLimits(max_open_rounds=2, sync_interval_s=60.0, progress_timeout_s=60.0))
    members = sorted([peer.service.peer_id, b"\xff" * 32])
    try:
        codes = []
        for _ in range(3):
            message = Message(part_meta(kit, os.urandom(16), members), [torch.zeros(1)], codec="none")
            try:
                await client.call(peer.addr, "stage.sync.reduce", message, timeout=5)
                codes.append("ok")
            except RemoteError as exc:
                codes.append(exc.code)
        assert codes == ["ok", "ok", "busy"]
    finally:
        await peer.close()


@pytest.mark.parametrize("case", ["overrun", "gap", "dtype", "not_a_member", "unsorted", "bad_src"])
async def test_an_all_reduce_part_that_does_not_fit_is_refused(kit, client, case):
    """Parts are placed into buffers sized from our own parameter count, in order: a part past its
    shard, out of order, of another dtype, or for a round we are not in is refused."""
    spec = kit.make_spec(stages=3)
    peer = await kit.start_peer(spec, STAGE, 1, StaticDirectory(), StageLimits(sync_interval_s=60.0))
    me, other = peer.service.peer_id, b"\xff" * 32
    members = sorted([me, other])
    shard = peer.service.numel // 2
    meta = part_meta(kit, os.urandom(16), members)
    tensor = torch.zeros(16)
    if case == "overrun":
        tensor = torch.zeros(shard + 1)
    elif case == "gap":
        meta["offset"] = 8
    elif case == "dtype":
        tensor = torch.zeros(16, dtype=torch.float64)
    elif case == "not_a_member":
        meta["members"] = sorted([b"\xee" * 32, other])
    elif case == "unsorted":
        meta["members"] = [other, me]
    elif case == "bad_src":
        meta["src"] = 5
    try:
        with pytest.raises(RemoteError) as info:
            await client.call(peer.addr, "stage.sync.reduce", Message(meta, [tensor], codec="none"), timeout=5)
        assert info.value.code == "bad_input", info.value
    finally:
        await peer.close()


async def test_calls_parked_for_the_next_step_past_max_waiting_are_busy(kit, client):
    """Trainers racing ahead cannot park unbounded tensors waiting for our commit."""
    spec = kit.make_spec(stages=3)
    peer = await kit.start_peer(spec, STAGE, 1, StaticDirectory(), StageLimits(max_waiting=1, sync_interval_s=60.0))
    x = torch.randn(B, T, C)
    try:
        parked = asyncio.create_task(kit.call(client, peer, "stage.forward", STAGE, 1, 4, [x], timeout=1.0))
        await until(lambda: peer.service.parked.total == 1, 5, "the first call to wait for a commit")
        with pytest.raises(RemoteError) as info:
            await kit.call(client, peer, "stage.forward", STAGE, 1, 5, [x], timeout=1.0)
        assert info.value.code == "busy" and "max_waiting" in info.value.message
        with pytest.raises(RemoteError) as info:
            await parked
        assert info.value.code == "not_ready"
    finally:
        await peer.close()


@pytest.mark.parametrize("field, value", [("queue_size", 0), ("max_batch", -1), ("round_timeout_s", 0.0),
                                          ("allreduce_codec", "gzip"), ("torch_threads", 0), ("workers", True)])
def test_limits_refuse_unusable_values(field, value):
    with pytest.raises(ValueError, match=field):
        StageLimits(**{field: value})
