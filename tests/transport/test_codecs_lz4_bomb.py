"""The lz4 bomb (issue 13, hole 4): 1024 tensors of ~4 KiB lz4 each announcing 1 MiB (4.2 MB on the
wire) took a daemon from 0.3 to 2.4 GB. Each tensor was within the per-tensor bound; the message as a
whole was not bounded, nor was the expansion ratio. Both are now checked before anything inflates."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import lz4.block
import pytest
import torch

from transport.codecs import check_message_budget, decode_tensor, encode_tensor
from transport.payload import decode_all as _decode_all
from transport.errors import ConnectionLost, LimitExceeded
from transport.identity import Identity
from transport.limits import MiB, Limits
from transport.rpc import Message, Pool, Router, RpcConfig, RpcServer

torch.set_num_threads(1)

ZEROS = lz4.block.compress(bytes(MiB), store_size=False)  # ~4 KiB that inflates to 1 MiB


def bomb(tensors: int = 1024) -> tuple[list[dict], list[bytes]]:
    meta = {"dtype": "float32", "shape": [MiB // 4], "codec": "lz4", "raw": MiB}
    return [dict(meta) for _ in range(tensors)], [ZEROS] * tensors


#: Each refusal is measured in a process of its own: tracemalloc counts every thread's allocations,
#: and threads that earlier tests of a session leave behind allocate tens of MB while it runs.
REFUSAL_PEAK = """
import sys, tracemalloc
import lz4.block
import transport.codecs  # decode_all imports it on first use: torch's import is not the refusal's cost
from transport.errors import LimitExceeded
from transport.limits import MiB, Limits
from transport.payload import decode_all
ratio, budget = int(sys.argv[1]), int(sys.argv[2])
meta = {"dtype": "float32", "shape": [MiB // 4], "codec": "lz4", "raw": MiB}
metas, buffers = [dict(meta) for _ in range(1024)], [lz4.block.compress(bytes(MiB), store_size=False)] * 1024
limits = Limits(max_lz4_ratio=ratio, max_decoded_message_bytes=budget)
tracemalloc.start()
try:
    decode_all(metas, buffers, limits)
except LimitExceeded as exc:
    print(tracemalloc.get_traced_memory()[1], exc)
"""


def _refusal_peak(ratio: int, budget: int) -> tuple[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", REFUSAL_PEAK, str(ratio), str(budget)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout, done.stderr
    peak, message = done.stdout.split(" ", 1)
    return int(peak), message


@pytest.mark.slow
def test_lz4_bomb_message_is_refused_before_any_decompression():
    metas, buffers = bomb()
    assert sum(len(b) for b in buffers) < 4.5e6
    limits = Limits()
    peak, message = _refusal_peak(limits.max_lz4_ratio, limits.max_decoded_message_bytes)
    assert "lz4 expansion" in message
    assert peak < 256 * 1024, f"{peak} bytes allocated while refusing the bomb"


@pytest.mark.slow
def test_lz4_bomb_within_the_ratio_still_meets_the_message_budget():
    """With the ratio check out of the way (a permissive receiver), the sum still stops it: 1024
    tensors of 1 MiB each are 1 GiB; a budget of 64 MiB refuses it before the first inflates."""
    peak, message = _refusal_peak(1024, 64 * MiB)
    assert "decoded bytes of one message" in message
    assert peak < 256 * 1024


def test_one_lz4_tensor_past_the_ratio_is_refused_by_decode_tensor_too():
    meta, buffers = bomb(1)
    with pytest.raises(LimitExceeded, match="lz4 expansion"):
        decode_tensor(meta[0], buffers)
    assert decode_tensor(meta[0], buffers, Limits(max_lz4_ratio=256)).abs().sum() == 0


def test_honest_messages_fit_the_budget():
    tensors = [torch.randn(4096), torch.relu(torch.randn(64, 64)), torch.arange(100)]
    encoded = [encode_tensor(t, "fp16+lz4") for t in tensors]
    metas = [m for m, _ in encoded]
    buffers = [b for _, bufs in encoded for b in bufs]
    check_message_budget(metas, buffers)
    decoded = _decode_all(metas, buffers, Limits())
    assert [d.shape for d in decoded] == [t.shape for t in tensors]


def test_a_tensor_that_compresses_past_the_ratio_is_sent_raw_and_still_arrives():
    """Zeros compress ~250x: a sender keeps to the ratio by sending them uncompressed."""
    zeros = torch.zeros(1 << 18)
    meta, buffers = encode_tensor(zeros, "fp16+lz4")
    assert meta["codec"] == "fp16"
    assert torch.equal(_decode_all([meta], buffers, Limits())[0], zeros)
    sparse = torch.relu(torch.randn(1 << 16)) * (torch.rand(1 << 16) < 0.2)
    meta, buffers = encode_tensor(sparse, "fp16+lz4")
    assert meta["codec"] == "fp16+lz4"  # compressible within the ratio: still compressed


async def test_lz4_bomb_over_a_connection_closes_it_and_the_server_goes_on(monkeypatch):
    """A real TCP connection sends the bomb as a request: the server refuses it (the connection
    closes) without inflating, and answers the next client."""
    import transport.payload as payload

    router = Router()

    async def echo(req):
        return Message({"n": len(req.tensors)})

    router.unary("echo", echo)
    server = await RpcServer.serve_tcp(router, config=RpcConfig(identity=Identity.generate()))
    address = f"127.0.0.1:{server.port}"
    attacker, honest = Pool(RpcConfig(identity=Identity.generate())), Pool(RpcConfig(identity=Identity.generate()))
    try:
        monkeypatch.setattr(payload, "encode_all", lambda tensors, codec: bomb())
        with pytest.raises((ConnectionLost, asyncio.TimeoutError)):
            await attacker.call(address, "echo", Message({}, [torch.zeros(1)]), timeout=20)
        monkeypatch.undo()
        reply = await honest.call(address, "echo", Message({}, [torch.zeros(4)]), timeout=20)
        assert reply.meta == {"n": 1}
    finally:
        await attacker.close()
        await honest.close()
        await server.close()
