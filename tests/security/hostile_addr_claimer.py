"""A stranger that claims an address no one should dial, run as its own process.

It calls `dht.find_node` once on each `--targets` node, its calls claiming `--claim` as its own
address (`addr`, which a DHT node records in its routing table), prints one JSON line with what
each call answered, and exits when stdin closes. One call per node is the whole attack."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from swarmd.dht import DHTConfig
from swarmd.dht import protocol as P
from swarmd.dht.rpc_network import RpcNetwork
from transport.identity import Identity


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--targets", nargs="+", required=True)
    parser.add_argument("--claim", required=True)
    args = parser.parse_args()
    identity = Identity.generate()
    network = await RpcNetwork.listen(identity, config=DHTConfig(rpc_timeout=5.0))
    network._address = args.claim  # what RpcNetwork.call puts in every request's `addr`
    answers = {}
    for target in args.targets:
        try:
            await network.call(target, P.FIND_NODE, {"target": identity.peer_id}, 10.0)
            answers[target] = "ok"
        except Exception as exc:  # noqa: BLE001 - a refusal is the answer we report
            answers[target] = type(exc).__name__
    print(json.dumps({"answers": answers}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await network.stop()


if __name__ == "__main__":
    asyncio.run(main())
