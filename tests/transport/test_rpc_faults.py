"""Failures with real processes and sockets: a server killed mid-stream, restarted on the same port,
frozen with SIGSTOP; a raw socket sending garbage; a peer that stops reading."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from waiting import until

from transport.errors import ConnectionLost, DeadlineExceeded
from transport.limits import MiB, Limits
from transport.rpc import Message, Pool, Request, Router, RpcConfig, RpcServer

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]

SERVER = r"""
import asyncio, sys
import torch
from transport.rpc import Message, Router, RpcConfig, RpcServer

torch.set_num_threads(1)

async def main(port):
    router = Router()

    async def echo(req):
        return Message(dict(req.meta), req.tensors, codec="none")

    async def forever(req):
        i = 0
        while True:
            yield Message({"i": i})
            i += 1
            await asyncio.sleep(0.01)

    router.unary("echo", echo)
    router.stream("forever", forever)
    server = await RpcServer.serve_tcp(router, "127.0.0.1", port, RpcConfig())
    print(server.port, flush=True)
    await asyncio.Event().wait()

asyncio.run(main(int(sys.argv[1])))
"""


class ServerProcess:
    """The RPC server in its own process, so it can be killed and stopped like a real peer."""

    def __init__(self, port: int = 0) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, env=env, cwd=REPO
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"server process exited with {self.proc.wait()}")
        self.port = int(line)
        self.address = ("127.0.0.1", self.port)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture
def server_process():
    started: list[ServerProcess] = []

    def start(port: int = 0) -> ServerProcess:
        started.append(ServerProcess(port))
        return started[-1]

    try:
        yield start
    finally:
        for proc in started:
            proc.stop()


@pytest.mark.slow
async def test_server_killed_mid_stream_fails_the_caller_with_connection_lost(server_process):
    """Steps: stream from a server process; after a few items SIGKILL it. Expected: the consumer's
    next item raises ConnectionLost well within the stream's deadline."""
    server = server_process()
    pool = Pool(RpcConfig())
    try:
        started = time.monotonic()
        with pytest.raises(ConnectionLost):
            async with pool.stream(server.address, "forever", timeout=20) as items:
                async for item in items:
                    if item.meta["i"] == 3:
                        server.signal(signal.SIGKILL)
        assert time.monotonic() - started < 20
    finally:
        await pool.close()


@pytest.mark.slow
async def test_restarted_server_on_the_same_port_is_reached_through_the_pool(server_process):
    first = server_process()
    pool = Pool(RpcConfig())
    try:
        assert (await pool.call(first.address, "echo", Message({"n": 1}), timeout=10)).meta == {"n": 1}
        first.stop()
        second = server_process(first.port)
        assert second.port == first.port
        for _ in range(50):  # the old connection's death may still be on its way to us
            try:
                reply = await pool.call(second.address, "echo", Message({"n": 2}), timeout=10)
                break
            except ConnectionLost:
                await asyncio.sleep(0.05)
        assert reply.meta == {"n": 2}
    finally:
        await pool.close()


@pytest.mark.slow
async def test_heartbeat_detects_a_stopped_peer(server_process):
    """Steps: connect with a 0.2 s heartbeat and 1 s silence limit, SIGSTOP the server, make a call
    with a long deadline. Expected: ConnectionLost (not DeadlineExceeded) after about 1 s."""
    server = server_process()
    pool = Pool(RpcConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0))
    try:
        await pool.call(server.address, "echo", timeout=10)
        server.signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(ConnectionLost, match="nothing heard"):
            await pool.call(server.address, "echo", timeout=30)
        assert time.monotonic() - started < 10
    finally:
        await pool.close()


@pytest.mark.slow
async def test_sender_memory_stays_within_the_inflight_limit_when_the_peer_stops_reading(server_process):
    """Steps: limit in-flight payload to 8 MiB; SIGSTOP the server; start 40 calls of 2 MiB each.
    Expected: what the connection holds for sending stays under the limit plus the transport's
    write buffer and one frame, while the calls wait; after SIGCONT every call completes."""
    server = server_process()
    limits = Limits(max_inflight_bytes=8 * MiB)
    config = RpcConfig(limits=limits, heartbeat_timeout_s=60)
    pool = Pool(config)
    try:
        conn = await pool.connect(server.address)
        server.signal(signal.SIGSTOP)
        payload = torch.ones(512 * 1024)  # 2 MiB
        calls = [
            asyncio.create_task(pool.call(server.address, "echo", Message({"i": i}, [payload], codec="none"), timeout=60))
            for i in range(40)
        ]
        bound = limits.max_inflight_bytes + config.write_buffer_bytes + limits.max_frame_bytes
        peak = 0
        for _ in range(100):
            await asyncio.sleep(0.01)
            peak = max(peak, conn.buffered_bytes)
        assert 0 < peak <= bound
        assert not any(call.done() for call in calls)
        server.signal(signal.SIGCONT)
        replies = await asyncio.gather(*calls)
        assert [r.meta["i"] for r in replies] == list(range(40))
    finally:
        await pool.close()


async def test_garbage_from_one_socket_closes_only_that_connection():
    router = Router()

    async def echo(req: Request) -> Message:
        return Message(dict(req.meta))

    router.unary("echo", echo)
    server = await RpcServer.serve_tcp(router, "127.0.0.1", 0)
    pool = Pool(RpcConfig())
    try:
        assert (await pool.call(server.address, "echo", Message({"a": 1}), timeout=5)).meta == {"a": 1}
        loop = asyncio.get_running_loop()
        for junk in (b"GET / HTTP/1.1\r\n\r\n", b"SWRM\x01\x0b" + b"\xff" * 64, os.urandom(4096)):
            raw = socket.create_connection(server.address)
            raw.setblocking(False)
            await loop.sock_sendall(raw, junk)
            received = b""
            async with asyncio.timeout(10):
                while chunk := await _recv_or_reset(loop, raw):
                    received += chunk  # the server's own hello, then it hangs up
            raw.close()
            assert (await pool.call(server.address, "echo", Message({"b": 2}), timeout=5)).meta == {"b": 2}
        assert server.connections == 1
    finally:
        await pool.close()
        await server.close()


async def _recv_or_reset(loop, sock) -> bytes:
    try:
        return await loop.sock_recv(sock, 65536)
    except ConnectionResetError:
        return b""


@pytest.mark.slow
async def test_a_stopped_peer_costs_a_caller_its_deadline_and_the_pool_its_close_timeout(server_process):
    """Steps: SIGSTOP the server; make a small call with a 0.3 s deadline, then start a 64 MiB call
    that fills every buffer on the way; close the pool. Expected: DeadlineExceeded for the small
    call, and close() returns after about close_timeout_s instead of waiting for the peer."""
    server = server_process()
    config = RpcConfig(heartbeat_timeout_s=60, close_timeout_s=0.5)
    pool = Pool(config)
    await pool.call(server.address, "echo", timeout=10)
    server.signal(signal.SIGSTOP)
    with pytest.raises(DeadlineExceeded):
        await pool.call(server.address, "echo", timeout=0.3)
    stuck = asyncio.create_task(
        pool.call(server.address, "echo", Message({}, [torch.zeros(16 * MiB)], codec="none"), timeout=60)
    )
    conn = await pool.connect(server.address)
    await until(lambda: conn.buffered_bytes > 0, 10, "the 16 MiB call to be on its way")
    started = time.monotonic()
    await pool.close()
    assert time.monotonic() - started < config.close_timeout_s + 5
    with pytest.raises(ConnectionLost):
        await stuck
