"""Key stuffing: throw-away identities must not push an honest announcement out of a key, and a key
holding more than a reply can carry must still be readable (issue 13, hole 3).

The attack, as found on ae25aed: 512 fresh identities sign 24 h records under an honest stage key
and store them on the key's replicas, 64 per RPC (8 RPCs a replica). Storage evicted the entry
expiring first (the honest 90 s announcement), then refused its refreshes with `key_full`.
"""

import asyncio
import time

import pytest
from dhtsockets import start_nodes, stop_all

from swarmd.clock import VirtualClock, run_virtual
from swarmd.dht import DHTConfig, DHTNode, dht_key
from swarmd.dht import protocol as P
from swarmd.dht.records import key_id, sign_record
from swarmd.dht.rpc_network import RpcNetwork
from swarmd.dht.simulation import build_swarm
from transport.identity import Identity

SYBILS = 512
DAY = 24 * 3600.0


def sybil_records(key: bytes, now: float, count: int = SYBILS, tag: str = "sybil", value: bytes = b"fake") -> list:
    ids = (Identity.from_seed(f"{tag}-{i}".encode()) for i in range(count))
    return [sign_record(ident, key, ident.peer_id, value, now + DAY) for ident in ids]


async def stuff(call, addresses: list[str], key: bytes, records: list, per_rpc: int = 64) -> dict[str, int]:
    """Store `records` on every address, `per_rpc` a call; returns the replies' result counts."""
    results: dict[str, int] = {}
    for address in addresses:
        for start in range(0, len(records), per_rpc):
            batch = records[start: start + per_rpc]
            reply = await call(address, P.STORE, P.store_request(key, batch), 5.0)
            for result in P.parse_store_reply(reply.meta, len(batch)):
                results[result] = results.get(result, 0) + 1
    return results


def closest(nodes: list[DHTNode], key: bytes, k: int) -> list[DHTNode]:
    kid = int.from_bytes(key_id(key), "big")
    return sorted(nodes, key=lambda n: int.from_bytes(n.peer_id, "big") ^ kid)[:k]


@pytest.mark.parametrize("networks", [1, 8])
def test_512_throwaway_identities_do_not_evict_an_honest_stage_peer(networks):
    """1. 40 nodes; an honest peer announces itself under a stage key (TTL 90 s, refresh 30 s);
    2. after one refresh, an attacker stores 512 signed 24 h records under that key on every one of
    its 20 replicas, from 1 network or spread over 8 (/24s, 64 identities each: the key's 512 slots
    fill); 3. for five refresh periods the honest peer stays visible to a reader on every get;
    4. the attacker's surplus was refused by source quota or key_full, never the honest refresh."""

    async def main(clock):
        cfg = DHTConfig()
        swarm = await build_swarm(40, clock, cfg, seed=13)
        honest, reader = swarm.nodes[7], swarm.nodes[30]
        key = dht_key("job", "victim", "stage", 1)
        honest.announce(key, lambda: b"honest-stage-peer")
        await asyncio.sleep(cfg.refresh_interval + 1)
        assert honest.peer_id in await reader.get(key, latest=True)

        records = sybil_records(key, clock.time())
        replicas = [n.address for n in closest(swarm.nodes, key, cfg.replication)]
        results: dict[str, int] = {}
        share = SYBILS // networks
        for net in range(networks):
            ident = Identity.from_seed(f"mallory-{net}".encode())
            mallory = swarm.fabric.endpoint(ident, f"66.6.{net}.1:7000")
            part = await stuff(mallory.call, replicas, key, records[net * share: (net + 1) * share])
            for reason, count in part.items():
                results[reason] = results.get(reason, 0) + count
        print(f"\n{networks} network(s): store results {results}")
        for _ in range(5):
            await asyncio.sleep(cfg.refresh_interval)
            got = await reader.get(key, latest=True)
            assert got.get(honest.peer_id) is not None and got[honest.peer_id].value == b"honest-stage-peer"
        refused = sum(n for reason, n in results.items() if reason != "ok")
        assert refused > 0 and set(results) <= {"ok", "source_quota", "key_full"}
        await swarm.stop()

    clock = VirtualClock()
    run_virtual(main(clock), clock)


