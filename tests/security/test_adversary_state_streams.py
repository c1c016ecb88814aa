"""A stranger that holds a stage's state downloads open, over real loopback sockets.

`stage.state` is answered to anyone (a joiner is nobody's mate yet), at most `max_state_streams`
(2) at once, each holding a full copy of the stage's state. A stranger with a fresh identity
opens two, reads their headers and then reads nothing; its hello announces a 4 KiB in-flight
window, which the server honours, so the streams block after a few KiB and stay open for as long
as the stranger's connection lives (its pings keep it alive). Every joiner and every peer that
must catch up is then answered `busy`: the stage can neither grow nor heal, and the two copies
stay pinned. Requested of race (swarmd/stage/service.py `state_stream`), "adversary R6" in
/work/coord/requests.md.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from adversary_kit import JOB, STAGE, spec, start_peer, stranger_pool

from swarmd.directory import StaticDirectory
from swarmd.stage.state import download
from transport.errors import RemoteError
from transport.identity import Identity
from transport.limits import Limits
from transport.rpc import Message, Pool, RpcConfig

R6 = "adversary R6 in /work/coord/requests.md: a stalled state stream must not hold a slot (race)"
WINDOW = 4096


@pytest.mark.xfail(strict=True, reason=R6)
async def test_stalled_state_streams_do_not_keep_a_joiner_out():
    """Expected: a joiner retrying every 0.5 s gets the state within 12 s although the stranger
    never reads its two streams; on main every try is answered busy (max_state_streams)."""
    directory = StaticDirectory()
    victim = await start_peer(spec(), STAGE, directory)
    stranger = Pool(RpcConfig(identity=Identity.generate(), limits=Limits(max_inflight_bytes=WINDOW),
                              max_undelivered_bytes=WINDOW))
    joiner, _ = stranger_pool()
    held = contextlib.AsyncExitStack()
    try:
        for _ in range(victim.service.limits.max_state_streams):
            call = stranger.stream(victim.addr, "stage.state", Message({"job": JOB, "stage": STAGE}, codec="none"),
                                   timeout=3600)
            items = await held.enter_async_context(call)
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
        await stranger.close()
        await victim.close()
