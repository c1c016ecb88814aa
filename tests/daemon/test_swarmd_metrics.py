"""The metrics endpoint serves Prometheus text; instrumented routers label only registered methods;
a real daemon's security signals (rate limiting, refused DHT records, failed hellos) move on attack."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request

import pytest
from waiting import wait_for
from prometheus_client.parser import text_string_to_metric_families

from swarmd.config import Address
from swarmd.dht import protocol as dht_protocol
from swarmd.dht.errors import REJECTION_REASONS
from swarmd.values import VALUE_REFUSALS
from swarmd.dht.records import Record, dht_key, sign_record, signing_payload
from swarmd.metrics import Metrics, InstrumentedRouter, serve
from transport.errors import HANDSHAKE_FAILURE_REASONS, HandshakeError, RemoteError, RpcError
from transport.identity import Identity, peer_id_of
from transport.message import Message, RemoteInfo, Request
from transport.rpc import Pool, Router, RpcConfig, RpcServer
from transport.traffic import Traffic


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


async def test_instrumented_router_counts_served_bytes_by_method_and_direction() -> None:
    """Each method's requests in and replies out, msgpack header plus tensor bytes: what the scale
    bench reads to say which method spends a daemon's control traffic."""
    import msgpack
    import torch

    metrics = Metrics("1")
    router = InstrumentedRouter(metrics, "peer")

    async def echo(req: Request) -> Message:
        return Message({"contacts": [b"x" * 32] * 3}, [torch.zeros(10, dtype=torch.uint8)])

    async def streamed(req: Request):
        for i in range(3):
            yield Message({"i": i})

    router.unary("dht.find_node", echo)
    router.stream("s", streamed)
    ask = Request("dht.find_node", {"target": b"t" * 32}, [torch.zeros(4, dtype=torch.float32)], None,
                  RemoteInfo(None, None, {}, None))
    await router.lookup("dht.find_node")[1](ask)
    await router.lookup("dht.find_node")[1](ask)
    assert [m async for m in router.lookup("s")[1](request("s"))]
    value = metrics.registry.get_sample_value
    req_bytes = len(msgpack.packb({"target": b"t" * 32})) + 16
    reply_bytes = len(msgpack.packb({"contacts": [b"x" * 32] * 3})) + 10
    labels = {"service": "peer", "method": "dht.find_node"}
    assert value("swarmd_rpc_served_bytes_total", {**labels, "direction": "in"}) == 2 * req_bytes
    assert value("swarmd_rpc_served_bytes_total", {**labels, "direction": "out"}) == 2 * reply_bytes
    assert value("swarmd_rpc_served_bytes_total", {"service": "peer", "method": "s", "direction": "out"}) == \
        sum(len(msgpack.packb({"i": i})) for i in range(3))


