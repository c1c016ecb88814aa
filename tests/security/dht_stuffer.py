"""A hostile process for the key-stuffing tests (issue 13, hole 3), run on its own.

It signs `--count` stage announcements under the stage key of `--job`/`--stage`, each with a fresh
throw-away identity, pointing at 127.0.0.1:9 and expiring in a day, and stores them straight on
every DHT node in `--targets` (64 records a call), again every `--every` seconds, from one identity
of its own over real TCP. It prints one JSON line after its first round (`{"round": results}`)
and, when stdin closes, one with the totals of every store result (`ok`, `source_quota`, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from swarmd.dht import protocol as P
from swarmd.dht.records import sign_record
from swarmd.dht.rpc_network import RpcNetwork
from swarmd.jobs.directory import announcement_value, stage_key
from transport.identity import Identity

DAY = 24 * 3600.0
PER_CALL = 64


async def one_round(network: RpcNetwork, targets: list[str], key: bytes, sybils: list[Identity]) -> dict[str, int]:
    value = announcement_value("127.0.0.1:9", {"samples_per_s": 0.0, "queue": 0, "step": 0, "state": "serving"})
    records = [sign_record(ident, key, ident.peer_id, value, time.time() + DAY) for ident in sybils]
    results: dict[str, int] = {}
    for target in targets:
        for start in range(0, len(records), PER_CALL):
            batch = records[start: start + PER_CALL]
            reply = await network.call(target, P.STORE, P.store_request(key, batch), 10.0)
            for result in P.parse_store_reply(reply.meta, len(batch)):
                results[result] = results.get(result, 0) + 1
    return results


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--targets", nargs="+", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--count", type=int, default=512)
    parser.add_argument("--every", type=float, default=1.0)
    args = parser.parse_args()
    key = stage_key(bytes.fromhex(args.job), args.stage)
    sybils = [Identity.generate() for _ in range(args.count)]
    network = await RpcNetwork.listen(Identity.generate())
    stdin_closed = asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    totals: dict[str, int] = {}
    try:
        first = True
        while not stdin_closed.done():
            for result, count in (await one_round(network, args.targets, key, sybils)).items():
                totals[result] = totals.get(result, 0) + count
            if first:
                print(json.dumps({"round": totals}), flush=True)
                first = False
            await asyncio.wait([stdin_closed], timeout=args.every)
    finally:
        await network.stop()
    print(json.dumps({"totals": totals}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
