"""`stage.info` as a long-poll (`until_step`, `wait_s`): what a trainer's commit watch relies on,
over real loopback sockets. A lone peer of a middle stage commits a step once it holds all four
microbatches' backwards (its sync loop ticks every 20 ms), so the test decides when it commits."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
import torch
from waiting import until

from swarmd.directory import StaticDirectory
from transport.errors import RemoteError
from transport.identity import Identity
from transport.rpc import Message, Pool, RpcConfig

B, T, C = 2, 16, 32
STAGE = 1
MICROBATCHES = 4  # make_spec's default: 8 global samples, 2 per microbatch


def watch(kit, until_step, wait_s):
    return Message({**kit.meta(STAGE), "until_step": until_step, "wait_s": wait_s}, codec="none")


async def commit_step(kit, client, peer, step):
    for m in range(MICROBATCHES):
        await kit.call(client, peer, "stage.backward", STAGE, step, step * MICROBATCHES + m,
                       [torch.randn(B, T, C), torch.randn(B, T, C)])


@pytest.fixture
async def lone(kit):
    """Starts one peer of stage 1 (of 3) with the given limits (FAST's by default); closed at the end."""
    started = []

    async def start(**limits):
        started.append(await kit.start_peer(kit.make_spec(stages=3), STAGE, 1, StaticDirectory(),
                                            dataclasses.replace(kit.FAST, **limits)))
        return started[-1]

    try:
        yield start
    finally:
        for peer in started:
            await peer.close()


async def test_a_long_poll_is_answered_when_the_step_commits(kit, client, lone):
    """Steps: long-poll for a commit past step 0 with wait_s and max_wait_s 60; once it waits in a
    watcher slot, send step 0's four backwards. Expected: answered with step 1 and step 0's record
    as the commit lands (well inside the 60 s it may wait); the slot is free again."""
    peer = await lone(max_wait_s=60.0)
    poll = asyncio.create_task(client.call(peer.addr, "stage.info", watch(kit, 0, 60.0), timeout=70))
    await until(lambda: peer.service.watchers.total == 1, 5, "the long-poll to wait")
    assert not poll.done()
    await commit_step(kit, client, peer, 0)
    reply = await asyncio.wait_for(poll, 20)
    assert reply.meta["step"] == 1 and reply.meta["last_step"]["step"] == 0
    assert peer.service.watchers.total == 0


async def test_a_long_poll_past_which_the_peer_is_already_is_answered_at_once(kit, client, lone):
    """A peer at step 1 asked to wait past step 0 has nothing to wait for: it answers at once,
    taking no watcher slot (the 60 s it may wait would show as the test's timeout)."""
    peer = await lone(max_wait_s=60.0)
    await commit_step(kit, client, peer, 0)
    await until(lambda: peer.service.committed == 1, 10, "step 0 to commit")
    reply = await asyncio.wait_for(client.call(peer.addr, "stage.info", watch(kit, 0, 60.0), timeout=70), 20)
    assert reply.meta["step"] == 1 and peer.service.watchers.total == 0


async def test_a_long_poll_without_a_commit_is_answered_after_wait_s(kit, client, lone):
    """Nothing commits: the answer comes after wait_s (0.3 s), not before, with the peer's step."""
    peer = await lone()
    loop = asyncio.get_running_loop()
    asked = loop.time()
    reply = await client.call(peer.addr, "stage.info", watch(kit, 0, 0.3), timeout=30)
    assert loop.time() - asked >= 0.3
    assert reply.meta["step"] == 0 and reply.meta["state"] == "serving"


async def test_a_long_poll_waits_at_most_max_wait_s_and_answers_before_the_deadline(kit, client, lone):
    """wait_s 3600 on a peer whose max_wait_s is 0.3: answered after 0.3 s (the call's timeout of
    30 s would say if it waited longer). And wait_s 3600 in a call of timeout 1 s on a peer whose
    max_wait_s is 60: answered before the deadline, not DeadlineExceeded."""
    short = await lone(max_wait_s=0.3)
    reply = await client.call(short.addr, "stage.info", watch(kit, 0, 3600.0), timeout=30)
    assert reply.meta["step"] == 0
    long = await lone(max_wait_s=60.0)
    reply = await client.call(long.addr, "stage.info", watch(kit, 0, 3600.0), timeout=1.0)
    assert reply.meta["step"] == 0


async def test_with_every_watcher_slot_taken_a_long_poll_is_answered_at_once(kit, client, lone):
    """max_watchers_per_peer 1: a caller's second long-poll, while its first waits, is answered at
    once (a plain stage.info, not `busy`); max_watchers 2: a third caller's, while two wait, too.
    The waiting ones keep waiting and are answered at the commit."""
    peer = await lone(max_wait_s=60.0, max_watchers=2, max_watchers_per_peer=1)
    callers = [Pool(RpcConfig(identity=Identity.generate())) for _ in range(3)]
    waiting = [asyncio.create_task(pool.call(peer.addr, "stage.info", watch(kit, 0, 60.0), timeout=70))
               for pool in callers[:2]]
    try:
        await until(lambda: peer.service.watchers.total == 2, 5, "two long-polls to wait")
        for pool in callers[:1] + callers[2:]:
            reply = await asyncio.wait_for(pool.call(peer.addr, "stage.info", watch(kit, 0, 60.0), timeout=70), 20)
            assert reply.meta["step"] == 0
        assert not any(task.done() for task in waiting) and peer.service.watchers.total == 2
        await commit_step(kit, client, peer, 0)
        assert [(await asyncio.wait_for(task, 20)).meta["step"] for task in waiting] == [1, 1]
    finally:
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        for pool in callers:
            await pool.close()


@pytest.mark.parametrize("fields", [
    {"until_step": "0", "wait_s": 1.0}, {"until_step": True, "wait_s": 1.0}, {"until_step": 0.0, "wait_s": 1.0},
    {"until_step": 0, "wait_s": -1.0}, {"until_step": 0, "wait_s": "1"}, {"until_step": 0, "wait_s": True},
    {"until_step": 0, "wait_s": math.nan}, {"until_step": 0}, {"wait_s": 1.0},
])
async def test_malformed_long_poll_fields_are_bad_input(kit, client, lone, fields):
    peer = await lone()
    with pytest.raises(RemoteError) as info:
        await client.call(peer.addr, "stage.info", Message({**kit.meta(STAGE), **fields}, codec="none"), timeout=5)
    assert info.value.code == "bad_input" and "until_step" in info.value.message
    assert peer.service.watchers.total == 0


async def test_wait_commit_is_gone(kit, client, lone):
    """The long-poll replaced `stage.wait_commit`: nothing serves it any more."""
    peer = await lone()
    with pytest.raises(RemoteError) as info:
        await client.call(peer.addr, "stage.wait_commit", Message({**kit.meta(STAGE), "step": 0, "timeout_s": 1.0},
                                                                   codec="none"), timeout=5)
    assert info.value.code == "unknown_method"
