"""DHT nodes over real loopback TCP (each its own RpcNetwork listening on 127.0.0.1), for the tests
that need real sockets rather than the virtual-clock swarm of swarmd.dht.simulation."""

from __future__ import annotations

from swarmd.dht import DHTConfig, DHTNode
from swarmd.dht.rpc_network import RpcNetwork
from transport.identity import Identity


async def start_nodes(n: int, seed: str, config: DHTConfig) -> list[DHTNode]:
    """`n` started nodes with identities from `seed`, every one after the first bootstrapped from it."""
    nodes = []
    for i in range(n):
        identity = Identity.from_seed(f"{seed}-{i}".encode())
        node = DHTNode(identity, await RpcNetwork.listen(identity, config=config), config)
        await node.start()
        nodes.append(node)
    for node in nodes[1:]:
        assert await node.bootstrap([nodes[0].address]) >= 1
    return nodes


async def stop_all(nodes: list[DHTNode]) -> None:
    for node in nodes:
        await node.stop()
