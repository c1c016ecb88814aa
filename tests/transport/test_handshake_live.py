"""The hello on live sockets: swarm key, forged signatures, admission and a silent peer are all
refused before a single request is read, and the refusing side says why."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

import pytest

from transport.errors import HandshakeError
from transport.identity import Identity
from transport.rpc import Message, Pool, Request, Router, RpcConfig, RpcServer
from transport.wire import FrameDecoder, Kind, encode_frame, encode_message


def _router(calls: list[str]) -> Router:
    router = Router()

    async def echo(req: Request) -> Message:
        calls.append(req.method)
        return Message(dict(req.meta))

    router.unary("echo", echo)
    return router


@dataclass(frozen=True)
class ForgingIdentity(Identity):
    """Announces its own public key but signs something other than the transcript."""

    def sign(self, message: bytes) -> bytes:
        return super().sign(b"not the transcript")


async def _call(config: RpcConfig, address) -> Message:
    pool = Pool(config)
    try:
        return await pool.call(address, "echo", Message({"x": 1}), timeout=5)
    finally:
        await pool.close()


async def test_swarm_key_must_match_on_both_sides():
    calls: list[str] = []
    srv = await RpcServer.serve_tcp(_router(calls), "127.0.0.1", 0, RpcConfig(swarm_key=b"right" * 8))
    try:
        with pytest.raises(HandshakeError, match="swarm key"):
            await _call(RpcConfig(swarm_key=b"wrong" * 8), srv.address)
        with pytest.raises(HandshakeError, match="swarm key"):
            await _call(RpcConfig(), srv.address)
        assert calls == []
        assert (await _call(RpcConfig(swarm_key=b"right" * 8), srv.address)).meta == {"x": 1}
    finally:
        await srv.close()


async def test_forged_signature_is_refused_and_the_forger_is_told():
    calls: list[str] = []
    srv = await RpcServer.serve_tcp(_router(calls), "127.0.0.1", 0, RpcConfig(identity=Identity.from_seed(b"s")))
    try:
        with pytest.raises(HandshakeError, match="signature"):
            await _call(RpcConfig(identity=ForgingIdentity.from_seed(b"forger")), srv.address)
        assert calls == []
    finally:
        await srv.close()
    # The other way round: a server that cannot prove its key is refused by the caller.
    srv = await RpcServer.serve_tcp(_router(calls), "127.0.0.1", 0, RpcConfig(identity=ForgingIdentity.from_seed(b"s")))
    try:
        with pytest.raises(HandshakeError, match="signature"):
            await _call(RpcConfig(), srv.address)
    finally:
        await srv.close()


async def test_admit_hook_refusal_reaches_the_caller_with_its_reason():
    friend = Identity.from_seed(b"friend")
    calls: list[str] = []

    def admit(remote):
        return None if remote.peer_id == friend.peer_id else "not on the allow list"

    srv = await RpcServer.serve_tcp(_router(calls), "127.0.0.1", 0, admit=admit)
    try:
        with pytest.raises(HandshakeError, match="not on the allow list"):
            await _call(RpcConfig(identity=Identity.from_seed(b"stranger")), srv.address)
        with pytest.raises(HandshakeError, match="not on the allow list"):
            await _call(RpcConfig(), srv.address)  # anonymous
        assert calls == []
        assert (await _call(RpcConfig(identity=friend), srv.address)).meta == {"x": 1}
    finally:
        await srv.close()


async def test_silent_peer_is_dropped_at_the_handshake_deadline():
    """Steps: open a raw socket and send nothing. Expected: the server sends its hello, then a
    refusal naming the timeout, then closes, all within the handshake deadline."""
    srv = await RpcServer.serve_tcp(_router([]), "127.0.0.1", 0, RpcConfig(handshake_timeout_s=0.3))
    loop = asyncio.get_running_loop()
    raw = socket.create_connection(srv.address)
    raw.setblocking(False)
    try:
        decoder = FrameDecoder()
        async with asyncio.timeout(10):
            while chunk := await loop.sock_recv(raw, 65536):
                decoder.feed(chunk)
        frames = []
        while (frame := decoder.next_frame()) is not None:
            frames.append(frame)
        assert [f.kind for f in frames] == [Kind.HELLO, Kind.HELLO]
        assert "no hello within" in frames[1].header["refused"]
    finally:
        raw.close()
        await srv.close()


async def test_request_before_the_hello_finishes_is_refused():
    """A peer that skips the hello and sends a request gets refused without the handler running."""
    calls: list[str] = []
    srv = await RpcServer.serve_tcp(_router(calls), "127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    raw = socket.create_connection(srv.address)
    raw.setblocking(False)
    try:
        request = encode_frame(Kind.REQUEST, {"id": 1, "m": "echo", "t": 5.0, "meta": {}, "x": []})
        await loop.sock_sendall(raw, b"".join(bytes(p) for p in request))
        decoder = FrameDecoder()
        async with asyncio.timeout(10):
            while chunk := await loop.sock_recv(raw, 65536):
                decoder.feed(chunk)
        frames = []
        while (frame := decoder.next_frame()) is not None:
            frames.append(frame)
        assert "before the hello finished" in frames[-1].header["refused"]
        assert calls == []
    finally:
        raw.close()
        await srv.close()


async def test_stranger_cannot_announce_a_huge_message_before_the_hello():
    """Steps: a raw socket sends a chunked REQUEST opener announcing 256 MiB, before any hello.
    Expected: the server hangs up at once, refusing the opener from its prelude (pre-hello limits
    allow no payload buffers), so nothing is reserved for it; other clients are unaffected."""
    calls: list[str] = []
    srv = await RpcServer.serve_tcp(_router(calls), "127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    raw = socket.create_connection(srv.address)
    raw.setblocking(False)
    try:
        opener = encode_message(Kind.REQUEST, {"id": 1, "m": "echo"}, [bytes(2 * 1024 * 1024)])[0]
        head = bytearray(b"".join(bytes(p) for p in opener))
        head[16:24] = (256 * 1024 * 1024).to_bytes(8, "big")  # the length table's one entry
        await loop.sock_sendall(raw, bytes(head))
        async with asyncio.timeout(5):
            while await _recv_or_reset(loop, raw):
                pass
        assert (await _call(RpcConfig(), srv.address)).meta == {"x": 1}
        assert calls == ["echo"]
    finally:
        raw.close()
        await srv.close()


async def _recv_or_reset(loop, sock) -> bytes:
    try:
        return await loop.sock_recv(sock, 65536)
    except ConnectionResetError:
        return b""
