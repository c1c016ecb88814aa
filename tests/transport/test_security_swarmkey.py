"""Swarm key files: generated keys load back, loose permissions and bad formats are refused with a
clear reason, and two daemons holding the same file complete a hello while a third with its own
key is refused."""

from __future__ import annotations

import os

import pytest

from swarmd.swarmkey import SWARM_KEY_BYTES, SwarmKeyError, generate, load
from transport.errors import HandshakeError
from transport.rpc import Message, Pool, Request, Router, RpcConfig, RpcServer


def test_generated_key_loads_back_in_both_formats(tmp_path):
    hex_key = generate(tmp_path / "a.key")
    raw_key = generate(tmp_path / "b.key", hex_format=False)
    assert len(hex_key) == len(raw_key) == SWARM_KEY_BYTES and hex_key != raw_key
    assert (tmp_path / "a.key").read_text() == hex_key.hex() + "\n"
    assert load(tmp_path / "a.key") == hex_key and load(tmp_path / "b.key") == raw_key
    assert os.stat(tmp_path / "a.key").st_mode & 0o777 == 0o600


def test_existing_key_is_never_overwritten(tmp_path):
    key = generate(tmp_path / "k")
    with pytest.raises(SwarmKeyError, match="already exists"):
        generate(tmp_path / "k")
    assert load(tmp_path / "k") == key


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o666])
def test_group_or_world_accessible_key_is_refused(tmp_path, mode):
    path = tmp_path / "k"
    generate(path)
    os.chmod(path, mode)
    with pytest.raises(SwarmKeyError, match="chmod 600"):
        load(path)


@pytest.mark.parametrize("content", [b"", b"short", b"ab" * 31 + b"\n", b"zz" * 32, b"x" * 33])
def test_badly_formatted_key_is_refused(tmp_path, content):
    path = tmp_path / "k"
    path.write_bytes(content)
    os.chmod(path, 0o600)
    with pytest.raises(SwarmKeyError, match="32 raw bytes or 64 hex digits"):
        load(path)


def test_missing_file_and_symlink_are_refused(tmp_path):
    with pytest.raises(SwarmKeyError, match="keygen"):
        load(tmp_path / "absent")
    generate(tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(SwarmKeyError, match="cannot open"):
        load(tmp_path / "link")


async def test_peers_sharing_a_key_file_connect_and_others_are_refused(tmp_path):
    generate(tmp_path / "swarm.key")
    generate(tmp_path / "other.key")
    router = Router()

    async def echo(req: Request) -> Message:
        return Message(dict(req.meta))

    router.unary("echo", echo)
    srv = await RpcServer.serve_tcp(router, "127.0.0.1", 0, RpcConfig(swarm_key=load(tmp_path / "swarm.key")))
    member, outsider = Pool(RpcConfig(swarm_key=load(tmp_path / "swarm.key"))), Pool(
        RpcConfig(swarm_key=load(tmp_path / "other.key"))
    )
    try:
        assert (await member.call(srv.address, "echo", Message({"x": 1}), timeout=5)).meta == {"x": 1}
        with pytest.raises(HandshakeError, match="swarm key"):
            await outsider.call(srv.address, "echo", Message({"x": 1}), timeout=5)
    finally:
        await member.close()
        await outsider.close()
        await srv.close()
