"""Encrypted connections (RpcConfig.encrypt) on live sockets, through a recording TCP relay that
can also flip a byte: calls work sealed, the plaintext never crosses the wire, an altered byte
closes the connection with a SealError, and a side that will not encrypt is refused."""

from __future__ import annotations

import asyncio

import pytest
import torch

import msgpack

from transport.errors import ConnectionLost, HandshakeError, LimitExceeded, SealError
from transport.handshake import Handshake
from transport.identity import Identity
from transport.rpc import Message, Pool, Request, Router, RpcConfig, RpcServer
from transport.seal import Opener, Sealer

from tcp_relay import Relay

torch.set_num_threads(1)

MARKER = "plaintext-marker-9f3a7c"
PATTERN = torch.arange(4096, dtype=torch.int32) * 7919  # distinctive bytes, sent with codec "none"


def _router() -> Router:
    router = Router()

    async def echo(req: Request) -> Message:
        return Message(dict(req.meta), list(req.tensors), codec="none")

    router.unary("echo", echo)
    return router


async def _serve(encrypt: bool) -> RpcServer:
    return await RpcServer.serve_tcp(
        _router(), "127.0.0.1", 0, RpcConfig(identity=Identity.from_seed(b"srv"), encrypt=encrypt)
    )


async def _round_trip(pool: Pool, address) -> Message:
    reply = await pool.call(address, "echo", Message({"secret": MARKER}, [PATTERN], codec="none"), timeout=5)
    assert reply.meta == {"secret": MARKER} and torch.equal(reply.tensors[0], PATTERN)
    return reply


@pytest.mark.parametrize("encrypt", [True, False])
async def test_plaintext_crosses_the_wire_only_without_encryption(encrypt):
    srv = await _serve(encrypt)
    pool = Pool(RpcConfig(identity=Identity.from_seed(b"cli"), encrypt=encrypt))
    try:
        async with Relay(srv.address) as relay:
            for _ in range(3):
                await _round_trip(pool, relay.address)
            wire = bytes(relay.wire)
            seen = MARKER.encode() in wire or PATTERN.numpy().tobytes()[:256] in wire
            assert seen is not encrypt
            await pool.close()
    finally:
        await pool.close()
        await srv.close()


async def test_a_flipped_bit_closes_the_connection_with_a_seal_error():
    srv = await _serve(True)
    pool = Pool(RpcConfig(encrypt=True))
    try:
        async with Relay(srv.address) as relay:
            await _round_trip(pool, relay.address)
            relay.tamper_next_reply = True
            with pytest.raises(ConnectionLost) as caught:
                await _round_trip(pool, relay.address)
            assert isinstance(caught.value.__cause__, SealError), caught.value
            # A fresh connection (fresh keys) works again.
            await _round_trip(pool, relay.address)
            await pool.close()
    finally:
        await pool.close()
        await srv.close()


@pytest.mark.parametrize("server_encrypts", [True, False])
async def test_disagreeing_on_encryption_is_refused_with_a_reason(server_encrypts):
    srv = await _serve(server_encrypts)
    pool = Pool(RpcConfig(encrypt=not server_encrypts))
    try:
        with pytest.raises(HandshakeError, match="RpcConfig.encrypt"):
            await pool.call(srv.address, "echo", Message({}), timeout=5)
    finally:
        await pool.close()
        await srv.close()


async def test_encryption_with_swarm_key_and_big_chunked_messages():
    """Chunked messages (many records per message) and the swarm key together."""
    key = b"k" * 32
    srv = await RpcServer.serve_tcp(_router(), "127.0.0.1", 0, RpcConfig(swarm_key=key, encrypt=True))
    pool = Pool(RpcConfig(swarm_key=key, encrypt=True))
    big = torch.randn(3 * 1024 * 1024, generator=torch.Generator().manual_seed(0))
    try:
        reply = await pool.call(srv.address, "echo", Message({"n": 1}, [big], codec="none"), timeout=30)
        assert torch.equal(reply.tensors[0], big)
    finally:
        await pool.close()
        await srv.close()


