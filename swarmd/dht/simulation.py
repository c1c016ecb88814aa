"""Build a swarm of DHT nodes on an in-memory fabric: for many-node tests and simulations.

Run it inside swarmd.clock.run_virtual so that timeouts and latencies cost no real time. Identities
come from seeds and each node gets its own /24, so runs are reproducible and per-prefix limits do not
bite.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from transport.identity import Identity

from swarmd.clock import Clock

from .config import DHTConfig
from .network import InMemoryFabric
from .node import DHTNode


def sim_address(i: int) -> str:
    return f"10.{(i >> 8) & 255}.{i & 255}.1:7000"


@dataclass
class Swarm:
    fabric: InMemoryFabric
    nodes: list[DHTNode] = field(default_factory=list)

    def kill(self, node: DHTNode) -> None:
        self.fabric.kill(node.address)

    def freeze(self, node: DHTNode) -> None:
        self.fabric.freeze(node.address)

    async def stop(self) -> None:
        for node in self.nodes:
            await node.stop()


async def build_swarm(n: int, clock: Clock, config: DHTConfig = DHTConfig(), seed: int = 0,
                      latency: tuple[float, float] = (0.005, 0.05), loss: float = 0.0,
                      join_batch: int = 32) -> Swarm:
    """Start n nodes; join them in concurrent batches, each node through a random earlier one
    (batches keep virtual time, and so background refresh traffic, small). Early joiners learn
    about later ones as these call them, as in a real swarm."""
    swarm = Swarm(InMemoryFabric(seed, latency, loss))
    rng = random.Random(seed)
    for i in range(n):
        identity = Identity.from_seed(f"sim-{seed}-{i}".encode())
        node = DHTNode(identity, swarm.fabric.endpoint(identity, sim_address(i)), config, clock)
        await node.start()
        swarm.nodes.append(node)
    for start in range(1, n, join_batch):
        async with asyncio.TaskGroup() as tg:
            for node in swarm.nodes[start: start + join_batch]:
                tg.create_task(node.bootstrap([swarm.nodes[rng.randrange(start)].address]))
    return swarm
