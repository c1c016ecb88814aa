"""Traffic counters on live sockets: what each end counts is what crossed the wire.

A counting TCP relay sits between a Pool and an RpcServer, each with its own `Traffic`. After a few
calls (small, then one carrying a 1 MiB tensor), the client's sent bytes equal what the relay
carried towards the server and the server's received bytes, and the other way round; the same holds
with encryption on (sealed records are counted as they leave), and a refused hello is counted too.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from transport.rpc import Message, Pool, Request, Router, RpcConfig, RpcServer
from transport.traffic import Traffic

from tcp_relay import Relay
from waiting import until

torch.set_num_threads(1)

#: Heartbeats would add PING frames at any moment; these tests compare totals, so they are rare.
QUIET = {"heartbeat_interval_s": 60.0, "heartbeat_timeout_s": 120.0}
SETTLE_S = 20.0


async def echo(req: Request) -> Message:
    return Message(dict(req.meta), req.tensors, codec="none")


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
async def test_both_ends_count_exactly_the_bytes_that_crossed(encrypt: bool) -> None:
    router = Router()
    router.unary("echo", echo)
    server_traffic, client_traffic = Traffic(), Traffic()
    server = await RpcServer.serve_tcp(
        router, "127.0.0.1", 0, RpcConfig(traffic=server_traffic, encrypt=encrypt, **QUIET),
    )
    pool = Pool(RpcConfig(traffic=client_traffic, encrypt=encrypt, **QUIET))
    try:
        async with Relay(("127.0.0.1", server.port)) as relay:
            for i in range(5):
                assert (await pool.call(relay.address, "echo", Message({"i": i}), timeout=10)).meta == {"i": i}
            big = torch.arange(256 * 1024, dtype=torch.float32)  # 1 MiB of payload, sent uncompressed
            reply = await pool.call(relay.address, "echo", Message({}, [big], codec="none"), timeout=30)
            assert torch.equal(reply.tensors[0], big)

            # The last bytes may still sit in a kernel buffer.
            await until(lambda: client_traffic.sent_bytes == relay.to_server == server_traffic.received_bytes
                        and server_traffic.sent_bytes == relay.to_client == client_traffic.received_bytes,
                        SETTLE_S, "the traffic counters to settle")
            assert client_traffic.sent_bytes > big.numel() * 4
            assert server_traffic.sent_bytes > big.numel() * 4
            await pool.close()
    finally:
        await pool.close()
        await server.close()


async def test_a_refused_hello_is_counted() -> None:
    """The refusal frame is written outside the normal writer; it still counts. A raw client that
    never says hello reads everything the server sends until it hangs up at the handshake deadline:
    our hello, then the refusal."""
    server_traffic = Traffic()
    server = await RpcServer.serve_tcp(Router(), "127.0.0.1", 0,
                                       RpcConfig(traffic=server_traffic, handshake_timeout_s=0.5))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        received = await asyncio.wait_for(reader.read(), SETTLE_S)  # until the server closes
        writer.close()
        assert b"no hello within" in received
        assert server_traffic.sent_bytes == len(received)
        assert server_traffic.received_bytes == 0
    finally:
        await server.close()


def test_a_config_without_traffic_counts_nothing_and_copies_share_one_counter() -> None:
    import dataclasses

    traffic = Traffic()
    config = RpcConfig(traffic=traffic)
    assert dataclasses.replace(config, app={"announce": "x:1"}).traffic is traffic
    assert RpcConfig().traffic is None
    assert Traffic() != Traffic()  # counters compare by identity, not by their current values