@pytest.mark.parametrize("case", ["swarm key", "encryption", "admission"])
async def test_failed_hellos_are_counted_by_reason_on_both_sides(case: str) -> None:
    """1. A server whose Traffic is a Metrics object's, and a client with its own Traffic, over real
          TCP, disagree: on the swarm key, on encryption, or the server's admission refuses the client.
       2. The call fails in the hello; the server's swarmd_transport_handshake_failures_total grows
          by one under the case's reason (swarm_key, incompatible, admission) and no other; the
          client counts the same reason, or refused_by_peer where only the server could tell."""
    server_side, client_side = {
        "swarm key": ({"swarm_key": b"k" * 32}, {"swarm_key": b"j" * 32}),
        "encryption": ({"encrypt": True}, {}),
        "admission": ({}, {}),
    }[case]
    ours, theirs = {"swarm key": ("swarm_key", "swarm_key"), "encryption": ("incompatible", "incompatible"),
                    "admission": ("admission", "refused_by_peer")}[case]
    metrics, client_traffic = Metrics("1"), Traffic()
    router = Router()

    async def ping(req: Request) -> Message:
        return Message({})

    router.unary("ping", ping)
    admit = (lambda remote: "not on the list") if case == "admission" else None
    server = await RpcServer.serve_tcp(router, config=RpcConfig(identity=Identity.generate(), traffic=metrics.traffic,
                                                                **server_side), admit=admit)
    pool = Pool(RpcConfig(identity=Identity.generate(), traffic=client_traffic, **client_side))
    try:
        with pytest.raises(HandshakeError):
            await pool.call(("127.0.0.1", server.port), "ping", Message({}), timeout=10)
        value = metrics.registry.get_sample_value
        async with asyncio.timeout(10):
            while not value("swarmd_transport_handshake_failures_total", {"reason": ours}):
                await asyncio.sleep(0.05)
        counted = {r: value("swarmd_transport_handshake_failures_total", {"reason": r})
                   for r in HANDSHAKE_FAILURE_REASONS}
        assert counted == {r: float(r == ours) for r in HANDSHAKE_FAILURE_REASONS}
        assert client_traffic.hello_failures == {r: int(r == theirs) for r in HANDSHAKE_FAILURE_REASONS}
    finally:
        await pool.close()
        await server.close()


# ------------------------------------------------------------------------------ real daemons

FAST = {"SWARMD_PEERS_PING_INTERVAL_S": "0.5", "SWARMD_PEERS_DISCOVERY_INTERVAL_S": "1",
        "SWARMD_NETWORK_BOOTSTRAP_RETRY_INITIAL_S": "0.3", "SWARMD_NETWORK_BOOTSTRAP_RETRY_MAX_S": "1"}


