"""The metrics endpoint serves Prometheus text; instrumented routers label only registered methods."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarmd.config import Address
from swarmd.metrics import Metrics, InstrumentedRouter, serve
from transport.errors import RpcError
from transport.message import Message, RemoteInfo, Request


def request(method: str) -> Request:
    return Request(method, {}, [], None, RemoteInfo(None, None, {}, None))


def fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_scrape_over_http() -> None:
    metrics = Metrics("9.9.9")
    metrics.peers_alive.set(3)
    server = await serve(metrics, Address("127.0.0.1", 0))
    port = server.sockets[0].getsockname()[1]
    try:
        status, body = await asyncio.to_thread(fetch, f"http://127.0.0.1:{port}/metrics")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(body)}
        assert all(name.startswith("swarmd_") for name in families)
        assert families["swarmd_build_info"].samples[0].labels == {"version": "9.9.9"}
        assert families["swarmd_peers_alive"].samples[0].value == 3
        status, _ = await asyncio.to_thread(fetch, f"http://127.0.0.1:{port}/other")
        assert status == 404
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"x" * 10000)  # a request head past the limit is dropped, the server lives on
        assert await reader.read() == b""
        writer.close()
        status, _ = await asyncio.to_thread(fetch, f"http://127.0.0.1:{port}/metrics")
        assert status == 200
    finally:
        server.close()
        await server.wait_closed()


async def test_instrumented_router_counts_outcomes_by_registered_name() -> None:
    metrics = Metrics("1")
    router = InstrumentedRouter(metrics, "control")

    async def ok(req: Request) -> Message:
        return Message({"ok": True})

    async def bad(req: Request) -> Message:
        raise RpcError("nope", "refused")

    async def streamed(req: Request):
        for i in range(3):
            yield Message({"i": i})

    router.unary("ok", ok)
    router.unary("bad", bad)
    router.stream("s", streamed)
    await router.lookup("ok")[1](request("ok"))
    with pytest.raises(RpcError):
        await router.lookup("bad")[1](request("bad"))
    assert [m.meta["i"] async for m in router.lookup("s")[1](request("s"))] == [0, 1, 2]
    assert router.lookup("made-up") is None
    value = metrics.registry.get_sample_value
    assert value("swarmd_rpc_requests_total", {"service": "control", "method": "ok", "outcome": "ok"}) == 1
    assert value("swarmd_rpc_requests_total", {"service": "control", "method": "bad", "outcome": "error"}) == 1
    assert value("swarmd_rpc_requests_total", {"service": "control", "method": "s", "outcome": "ok"}) == 1
    assert value("swarmd_rpc_duration_seconds_count", {"service": "control", "method": "ok"}) == 1