def test_stuffed_records_are_forgotten_within_the_announcement_cap():
    """Records signed for a day under an announcement key are held max_announce_ttl at most: the
    attacker must keep paying every few minutes, not once a day."""

    async def main(clock):
        cfg = DHTConfig()
        swarm = await build_swarm(24, clock, cfg, seed=14)
        key = dht_key("job", "victim", "stage", 0)
        records = sybil_records(key, clock.time(), count=16)
        ident = Identity.from_seed(b"mallory")
        mallory = swarm.fabric.endpoint(ident, "66.6.6.1:7000")
        replicas = closest(swarm.nodes, key, cfg.replication)
        assert (await stuff(mallory.call, [n.address for n in replicas], key, records)) == {"ok": 16 * len(replicas)}
        await asyncio.sleep(cfg.max_announce_ttl + cfg.prune_interval + 1)
        assert all(n.storage.get(key, clock.time()) == [] for n in replicas)
        assert await swarm.nodes[0].get(key, latest=True) == {}
        await swarm.stop()

    clock = VirtualClock()
    run_virtual(main(clock), clock)


CFG = DHTConfig(rpc_timeout=2.0)


async def test_512_throwaway_identities_over_real_sockets():
    """Five nodes on loopback; an honest node announces; an attacker process-alike (its own
    RpcNetwork and identity) stores 512 day-long records on every node (40 RPCs); the honest entry
    is still read by every node, and each node kept at most max_subkeys_per_source of the junk."""
    nodes = await start_nodes(5, "stuff", CFG)
    attacker = Identity.from_seed(b"mallory-tcp")
    network = await RpcNetwork.listen(attacker, config=CFG)
    try:
        key = dht_key("job", "tcp-victim", "stage", 0)
        honest = nodes[2]
        assert await honest.store(key, honest.peer_id, b"honest", time.time() + 90) >= 4
        results = await stuff(network.call, [n.address for n in nodes], key, sybil_records(key, time.time()))
        print(f"\nstore results over TCP: {results}")
        assert results.get("source_quota", 0) >= 5 * (SYBILS - CFG.max_subkeys_per_source)
        for node in nodes:  # (+1: the honest node holds its own record as a local store)
            assert len(node.storage.get(key, time.time())) <= CFG.max_subkeys_per_source + 1
            got = await node.get(key, latest=True)
            assert got[honest.peer_id].value == b"honest"
    finally:
        await network.stop()
        await stop_all(nodes)


async def test_a_key_over_64_KiB_still_answers_find_value_within_the_wire_limit():
    """64 writers of 2 KiB values under one key (128 KiB of records, twice the transport's header
    limit): find_value answers a sample that fits (no "internal" failure), every node's get works,
    and the sample holds the honest writer who stored first."""
    nodes = await start_nodes(3, "big", CFG)
    attacker = Identity.from_seed(b"mallory-big")
    network = await RpcNetwork.listen(attacker, config=CFG)
    try:
        key = dht_key("job", "big", "stage", 0)
        honest = nodes[1]
        assert await honest.store(key, honest.peer_id, b"honest", time.time() + 90) == 3
        junk = sybil_records(key, time.time(), count=63, tag="big", value=b"x" * 2048)
        assert (await stuff(network.call, [n.address for n in nodes], key, junk, per_rpc=16)) == {"ok": 3 * 63}
        reply = await network.call(nodes[0].address, P.FIND_VALUE, P.find_value_request(key), 5.0)
        records, _ = P.parse_find_value_reply(key, reply.meta, CFG)
        assert 0 < len(records) < 64
        assert sum(P.record_wire_bytes(r) for r in records) <= CFG.max_message_record_bytes
        assert honest.peer_id in {r.subkey for r in records}
        for node in nodes:
            assert honest.peer_id in await node.get(key, latest=True)
    finally:
        await network.stop()
        await stop_all(nodes)