def test_replayed_reordered_and_oversized_records_are_refused():
    key = bytes(range(32))
    sealer = Sealer(key, lambda _: None)
    first, second = b"".join(sealer.seal([b"one"])), b"".join(sealer.seal([b"two", memoryview(b"!")]))
    opener = Opener(key, max_record_bytes=64)
    assert opener.open(first[:5]) == b"" and opener.open(first[5:] + second) == b"onetwo!"
    with pytest.raises(SealError, match="replayed"):
        opener.open(first)
    with pytest.raises(SealError, match="replayed"):
        Opener(key, 64).open(second)  # record 1 where 0 was due
    altered = bytearray(first)
    altered[-1] ^= 0x80
    with pytest.raises(SealError, match="authentication"):
        Opener(key, 64).open(bytes(altered))
    with pytest.raises(SealError, match="authentication"):
        Opener(bytes(32), 64).open(first)  # another connection's keys
    with pytest.raises(LimitExceeded, match="sealed record is"):
        Opener(key, 64).open(Sealer(key, lambda _: None).seal([b"x" * 65])[0])


def _sides(**kwargs) -> tuple[Handshake, Handshake]:
    common = dict(version=1, swarm_key=None, limits={}, app={}, encrypt=True)
    return (
        Handshake(initiator=True, identity=Identity.from_seed(b"a"), **common),
        Handshake(initiator=False, identity=Identity.from_seed(b"b"), **common),
    )


def test_both_sides_derive_matching_direction_keys():
    alice, bob = _sides()
    alice_proof, bob_proof = alice.receive_hello(bob.hello_bytes()), bob.receive_hello(alice.hello_bytes())
    a, b = alice.receive_proof(bob_proof), bob.receive_proof(alice_proof)
    assert a.send_key == b.recv_key and a.recv_key == b.send_key and a.send_key != a.recv_key


def test_a_key_exchange_swapped_in_the_middle_breaks_the_signature():
    alice, bob = _sides()
    mallory, _ = _sides()
    body = msgpack.unpackb(alice.hello_bytes())
    body["kx"] = msgpack.unpackb(mallory.hello_bytes())["kx"]
    forged = msgpack.packb(body, use_bin_type=True)
    bob_proof = bob.receive_hello(forged)
    alice_proof = alice.receive_hello(bob.hello_bytes())
    with pytest.raises(HandshakeError, match="signature"):
        bob.receive_proof(alice_proof)


async def test_sealed_frames_in_the_same_segment_as_the_welcome_are_opened():
    """A server may send sealed frames right behind its welcome; they can arrive in one read with it.
    A hand-driven responder writes the welcome and a sealed PING in one send: the client must
    answer with a sealed PONG (not parse the record as a plain frame)."""
    from transport.connection import HELLO_LIMITS, Connection
    from transport.limits import Limits
    from transport.wire import VERSION, FrameDecoder, Kind, encode_frame

    answered: asyncio.Future = asyncio.get_running_loop().create_future()

    async def read(reader: asyncio.StreamReader) -> bytes:
        data = await reader.read(65536)
        if not data:
            raise ConnectionError("the client hung up")
        return data

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Kind:
        hs = Handshake(initiator=False, version=VERSION, identity=Identity.from_seed(b"r"), swarm_key=None,
                       limits=Limits().as_dict(), app={}, encrypt=True)
        decoder = FrameDecoder(HELLO_LIMITS)

        async def next_frame():
            while (frame := decoder.next_frame()) is None:
                decoder.feed(await read(reader))
            return frame

        writer.writelines(encode_frame(Kind.HELLO, {"hello": hs.hello_bytes()}))
        proof = hs.receive_hello((await next_frame()).header["hello"])
        writer.writelines(encode_frame(Kind.HELLO, {"proof": proof}))
        peer = hs.receive_proof((await next_frame()).header["proof"])
        sealed_ping = Sealer(peer.send_key, lambda _: None).seal(encode_frame(Kind.PING, {}))
        writer.write(b"".join(bytes(p) for p in encode_frame(Kind.HELLO, {"welcome": True})) + b"".join(sealed_ping))
        opener, plain = Opener(peer.recv_key, Limits().max_frame_bytes), FrameDecoder(Limits())
        while (frame := plain.next_frame()) is None:
            plain.feed(opener.open(await read(reader)))
        return frame.kind

    async def responder(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            answered.set_result(await respond(reader, writer))
        except Exception as exc:
            answered.set_exception(exc)
        finally:
            writer.close()

    server = await asyncio.start_server(responder, "127.0.0.1", 0)
    try:
        conn = await Connection.open(server.sockets[0].getsockname()[:2], RpcConfig(encrypt=True))
        assert await asyncio.wait_for(answered, 5) is Kind.PONG
        conn.abort(ConnectionLost("test over"))
        await conn.wait_closed()
    finally:
        server.close()
        await server.wait_closed()
