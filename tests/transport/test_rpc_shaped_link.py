"""RPC between two network namespaces over a veth pair shaped by tc tbf (bench/netns.py), the
set-up the benchmark and the chaos tests build on. Needs root; skipped with the reason otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from netns_link import MARKS, REPO, netns

pytestmark = [*MARKS, pytest.mark.slow]

SERVER = r"""
import asyncio, sys
from transport.rpc import Message, Router, RpcServer

async def main(host):
    router = Router()

    async def size(req):
        return Message({"bytes": sum(t.numel() * t.element_size() for t in req.tensors)})

    router.unary("size", size)
    server = await RpcServer.serve_tcp(router, host, 0)
    print(server.port, flush=True)
    await asyncio.Event().wait()

asyncio.run(main(sys.argv[1]))
"""

CLIENT = r"""
import asyncio, sys, torch
from transport.rpc import Message, Pool

async def main(host, port):
    pool = Pool()
    try:
        reply = await pool.call((host, port), "size", Message({}, [torch.ones(1 << 20)], codec="none"), timeout=30)
        print(reply.meta["bytes"])
    finally:
        await pool.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def test_a_call_crosses_the_shaped_link_and_tbf_counts_its_bytes():
    env_path = {**os.environ, "PYTHONPATH": str(REPO)}
    with netns.shaped_link(rate_mbit=100) as link:
        server = link.popen("a", [sys.executable, "-c", SERVER, link.addr_a], stdout=subprocess.PIPE, text=True,
                            env=env_path, cwd=REPO)
        try:
            port = int(server.stdout.readline())
            done = subprocess.run(
                [*link.exec_prefix("b"), sys.executable, "-c", CLIENT, link.addr_a, str(port)],
                capture_output=True, text=True, env=env_path, cwd=REPO, timeout=120,
            )
            assert done.returncode == 0, done.stderr
            assert int(done.stdout) == 4 << 20
        finally:
            server.kill()
            server.wait()
            server.stdout.close()
        stats = link.qdisc_stats("b")
        assert "tbf" in stats and "rate 100Mbit" in stats
        assert int(stats.split("Sent ")[1].split(" bytes")[0]) > 4 << 20
        namespaces = (link.ns_a, link.ns_b)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces)