def scrape(daemon) -> dict[tuple[str, tuple], float]:
    """Every sample of a daemon's /metrics as {(name, sorted labels): value}."""
    status, body = fetch(f"http://{daemon.client.status()['metrics']}/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]



@pytest.mark.slow
def test_transport_bytes_and_dht_lookups_move_on_a_real_daemon(spawn, swarmctl) -> None:
    """1. Start A and B (--bootstrap A), both with --metrics on a port of their own.
       2. Once they see each other, A's transport byte counters are above zero on both directions,
          and A has counted FIND_NODE lookups that someone answered (its discovery lookups).
       3. `swarmctl dht get` on A runs one FIND_VALUE lookup: its answered count goes up by at
          least one, and the control API's get counter by exactly one.
       4. The byte counters keep growing with traffic (the get crossed the wire), and every label
          value is from the closed sets."""
    a, b = spawn.together(["a", "b"], "--metrics", "127.0.0.1:0", env=FAST)
    wait_for(lambda: {p["peer_id"] for p in a.client.peers() if p["alive"]} == {a.status["peer_id"], b.status["peer_id"]},
             60, "A to see B alive")

    def answered_find_node():
        samples = scrape(a)
        return samples if sample(samples, "swarmd_dht_lookups_total", kind="find_node", outcome="answered") else None

    before = wait_for(answered_find_node, 60, "A to count an answered find_node lookup")
    assert sample(before, "swarmd_transport_sent_bytes_total") > 0
    assert sample(before, "swarmd_transport_received_bytes_total") > 0
    assert sample(before, "swarmd_dht_lookup_rpcs_total", kind="find_node") >= 1

    result = swarmctl("--socket", str(a.socket), "--json", "dht", "get", "jobs")
    assert result.returncode == 0, result.stderr
    after = scrape(a)
    assert (sample(after, "swarmd_dht_lookups_total", kind="find_value", outcome="answered")
            >= sample(before, "swarmd_dht_lookups_total", kind="find_value", outcome="answered") + 1)
    assert sample(after, "swarmd_dht_lookup_rpcs_total", kind="find_value") >= 1
    gets_ok = ("swarmd_dht_gets_total", (("outcome", "ok"),))  # a labelled series appears at its first use
    assert after[gets_ok] == before.get(gets_ok, 0.0) + 1
    assert sample(after, "swarmd_transport_sent_bytes_total") > sample(before, "swarmd_transport_sent_bytes_total")
    assert sample(after, "swarmd_transport_received_bytes_total") > sample(before, "swarmd_transport_received_bytes_total")
    kinds = {dict(labels).get("kind") for name, labels in after if name.startswith("swarmd_dht_lookup")}
    outcomes = {dict(labels).get("outcome") for name, labels in after if name == "swarmd_dht_lookups_total"}
    assert kinds == {"find_node", "find_value"}
    assert outcomes == {"answered", "unanswered", "cancelled", "error"}

    b_samples = scrape(b)  # B's side of the same traffic: its bootstrap lookups went through A
    assert sample(b_samples, "swarmd_transport_received_bytes_total") > 0
    assert sample(b_samples, "swarmd_dht_lookups_total", kind="find_node", outcome="answered") >= 1


#: A's hello deadline (network.handshake_timeout_s), short so the slow-loris part ends soon.
HANDSHAKE_DEADLINE_S = 4.0
#: The flood: this many tasks of one peer ping A for this long.
FLOOD_TASKS, FLOOD_S = 8, 2.0


def deltas(before: dict, after: dict, name: str, reasons: tuple[str, ...]) -> dict[str, float]:
    """Per reason, how much `name{reason}` grew; every reason of the closed set must be a series."""
    return {r: sample(after, name, reason=r) - sample(before, name, reason=r) for r in reasons}


async def flood(address: str) -> int:
    """A peer of its own identity pings `address` from FLOOD_TASKS tasks for FLOOD_S; the number of
    `rate_limited` answers it got (any other refusal fails the test)."""
    pool = Pool(RpcConfig(identity=Identity.generate()))
    limited = 0
    stop = asyncio.Event()

    async def pinger() -> None:
        nonlocal limited
        while not stop.is_set():
            try:
                await pool.call(address, dht_protocol.PING, Message({}), timeout=10)
            except RemoteError as exc:
                assert exc.code == "rate_limited", exc
                limited += 1

    try:
        async with asyncio.TaskGroup() as tg:
            for _ in range(FLOOD_TASKS):
                tg.create_task(pinger())
            await asyncio.sleep(FLOOD_S)
            stop.set()
    finally:
        await pool.close()
    return limited


async def store_forged_records(address: str) -> list[str]:
    """One STORE of four records, each refused for another reason; the results `address` answers."""
    me, victim = Identity.generate(), Identity.generate()
    key, value, later = dht_key("metrics-test", b"signals"), b"forged", time.time() + 600
    payload = signing_payload(key, victim.peer_id, value, later)
    forged = [
        sign_record(me, key, victim.peer_id, value, later),  # our signature on another's subkey
        Record(key, victim.peer_id, value, later, me.sign(payload), victim.public_key),  # their key, our signature
        Record(key, me.peer_id, value, later),  # no signature at all
        sign_record(me, key, me.peer_id, value, time.time() - 1),  # already expired
    ]
    pool = Pool(RpcConfig(identity=me))
    try:
        reply = await pool.call(address, dht_protocol.STORE, Message(dht_protocol.store_request(key, forged)),
                                timeout=10)
    finally:
        await pool.close()
    return reply.meta["results"]


async def spoof_hello(address: str) -> None:
    """A peer claims another key's id: its call to `address` must fail in the hello."""
    mine, victim = Identity.generate(), Identity.generate()
    pool = Pool(RpcConfig(identity=Identity(mine.private_key, victim.public_key, peer_id_of(victim.public_key))))
    try:
        with pytest.raises(HandshakeError):
            await pool.call(address, dht_protocol.PING, Message({}), timeout=10)
    finally:
        await pool.close()


async def slowloris(host: str, port: int) -> None:
    """Three TCP connections that never send a hello, held until the daemon closes each."""
    silent = []
    try:
        for _ in range(3):
            silent.append(await asyncio.open_connection(host, port))
        # A closes each: the third at once, the others at its hello deadline (after its
        # own hello and a "refused" frame, which we read past).
        async with asyncio.timeout(HANDSHAKE_DEADLINE_S * 3):
            for reader, _ in silent:
                while await reader.read(65536):
                    pass
    finally:
        for _, writer in silent:
            writer.close()


@pytest.mark.slow
def test_security_signals_count_each_attack_on_a_real_daemon(spawn) -> None:
    """1. Start A with 20 calls/s per peer (burst 20) and at most 2 connections in their hello per
          source host. Every reason of both closed sets is a series from the first scrape on, and
          no series carries a peer id.
       2. Flood: a peer of its own identity pings A from 8 tasks for 2 s; swarmd_rpc_rate_limited_total
          grows by exactly the number of `rate_limited` answers it got (A has no other peers).
       3. Bad DHT store: another peer stores four records in one call, each refused for another
          reason (wrong_owner, bad_signature, unsigned, expired); each of those reasons grows by
          exactly one, no other.
       4. Spoofed id: a peer claims another key's id; its call fails in the hello and A counts one
          spoofed_id failure.
       5. Slow-loris: three TCP connections that never send a hello: the third is dropped at once
          (unproven_limit), the other two at the hello deadline (deadline); after that, the
          handshake failures are exactly {spoofed_id: 1, unproven_limit: 1, deadline: 2}."""
    a = spawn("a", "--metrics", "127.0.0.1:0", env={
        **FAST, "SWARMD_NETWORK_RPC_RATE_LIMIT_PER_S": "20", "SWARMD_NETWORK_RPC_RATE_LIMIT_BURST": "20",
        "SWARMD_NETWORK_MAX_UNPROVEN_PER_SOURCE": "2", "SWARMD_NETWORK_HANDSHAKE_TIMEOUT_S": str(HANDSHAKE_DEADLINE_S)})
    host, port = a.address.rsplit(":", 1)
    start = scrape(a)
    hellos, records = "swarmd_transport_handshake_failures_total", "swarmd_dht_refused_records_total"
    assert {dict(labels)["reason"] for name, labels in start if name == hellos} == set(HANDSHAKE_FAILURE_REASONS)
    assert {dict(labels)["reason"] for name, labels in start if name == records} == {*REJECTION_REASONS, *VALUE_REFUSALS}
    assert not any("peer" in key for _, labels in start for key, _ in labels)

    limited = asyncio.run(flood(a.address))
    flooded = scrape(a)
    assert limited > 0
    assert sample(flooded, "swarmd_rpc_rate_limited_total") - sample(start, "swarmd_rpc_rate_limited_total") == limited

    assert asyncio.run(store_forged_records(a.address)) == ["wrong_owner", "bad_signature", "unsigned", "expired"]
    stored = scrape(a)
    expected = {r: float(r in ("wrong_owner", "bad_signature", "unsigned", "expired")) for r in REJECTION_REASONS}
    assert deltas(flooded, stored, records, REJECTION_REASONS) == expected

    asyncio.run(spoof_hello(a.address))
    wait_for(lambda: deltas(start, scrape(a), hellos, ("spoofed_id",))["spoofed_id"], 30, "A to count the spoofed hello")

    asyncio.run(slowloris(host, int(port)))
    expected = {r: 0.0 for r in HANDSHAKE_FAILURE_REASONS} | {"spoofed_id": 1.0, "unproven_limit": 1.0, "deadline": 2.0}
    wait_for(lambda: deltas(start, scrape(a), hellos, ("deadline",))["deadline"] >= 2, 30,
             "A to count the silent connections' deadlines")
    assert deltas(start, scrape(a), hellos, HANDSHAKE_FAILURE_REASONS) == expected
