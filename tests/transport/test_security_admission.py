"""Pre-welcome connection limits and slow-loris on live sockets: raw sockets from 127.0.0.1 that
never finish a hello hold at most `max_unproven_per_source` slots, the rest are closed before
anything is read, and honest clients get in once the handshake deadline frees the slots."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from waiting import until

from transport.errors import ConnectionLost, HandshakeError
from transport.rpc import Message, Pool, Request, Router, RpcConfig, RpcServer
from transport.wire import encode_frame, Kind


def _router() -> Router:
    router = Router()

    async def echo(req: Request) -> Message:
        return Message(dict(req.meta))

    router.unary("echo", echo)
    return router


async def _echo(address, config: RpcConfig = RpcConfig()) -> Message:
    pool = Pool(config)
    try:
        return await pool.call(address, "echo", Message({"x": 1}), timeout=5)
    finally:
        await pool.close()


def _raw(address) -> socket.socket:
    sock = socket.create_connection(address)
    sock.setblocking(False)
    return sock


def _closed_by_peer(sock: socket.socket) -> bool:
    """True once the server has closed or reset this socket (it never sends us anything else we
    do not read: a gated connection gets no hello at all)."""
    try:
        while True:
            if sock.recv(65536) == b"":
                return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True



async def test_silent_sockets_hold_at_most_the_per_source_quota_and_free_it_at_the_deadline():
    config = RpcConfig(max_unproven_per_source=4, max_unproven_connections=100, handshake_timeout_s=2.0)
    srv = await RpcServer.serve_tcp(_router(), "127.0.0.1", 0, config)
    socks = [_raw(srv.address) for _ in range(12)]
    try:
        await until(lambda: srv.unproven_connections == 4 and srv.connections == 4, 3, "four unproven connections held")
        # The 8 over the quota were closed at once, long before the 2 s deadline.
        await until(lambda: sum(_closed_by_peer(s) for s in socks) >= 8, 0.8,
                    "the eight sockets over quota to be dropped")
        # An honest client from the same host is refused while the quota is held...
        with pytest.raises((HandshakeError, ConnectionLost)):
            await _echo(srv.address)
        # ...and gets in once the deadline has cleared the silent ones.
        await until(lambda: srv.unproven_connections == 0, 4, "every unproven slot freed at the deadline")
        assert (await _echo(srv.address)).meta == {"x": 1}
        assert all(_closed_by_peer(s) for s in socks)
    finally:
        for s in socks:
            s.close()
        await srv.close()


async def test_total_quota_counts_every_source():
    config = RpcConfig(max_unproven_per_source=100, max_unproven_connections=3, handshake_timeout_s=2.0)
    srv = await RpcServer.serve_tcp(_router(), "127.0.0.1", 0, config)
    socks = [_raw(srv.address) for _ in range(6)]
    try:
        await until(lambda: sum(_closed_by_peer(s) for s in socks) >= 3, 0.8,
                    "the three sockets over the total to be dropped")
        assert srv.unproven_connections == 3
        await until(lambda: srv.unproven_connections == 0, 4, "every unproven slot freed at the deadline")
        assert (await _echo(srv.address)).meta == {"x": 1}
    finally:
        for s in socks:
            s.close()
        await srv.close()


async def test_welcomed_connections_do_not_count_against_the_quota():
    config = RpcConfig(max_unproven_per_source=2, handshake_timeout_s=5.0)
    srv = await RpcServer.serve_tcp(_router(), "127.0.0.1", 0, config)
    pools = [Pool(RpcConfig()) for _ in range(6)]
    try:
        for pool in pools:
            assert (await pool.call(srv.address, "echo", Message({"x": 2}), timeout=5)).meta == {"x": 2}
        assert srv.connections == 6 and srv.unproven_connections == 0
    finally:
        for pool in pools:
            await pool.close()
        await srv.close()


async def test_slow_loris_trickling_a_byte_a_second_is_dropped_at_the_handshake_deadline():
    config = RpcConfig(handshake_timeout_s=1.5)
    srv = await RpcServer.serve_tcp(_router(), "127.0.0.1", 0, config)
    hello = b"".join(bytes(p) for p in encode_frame(Kind.HELLO, {"hello": b"x" * 200}))
    sock = _raw(srv.address)
    started = time.monotonic()
    try:
        sent = 0
        while not _closed_by_peer(sock):
            assert time.monotonic() - started < 4, "the trickling client was never dropped"
            try:
                sock.send(hello[sent : sent + 1])
                sent += 1
            except (BrokenPipeError, ConnectionResetError):
                break
            await asyncio.sleep(1.0)
        elapsed = time.monotonic() - started
        assert 1.4 <= elapsed < 3.0, elapsed
        assert sent < len(hello)
        assert srv.unproven_connections == 0
        assert (await _echo(srv.address)).meta == {"x": 1}
    finally:
        sock.close()
        await srv.close()


async def test_a_client_refused_at_accept_can_still_write_its_hello_and_read_why(tmp_path):
    """Steps: a Unix server whose admit_local refuses everyone; a raw client connects, reads the
    refusal and the end of the server's output, and only then writes its hello (a loaded client
    is that late); then it hangs up.
    Expected: the hello is accepted by the socket (before: the server had closed at once, the
    write failed with EPIPE, and swarmctl said "connection lost: Broken pipe" instead of the
    reason under a loaded machine); the server drops the socket once the client hangs up, well
    before refusal_linger_s."""
    config = RpcConfig(refusal_linger_s=30.0)
    server = await RpcServer.serve_unix(_router(), tmp_path / "s.sock", config=config,
                                        admit_local=lambda peercred: "not you")
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, str(tmp_path / "s.sock"))
        received = b""
        while chunk := await asyncio.wait_for(loop.sock_recv(sock, 65536), 5):
            received += chunk
        assert b"admission refused: not you" in received
        await loop.sock_sendall(sock, b"a late hello" * 100)
        sock.shutdown(socket.SHUT_WR)
        # The server hangs up when the client does: the socket reads EOF, not a reset, at once.
        assert await asyncio.wait_for(loop.sock_recv(sock, 1), 5) == b""
    finally:
        sock.close()
        await server.close()
