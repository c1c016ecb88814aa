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
from swarmd.stage.limits import Slots
from swarmd.stage.sync import ROUND_PROTOCOL
from transport.errors import RemoteError, RpcError
from transport.identity import Identity
from transport.rpc import Message, Pool, RpcConfig

B, T, C = 2, 16, 32
STAGE = 1


def part_meta(kit, round_id, members, src=1, offset=0, step=0):
    return {**kit.meta(STAGE), "protocol": ROUND_PROTOCOL, "round": round_id, "step": step, "members": members,
            "src": src, "offset": offset, "ids": [[0, 1]], "samples": B}


@pytest.mark.parametrize("tensor, exponent", [
    (torch.zeros(1, dtype=torch.float16), None),  # fp16 without its scale
    (torch.zeros(1, dtype=torch.float16), 10**6),  # 2.0**-10**6 is 0, 2.0**10**6 raises
    (torch.zeros(1), 3),  # a scale on fp32
])
async def test_a_malformed_all_reduce_piece_is_refused_before_a_box_opens(kit, client, tensor, exponent):
    """Steps: a mate sends the first part of a round with a piece that is not plain fp32 nor fp16
    with an exponent in range. Expected: `bad_input`, and no round box (a gradient-sized buffer)
    is opened for it."""
    spec = kit.make_spec(stages=3)
    peer = await kit.start_peer(spec, STAGE, 1, StaticDirectory(), StageLimits(sync_interval_s=60.0))
    members = sorted([peer.service.peer_id, b"\xff" * 32])
    meta = part_meta(kit, os.urandom(16), members) | ({} if exponent is None else {"exp": exponent})
    try:
        with pytest.raises(RemoteError) as info:
            await client.call(peer.addr, "stage.sync.reduce", Message(meta, [tensor], codec="none"), timeout=5)
        assert info.value.code == "bad_input" and peer.service.sync.mailbox.open_rounds == 0
    finally:
        await peer.close()


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


def test_slots_are_bounded_in_all_and_per_caller_and_come_back():
    slots = Slots("things held", 3, "max_things", 2, "max_things_per_peer")
    with slots.hold(b"a"), slots.hold(b"a"):
        with pytest.raises(RpcError) as refused:
            with slots.hold(b"a"):
                pass
        assert refused.value.code == "busy" and "max_things_per_peer" in refused.value.message
        with slots.hold(None):
            assert slots.total == 3 and slots.held_by(b"a") == 2
            with pytest.raises(RpcError) as refused:
                with slots.hold(b"b"):
                    pass
            assert refused.value.code == "busy" and "(max_things)" in refused.value.message
    assert slots.total == 0 and slots.held_by(b"a") == 0 and not slots._held  # nobody left in the table


def identified_pool() -> Pool:
    """A caller with an identity of its own (the per-caller slots count by its peer id)."""
    return Pool(RpcConfig(identity=Identity.generate()))


async def test_one_caller_parks_at_most_max_waiting_per_peer(kit):
    """A caller racing ahead takes at most max_waiting_per_peer of the next-step slots; another
    caller's next-step call still parks."""
    spec = kit.make_spec(stages=3)
    peer = await kit.start_peer(spec, STAGE, 1, StaticDirectory(),
                                StageLimits(max_waiting=4, max_waiting_per_peer=2, sync_interval_s=60.0))
    greedy, other = identified_pool(), identified_pool()
    x = torch.randn(B, T, C)
    parked = [asyncio.create_task(kit.call(greedy, peer, "stage.forward", STAGE, 1, 4 + m, [x], timeout=5.0))
              for m in range(2)]
    try:
        await until(lambda: peer.service.parked.total == 2, 5, "the greedy caller's two calls to park")
        with pytest.raises(RemoteError) as info:
            await kit.call(greedy, peer, "stage.forward", STAGE, 1, 6, [x], timeout=5.0)
        assert info.value.code == "busy" and "max_waiting_per_peer" in info.value.message
        parked.append(asyncio.create_task(kit.call(other, peer, "stage.forward", STAGE, 1, 7, [x], timeout=5.0)))
        await until(lambda: peer.service.parked.total == 3, 5, "the other caller's call to park")
    finally:
        for task in parked:
            task.cancel()
        await asyncio.gather(*parked, return_exceptions=True)
        await greedy.close()
        await other.close()
        await peer.close()


async def test_a_call_past_max_steps_ahead_is_answered_not_ready_at_once(kit, client):
    """A lone peer at step 0 with no sign that the swarm is further: a call for step 2 does not
    park (it would hold a slot up to max_wait_s, 30 s here) but is answered not_ready at once."""
    spec = kit.make_spec(stages=3)
    peer = await kit.start_peer(spec, STAGE, 1, StaticDirectory(), StageLimits(sync_interval_s=60.0))
    try:
        with pytest.raises(RemoteError) as info:
            await kit.call(client, peer, "stage.forward", STAGE, 2, 8, [torch.randn(B, T, C)], timeout=20.0)
        assert info.value.code == "not_ready" and "max_steps_ahead" in info.value.message
        assert peer.service.parked.total == 0
    finally:
        await peer.close()


async def test_long_polls_have_slots_of_their_own(kit):
    """`stage.info` long-polls are bounded per caller (max_watchers_per_peer: past it, one is
    answered at once, as a plain stage.info) and take no compute slot: with max_waiting 1, a
    next-step call still parks beside a long-poll."""
    spec = kit.make_spec(stages=3)
    peer = await kit.start_peer(spec, STAGE, 1, StaticDirectory(),
                                StageLimits(max_waiting=1, max_watchers_per_peer=1, sync_interval_s=60.0))
    watcher, trainer = identified_pool(), identified_pool()
    watch = Message({**kit.meta(STAGE), "until_step": 0, "wait_s": 5.0}, codec="none")
    held = [asyncio.create_task(watcher.call(peer.addr, "stage.info", watch, timeout=10))]
    try:
        await until(lambda: peer.service.watchers.total == 1, 5, "the first long-poll to wait")
        reply = await watcher.call(peer.addr, "stage.info", watch, timeout=10)
        assert reply.meta["step"] == 0 and not held[0].done() and peer.service.watchers.total == 1
        held.append(asyncio.create_task(kit.call(trainer, peer, "stage.forward", STAGE, 1, 4, [torch.randn(B, T, C)],
                                                 timeout=5.0)))
        await until(lambda: peer.service.parked.total == 1, 5, "the next-step call to park beside the long-poll")
    finally:
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await watcher.close()
        await trainer.close()
        await peer.close()


@pytest.mark.parametrize("field, value", [("queue_size", 0), ("max_batch", -1), ("round_timeout_s", 0.0),
                                          ("allreduce_codec", "gzip"), ("torch_threads", 0), ("workers", True),
                                          ("owner_min_rate_fraction", 1.5), ("owner_min_rate_fraction", 0.0)])
def test_limits_refuse_unusable_values(field, value):
    with pytest.raises(ValueError, match=field):
        StageLimits(**{field: value})
