"""DHT nodes over real TCP on 127.0.0.1 through transport.rpc: ids from the handshake."""

import time

import dhtsockets
import pytest
from dhtsockets import stop_all
from waiting import until

from swarmd.dht import DHTConfig, DHTNode, PeerUnreachable, RemoteFailure, dht_key
from swarmd.dht import protocol as P
from swarmd.dht.records import sign_record
from swarmd.dht.rpc_network import RpcNetwork
from transport.identity import Identity

CFG = DHTConfig(rpc_timeout=1.0)


def start_nodes(n: int, seed: str = "tcp"):
    return dhtsockets.start_nodes(n, seed, CFG)


async def test_store_and_get_across_real_sockets_with_one_node_killed():
    """1. eight nodes on loopback, each bootstraps from node 0; 2. node 3 stores, every other node
    reads it (ids in routing tables are the handshake-proven ones); 3. node 5 is stopped (its
    socket closes); 4. a new record stored and read by everyone left, within a few seconds."""
    nodes = await start_nodes(8)
    try:
        ids = {n.peer_id for n in nodes}
        for node in nodes:
            assert {c.peer_id for c in node.contacts()} <= ids - {node.peer_id}
            assert len(node.contacts()) >= 3
        key = dht_key("job", "tcp", "stage", 0)
        writer = nodes[3]
        assert await writer.store(key, writer.peer_id, b"hello", time.time() + 60) >= 7
        for reader in nodes:
            got = await reader.get(key, latest=True)
            assert got[writer.peer_id].value == b"hello"

        await nodes[5].stop()
        alive = [n for i, n in enumerate(nodes) if i != 5]
        key2 = dht_key("job", "tcp", "stage", 1)
        started = time.monotonic()
        assert await alive[1].store(key2, alive[1].peer_id, b"after", time.time() + 60) >= 6
        for reader in alive:
            assert (await reader.get(key2, latest=True))[alive[1].peer_id].value == b"after"
        assert time.monotonic() - started < 5.0
    finally:
        await stop_all(nodes)


async def test_announcements_and_many_writers_over_tcp():
    nodes = await start_nodes(6, "tcp-ann")
    try:
        key = dht_key("job", "tcp", "stage", 2)
        for i, node in enumerate(nodes):
            node.announce(key, lambda i=i: b"peer %d" % i)
        async def all_six():
            got = await nodes[0].get(key, latest=True)
            return got if len(got) == 6 else None

        got = await until(all_six, 5.0, "six announcements", interval=0.05)
        assert {r.subkey for r in got.values()} == {n.peer_id for n in nodes}
    finally:
        await stop_all(nodes)


async def test_garbage_payloads_over_tcp_get_bad_request_and_forged_records_are_refused():
    nodes = await start_nodes(2, "tcp-bad")
    mallory = Identity.from_seed(b"tcp-mallory")
    net = await RpcNetwork.listen(mallory, config=CFG)
    try:
        target = nodes[0].address
        for method, payload in [(P.FIND_NODE, {"target": b"short"}), (P.STORE, {"key": 5}),
                                (P.FIND_VALUE, {}), ("dht.find_node", {"target": "str"})]:
            with pytest.raises(RemoteFailure) as e:
                await net.call(target, method, payload, timeout=2.0)
            assert e.value.code == "bad_request"
        key = dht_key("job", "tcp", "victim")
        victim = nodes[1].identity
        forged = sign_record(mallory, key, victim.peer_id, b"evil", time.time() + 60)
        reply = await net.call(target, P.STORE, P.store_request(key, [forged]), timeout=2.0)
        assert P.parse_store_reply(reply.meta, 1) == ["wrong_owner"]
        assert reply.peer_id == nodes[0].peer_id
        assert await nodes[1].get(key, latest=True) == {}
    finally:
        await net.stop()
        await stop_all(nodes)


async def test_stopped_network_refuses_fast():
    nodes = await start_nodes(2, "tcp-stop")
    address = nodes[1].address
    await nodes[1].stop()
    try:
        started = time.monotonic()
        with pytest.raises(PeerUnreachable):
            await nodes[0].network.call(address, P.PING, {}, timeout=2.0)
        assert time.monotonic() - started < 1.0
    finally:
        await stop_all(nodes[:1])


async def test_shared_router_and_pool_with_an_unspecified_announce_host():
    """The daemon's shape: the DHT registers on a Router it does not own and calls through a
    shared Pool; it announces 0.0.0.0:port, and peers record the host the connection came from."""
    from transport.rpc import Pool, Router, RpcConfig, RpcServer
    identity = Identity.from_seed(b"tcp-shared")
    router = Router()
    rpc = RpcConfig(identity=identity)
    server = await RpcServer.serve_tcp(router, "127.0.0.1", 0, config=rpc)
    pool = Pool(rpc)
    shared = DHTNode(identity, RpcNetwork(router, pool, f"0.0.0.0:{server.port}", CFG), CFG)
    await shared.start()
    (other,) = await start_nodes(1, "tcp-shared-peer")
    try:
        assert await shared.bootstrap([other.address]) == 1
        assert [(c.peer_id, c.address) for c in other.contacts()] == [(identity.peer_id, f"127.0.0.1:{server.port}")]
    finally:
        await shared.stop()
        await other.stop()
        await pool.close()
        await server.close()
