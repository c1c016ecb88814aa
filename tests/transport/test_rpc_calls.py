"""RPC over real loopback sockets: unary and streamed calls, typed errors, the handshake on a live
connection, Unix sockets with peer credentials, and many concurrent calls on one connection."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
import torch

from transport.errors import ConnectionLost, LocalProtocolError, RemoteError, RpcError
from transport.identity import Identity
from transport.rpc import Message, Pool, Request, Router, RpcConfig, RpcServer, parse_address

torch.set_num_threads(1)


def _router() -> Router:
    router = Router()

    async def echo(req: Request) -> Message:
        return Message(dict(req.meta), req.tensors, codec=req.meta.get("codec", "none"))

    async def whoami(req: Request) -> Message:
        peer = req.peer
        return Message({"peer_id": peer.peer_id, "app": peer.app, "peercred": list(peer.peercred or ())})

    async def fail_typed(req: Request) -> Message:
        raise RpcError("no_such_step", "step 7 is not known here")

    async def fail_bug(req: Request) -> Message:
        raise ZeroDivisionError("division by zero in the handler")

    async def count(req: Request):
        for i in range(req.meta["n"]):
            yield Message({"i": i}, [torch.full((4,), float(i))], codec="none")

    async def count_then_fail(req: Request):
        yield Message({"i": 0})
        raise RpcError("broke", "after one item")

    router.unary("echo", echo)
    router.unary("whoami", whoami)
    router.unary("fail_typed", fail_typed)
    router.unary("fail_bug", fail_bug)
    router.stream("count", count)
    router.stream("count_then_fail", count_then_fail)
    return router


@pytest.fixture
async def server():
    srv = await RpcServer.serve_tcp(_router(), "127.0.0.1", 0, RpcConfig(identity=Identity.from_seed(b"server")))
    try:
        yield srv
    finally:
        await srv.close()


@pytest.fixture
async def pool():
    p = Pool(RpcConfig(identity=Identity.from_seed(b"client"), app={"announce": "10.1.2.3:7000"}))
    try:
        yield p
    finally:
        await p.close()


async def test_unary_round_trip_keeps_meta_and_tensors_exact(server, pool):
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.tensor(True), torch.empty(0, 2)]
    reply = await pool.call(server.address, "echo", Message({"k": [1, "two", b"3"]}, tensors, codec="none"), timeout=5)
    assert reply.meta == {"k": [1, "two", b"3"]}
    assert len(reply.tensors) == len(tensors)
    for got, sent in zip(reply.tensors, tensors):
        assert got.dtype == sent.dtype and torch.equal(got, sent)


async def test_fp16_lz4_default_codec_round_trips_within_fp16_error(server, pool):
    x = torch.randn(1000)
    reply = await pool.call(server.address, "echo", Message({"codec": "fp16+lz4"}, [x]), timeout=5)
    assert reply.tensors[0].dtype == torch.float32
    assert torch.allclose(reply.tensors[0], x, rtol=1e-3, atol=1e-3)


async def test_address_forms_reach_the_same_connection(server, pool):
    host, port = server.address
    first = await pool.connect(f"{host}:{port}")
    assert await pool.connect((host, port)) is first
    assert parse_address("[::1]:80") == ("::1", 80)
    with pytest.raises(LocalProtocolError):
        parse_address("no-port")


async def test_handshake_proves_both_peer_ids_and_carries_app(server, pool):
    conn = await pool.connect(server.address)
    assert conn.remote.peer_id == Identity.from_seed(b"server").peer_id
    reply = await pool.call(server.address, "whoami", timeout=5)
    assert reply.meta["peer_id"] == Identity.from_seed(b"client").peer_id
    assert reply.meta["app"] == {"announce": "10.1.2.3:7000"}
    assert reply.meta["peercred"] == []


async def test_remote_errors_are_typed(server, pool):
    with pytest.raises(RemoteError) as typed:
        await pool.call(server.address, "fail_typed", timeout=5)
    assert (typed.value.code, typed.value.message) == ("no_such_step", "step 7 is not known here")
    with pytest.raises(RemoteError) as bug:
        await pool.call(server.address, "fail_bug", timeout=5)
    assert bug.value.code == "internal" and "division by zero" in bug.value.message
    with pytest.raises(RemoteError) as unknown:
        await pool.call(server.address, "nope", timeout=5)
    assert unknown.value.code == "unknown_method"
    # The connection survives handler failures.
    assert (await pool.call(server.address, "echo", Message({"ok": 1}), timeout=5)).meta == {"ok": 1}


async def test_stream_yields_every_item_then_ends(server, pool):
    async with pool.stream(server.address, "count", Message({"n": 5}), timeout=5) as items:
        got = [(m.meta["i"], m.tensors[0][0].item()) async for m in items]
    assert got == [(i, float(i)) for i in range(5)]


async def test_stream_error_after_items_is_typed(server, pool):
    seen = []
    with pytest.raises(RemoteError, match="after one item"):
        async with pool.stream(server.address, "count_then_fail", timeout=5) as items:
            async for m in items:
                seen.append(m.meta["i"])
    assert seen == [0]


async def test_thousand_concurrent_calls_share_one_connection(server, pool):
    async def one(i: int) -> int:
        reply = await pool.call(server.address, "echo", Message({"i": i}, [torch.full((8,), float(i))], codec="none"),
                                timeout=30)
        assert reply.tensors[0][0].item() == float(i)
        return reply.meta["i"]

    results = await asyncio.gather(*(one(i) for i in range(1000)))
    assert results == list(range(1000))
    assert server.connections == 1


async def test_too_big_message_is_a_local_error_and_the_connection_lives(server):
    limits = RpcConfig().limits
    small = RpcConfig(limits=type(limits)(max_message_bytes=4 << 20, max_inflight_bytes=4 << 20))
    async with _pool(small) as p:
        with pytest.raises(LocalProtocolError):
            await p.call(server.address, "echo", Message({}, [torch.zeros(2 << 20)], codec="none"), timeout=5)
        assert (await p.call(server.address, "echo", Message({"a": 1}), timeout=5)).meta == {"a": 1}


async def test_unix_socket_carries_peercred_and_sock_activation_works(tmp_path):
    path = tmp_path / "control.sock"
    seen = []
    srv = await RpcServer.serve_unix(_router(), path=path, admit=lambda r: seen.append(r.peercred))
    try:
        async with _pool(RpcConfig()) as p:
            reply = await p.call(f"unix:{path}", "whoami", timeout=5)
        assert reply.meta["peer_id"] is None
        assert tuple(reply.meta["peercred"]) == (os.getpid(), os.getuid(), os.getgid())
        assert seen == [(os.getpid(), os.getuid(), os.getgid())]
    finally:
        await srv.close()
    assert not path.exists()

    # systemd socket activation: the socket arrives bound and listening.
    activated = tmp_path / "activated.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(activated))
    sock.listen()
    srv = await RpcServer.serve_unix(_router(), sock=sock)
    try:
        async with _pool(RpcConfig()) as p:
            assert (await p.call(f"unix:{activated}", "echo", Message({"u": 1}), timeout=5)).meta == {"u": 1}
    finally:
        await srv.close()


async def test_tcp_socket_options_are_set_and_buffers_left_to_autotuning(server, pool):
    conn = await pool.connect(server.address)
    sock = conn.get_extra_info("socket")
    opts = RpcConfig().socket
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == opts.keepalive_idle_s
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == opts.keepalive_interval_s
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == opts.keepalive_count
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == opts.user_timeout_ms
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT) == opts.notsent_lowat


def test_nonsensical_config_is_refused_up_front():
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        RpcConfig(heartbeat_interval_s=5, heartbeat_timeout_s=2)
    with pytest.raises(ValueError, match="swarm_key"):
        RpcConfig(swarm_key=b"short")
    with pytest.raises(ValueError, match="max_pending_calls"):
        RpcConfig(max_pending_calls=0)


async def test_dial_failure_is_connection_lost():
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    async with _pool(RpcConfig()) as p:
        with pytest.raises(ConnectionLost):
            await p.call(("127.0.0.1", port), "echo", timeout=5)


class _pool:
    def __init__(self, config: RpcConfig) -> None:
        self.pool = Pool(config)

    async def __aenter__(self) -> Pool:
        return self.pool

    async def __aexit__(self, *exc) -> None:
        await self.pool.close()
