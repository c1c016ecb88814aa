"""A stranger that holds a stage's state downloads open, over real loopback sockets.

`stage.state` is answered to anyone (a joiner is nobody's mate yet), at most `max_state_streams`
(2) at once, each holding a full copy of the stage's state. A stranger opens two, reads their
headers and then reads nothing; its hello announces a 4 KiB in-flight window, which the server
honours, so the streams block after a few KiB. On main they stayed open for as long as the
stranger's connection lived (its pings keep it alive): every joiner and every peer that must
catch up was answered `busy`, the stage could neither grow nor heal, and the two copies stayed
pinned ("adversary R6"). Now a stream whose messages are not taken in time (`state_stall_s`,
`state_min_rate_bytes_s`) is ended, and one caller holds at most `max_state_streams_per_peer` (1)
streams, so the stranger needs an identity per stream.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from adversary_kit import JOB, SPEC, STAGE, spec, start_peer, stranger_pool

from swarmd.directory import StaticDirectory
from swarmd.job.spec import parse_toml
from swarmd.stage.state import download
from transport.errors import RemoteError
from transport.identity import Identity
from transport.limits import Limits
from transport.rpc import Message, Pool, RpcConfig

WINDOW = 4096
STATE = Message({"job": JOB, "stage": STAGE}, codec="none")


def slow_reader(identity: Identity | None = None) -> Pool:
    """A stranger's pool (a fresh identity by default) whose hello announces a 4 KiB window."""
    return Pool(RpcConfig(identity=identity or Identity.generate(), limits=Limits(max_inflight_bytes=WINDOW),
                          max_undelivered_bytes=WINDOW))


async def test_stalled_state_streams_do_not_keep_a_joiner_out():
    """Expected: a joiner retrying every 0.5 s gets the state within 12 s although the stranger
    never reads its two streams (one per identity: one identity holds one); on main every try is
    answered busy (max_state_streams)."""
    directory = StaticDirectory()
    victim = await start_peer(spec(), STAGE, directory)
    strangers = [slow_reader() for _ in range(victim.service.limits.max_state_streams)]
    joiner, _ = stranger_pool()
    held = contextlib.AsyncExitStack()
    try:
        for stranger in strangers:
            items = await held.enter_async_context(stranger.stream(victim.addr, "stage.state", STATE, timeout=3600))
            assert (await items.__anext__()).meta["kind"] == "header"
        got = None
        async with asyncio.timeout(12):
            while got is None:
                try:
                    got = await download(joiner, victim.addr, JOB, STAGE, victim.service.stage, 10)
                except RemoteError as exc:
                    assert exc.code == "busy", exc
                    await asyncio.sleep(0.5)
        assert got.step == victim.service.committed
    finally:
        with contextlib.suppress(Exception):
            await held.aclose()
        await joiner.close()
        for stranger in strangers:
            await stranger.close()
        await victim.close()


async def test_one_caller_holds_one_state_stream():
    """A stranger's second `stage.state` call while its first stream is open is answered busy
    (max_state_streams_per_peer), and another caller still gets the state meanwhile. The second
    call comes over a second connection of the same identity: on the first, the answer would
    queue behind the stream's frames that the stranger itself does not read. The stage is big
XX
    buffers while the stranger reads nothing, which would free the slot honestly."""
    directory = StaticDirectory()
    victim = await start_peer(parse_toml(SPEC.replace("d_model = 32", "d_model = 1024")), STAGE, directory)
    identity = Identity.generate()
    # A window that takes one state message (a smaller one has the stream refused at its first big
    # message, freeing the slot) and nothing read past it: the stream stays open, blocked on the
    # sockets, well short of the state's ~50 MB.
    stranger = Pool(RpcConfig(identity=identity, max_undelivered_bytes=8 << 20))
    again, joiner = slow_reader(identity), stranger_pool()[0]
    try:
        async with stranger.stream(victim.addr, "stage.state", STATE, timeout=3600) as items:
            assert (await items.__anext__()).meta["kind"] == "header"
            with pytest.raises(RemoteError) as refused:
                async with again.stream(victim.addr, "stage.state", STATE, timeout=10) as second:
                    await second.__anext__()
            assert refused.value.code == "busy" and "max_state_streams_per_peer" in refused.value.message
            got = await download(joiner, victim.addr, JOB, STAGE, victim.service.stage, 10)
            assert got.step == victim.service.committed
    finally:
        await joiner.close()
        await stranger.close()
        await again.close()
        await victim.close()
