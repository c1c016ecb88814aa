"""Addresses a stranger announces that the resolver cannot even encode (adversary's attack).

A host name with an empty or over-long label (`a..b`, 64 letters, `.`) passes a "host:port" shape
check, but `getaddrinfo` refuses it with `UnicodeError` (the idna codec), which is neither an
`OSError` nor a transport error. So one `dht.find_node` from a stranger claiming `addr = "a..b:1"`
put that contact in every honest node's routing table, and from then on every DHT store and get
of those nodes raised (an ExceptionGroup around the UnicodeError) instead of skipping an
unreachable contact: one RPC per node stopped the swarm's DHT. The same host in a stage
announcement passed the values edge and made the prober, hence `job.get` and the joining loop,
raise. A NUL in the host (ValueError) or a port past 65535 (OverflowError) did the same. Real
sockets on loopback, in this process."""

from __future__ import annotations

import time

import pytest

from swarmd.dht import DHTConfig, DHTNode, dht_key
from swarmd.dht import protocol as P
from swarmd.dht.rpc_network import RpcNetwork
from swarmd.jobs.probing import UNANSWERED, Prober
from swarmd.values import StageAnnouncement, ValueRefused, announcement_value, decode_announcement
from transport.config import RpcConfig
from transport.errors import TransportError
from transport.identity import Identity
from transport.pool import Pool

CFG = DHTConfig(rpc_timeout=1.0)
#: Hosts `getaddrinfo` refuses with UnicodeError, a NUL (ValueError), a port past 65535 (OverflowError).
UNENCODABLE = ["a..b:1", "a" * 64 + ".example:80", ".:80", "[a..b]:80", "a\x00b:1", "localhost:99999999999999999999",
               "localhost:65536"]


@pytest.mark.parametrize("addr", UNENCODABLE)
async def test_dialling_an_unencodable_host_is_a_transport_error(addr: str) -> None:
    pool = Pool(RpcConfig())
    try:
        with pytest.raises(TransportError):
            await pool.connect(addr)
    finally:
        await pool.close()


@pytest.mark.parametrize("addr", UNENCODABLE)
def test_such_an_announcement_is_refused_at_the_values_edge(addr: str) -> None:
    value = announcement_value(addr, {"samples_per_s": 1.0, "queue": 0, "step": 0, "state": "serving"})
    with pytest.raises(ValueRefused, match="bad_announcement"):
        decode_announcement(value, b"p" * 32, 0, time.time() + 60)


async def test_the_prober_counts_such_a_peer_as_unanswered() -> None:
    pool = Pool(RpcConfig())
    try:
        announced = StageAnnouncement(b"p" * 32, 0, "a..b:1", 1.0, 0, 0, "serving", time.time() + 60)
        assert await Prober(pool, b"m" * 32).check(b"j" * 32, announced) == UNANSWERED
    finally:
        await pool.close()


async def test_a_stranger_claiming_an_unencodable_addr_does_not_stop_the_dht() -> None:
    """Steps: three honest nodes on loopback; a stranger calls `dht.find_node` on each claiming
    `addr = "a..b:1"`; then node 1 stores a record and node 2 reads it. Expected: the claim is
    refused as a bad request or the contact is skipped as unreachable, and the store and the get
    work. On the old code the store raised."""
    nodes = []
    for i in range(3):
        identity = Identity.from_seed(b"addr-%d" % i)
        node = DHTNode(identity, await RpcNetwork.listen(identity, config=CFG), CFG)
        await node.start()
        nodes.append(node)
    stranger = await RpcNetwork.listen(Identity.from_seed(b"addr-stranger"), config=CFG)
    stranger._address = "a..b:1"  # what its calls claim as `addr` (RpcNetwork.call adds it to each)
    try:
        for node in nodes[1:]:
            assert await node.bootstrap([nodes[0].address]) >= 1
        for node in nodes:
            try:
                await stranger.call(node.address, P.FIND_NODE, {"target": node.peer_id}, 2.0)
            except Exception:  # noqa: BLE001 - refusing the claim is one right answer
                pass
        key = dht_key("job", "addr", "stage", 0)
        assert await nodes[1].store(key, nodes[1].peer_id, b"v", time.time() + 60) >= 1
        assert (await nodes[2].get(key, latest=True))[nodes[1].peer_id].value == b"v"
    finally:
        await stranger.stop()
        for node in nodes:
            await node.stop()


async def test_a_stranger_cannot_make_nodes_dial_a_local_unix_socket(tmp_path) -> None:
    """Steps: a unix socket of the host's (here one of ours, counting connections); two honest
    nodes; a stranger calls `dht.find_node` on both claiming `addr = "unix:<that socket>"`; then
    node 1 stores a record. Expected: no node ever connects to the socket (a peer's address is a
    TCP `host:port`; the claim is refused as a bad request). On the old code both nodes put the
    path in their routing tables and the store dialled it, as the daemon's user (root, for a
    system daemon: its own control socket, docker.sock...)."""
    import asyncio

    hits = []
    path = tmp_path / "victim.sock"

    async def accepted(reader, writer):
        hits.append(1)
        writer.close()

    server = await asyncio.start_unix_server(accepted, str(path))
    nodes = []
    for i in range(2):
        identity = Identity.from_seed(b"unix-%d" % i)
        node = DHTNode(identity, await RpcNetwork.listen(identity, config=CFG), CFG)
        await node.start()
        nodes.append(node)
    stranger = await RpcNetwork.listen(Identity.from_seed(b"unix-stranger"), config=CFG)
    stranger._address = f"unix:{path}"
    try:
        assert await nodes[1].bootstrap([nodes[0].address]) >= 1
        for node in nodes:
            try:
                await stranger.call(node.address, P.FIND_NODE, {"target": node.peer_id}, 2.0)
            except Exception:  # noqa: BLE001 - refusing the claim is the right answer
                pass
        assert all(not c.address.startswith("unix:") for node in nodes for c in node.contacts())
        await nodes[1].store(dht_key("job", "unix", "stage", 0), nodes[1].peer_id, b"v", time.time() + 60)
        assert hits == []
    finally:
        await stranger.stop()
        for node in nodes:
            await node.stop()
        server.close()


def test_contacts_and_announcements_never_name_a_unix_socket() -> None:
    with pytest.raises(P.DHTProtocolError):
        P.parse_contacts({"contacts": [[b"i" * 32, "unix:/run/docker.sock"]]}, CFG)
    value = announcement_value("unix:/run/x.sock:1", {"samples_per_s": 1.0, "queue": 0, "step": 0, "state": "serving"})
    with pytest.raises(ValueRefused, match="bad_announcement"):
        decode_announcement(value, b"p" * 32, 0, time.time() + 60)
