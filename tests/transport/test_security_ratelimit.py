"""Per-peer RPC rate limits on live sockets: a flood from one proven peer is answered with
"rate_limited" without running the handler, while another peer's calls all go through, and the
limit follows the peer id across reconnects."""

from __future__ import annotations

import asyncio
import time

from transport.errors import RemoteError
from transport.identity import Identity
from transport.ratelimit import RateLimiter
from transport.rpc import CODE_RATE_LIMITED, Message, Pool, Request, Router, RpcConfig, RpcServer


def _router(ran: list[bytes]) -> Router:
    router = Router()

    async def echo(req: Request) -> Message:
        ran.append(req.peer.peer_id)
        return Message(dict(req.meta))

    router.unary("echo", echo)
    return router


async def _flood(pool: Pool, address, calls: int) -> tuple[int, int]:
    results = await asyncio.gather(
        *(pool.call(address, "echo", Message({"i": i}), timeout=10) for i in range(calls)),
        return_exceptions=True,
    )
    limited = [r for r in results if isinstance(r, RemoteError) and r.code == CODE_RATE_LIMITED]
    ok = [r for r in results if isinstance(r, Message)]
    assert len(limited) + len(ok) == calls, [r for r in results if not isinstance(r, Message)][:3]
    return len(ok), len(limited)


async def _timed_flood(pool: Pool, address, calls: int) -> tuple[int, int, float]:
    """The flood's counts and when it ended (the bucket refills from then on)."""
    ok, limited = await _flood(pool, address, calls)
    return ok, limited, time.monotonic()


async def test_a_flooding_peer_is_limited_while_another_peer_is_served(monkeypatch):
    """The refill after the flood is timed from the server's last decision on the flooder (its
    bucket is empty then), not from when the flooder read its last answer, which under load can
    come a good while later."""
    ran: list[bytes] = []
    decided: dict[object, float] = {}
    real_allow = RateLimiter.allow

    def allow(self: RateLimiter, key: object) -> bool:
        decided[key] = time.monotonic()
        return real_allow(self, key)

    monkeypatch.setattr(RateLimiter, "allow", allow)
    config = RpcConfig(identity=Identity.from_seed(b"server"), rate_limit_per_s=20.0, rate_limit_burst=50)
    srv = await RpcServer.serve_tcp(_router(ran), "127.0.0.1", 0, config)
    flooder, honest = Identity.from_seed(b"flooder"), Identity.from_seed(b"honest")
    flood_pool, honest_pool = Pool(RpcConfig(identity=flooder)), Pool(RpcConfig(identity=honest))
    try:
        started = time.monotonic()
        flood = asyncio.create_task(_timed_flood(flood_pool, srv.address, 1000))
        honest_results = []
        for i in range(30):  # 30 calls over ~1.5 s: well inside the burst of 50
            honest_results.append(await honest_pool.call(srv.address, "echo", Message({"i": i}), timeout=10))
            await asyncio.sleep(0.05)
        ok, limited, flood_ended = await flood
        assert [r.meta["i"] for r in honest_results] == list(range(30))
        # The flooder got its burst plus what refilled while it flooded (20/s), the rest was refused.
        assert 50 <= ok <= 50 + 20 * (flood_ended - started) + 2 and limited == 1000 - ok
        # Refused calls never reached the handler.
        assert ran.count(flooder.peer_id) == ok and ran.count(honest.peer_id) == 30
        # Reconnecting does not refill the bucket: the limit is on the peer id, not the connection.
        await flood_pool.close()
        flood_pool = Pool(RpcConfig(identity=flooder))
        emptied = decided[flooder.peer_id]
        ok_again, limited_again = await _flood(flood_pool, srv.address, 200)
        assert ok_again <= 20 * (time.monotonic() - emptied) + 2 and limited_again > 0
    finally:
        await flood_pool.close()
        await honest_pool.close()
        await srv.close()


async def test_anonymous_peers_are_limited_by_source_address():
    ran: list[bytes] = []
    srv = await RpcServer.serve_tcp(_router(ran), "127.0.0.1", 0, RpcConfig(rate_limit_per_s=1.0, rate_limit_burst=5))
    pools = [Pool(RpcConfig()), Pool(RpcConfig())]
    try:
        ok_a, _ = await _flood(pools[0], srv.address, 20)
        ok_b, _ = await _flood(pools[1], srv.address, 20)
        assert ok_a + ok_b <= 7  # one bucket for 127.0.0.1, whichever anonymous connection calls
        assert len(ran) == ok_a + ok_b
    finally:
        for pool in pools:
            await pool.close()
        await srv.close()


def test_bucket_table_is_bounded_and_refills_at_the_rate():
    now = [0.0]
    limiter = RateLimiter(rate_per_s=2.0, burst=3, max_buckets=4, clock=lambda: now[0])
    assert [limiter.allow("a") for _ in range(4)] == [True, True, True, False]
    now[0] += 0.5  # one token back
    assert limiter.allow("a") and not limiter.allow("a")
    for key in range(10):
        limiter.allow(key)
    assert len(limiter) == 4
