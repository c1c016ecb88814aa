"""A peer that stores hostile job values in real daemons' DHT nodes, run as its own process.

Every record it stores is validly signed by an identity of its own (so every storer accepts it:
the DHT checks who signed, not what the value says) and stored straight into each `--targets`
node, again every `RESTORE_S` so it never lapses. `--mode` picks the values:

- `malformed`: in every stage of `--job-id`, an announcement whose `step` is "oops" and one whose
  `samples_per_s` is "fast" (two identities): the issue's record that stopped training swarm-wide;
- `liar`: in stage 0 of `--job-id`, a serving peer claiming `LIAR_SAMPLES_PER_S` at an address
  where nothing answers (`DEAD_ADDR`);
- `index`: `INDEX_IDENTITIES` entries in the `jobs` index, each listing `INDEX_IDS` made-up job ids.

It prints one JSON line once every target accepted a first round (`stores`: store results by
reason), and stops when stdin closes, printing a last line with the totals.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import msgpack

from swarmd.dht import dht_key
from swarmd.dht import protocol as dht_protocol
from swarmd.dht.records import sign_record
from transport.errors import RemoteError
from transport.identity import Identity
from transport.rpc import Message, Pool, RpcConfig

RESTORE_S = 1.0
RECORD_TTL_S = 60.0
LIAR_SAMPLES_PER_S = 1e12
DEAD_ADDR = "127.0.0.1:9"  # the discard port: nothing listens there on a test box
INDEX_IDENTITIES = 8
INDEX_IDS = 200  # 200 ids of 34 bytes fit the DHT's 8 KiB value limit


def stage_key(job_id: bytes, stage: int) -> bytes:
    return dht_key("job", job_id, "stage", stage)


def index_key() -> bytes:
    return dht_key("jobs")


def announcement_value(addr: str, fields: dict) -> bytes:
    """Packed here, not by swarmd's encoder: what a hostile peer sends is its own choice."""
    return msgpack.packb({"addr": addr, **fields}, use_bin_type=True)


def encode_index(job_ids: list[bytes]) -> bytes:
    return msgpack.packb(job_ids, use_bin_type=True)


def records(mode: str, job_id: bytes, stages: int, identities: list[Identity],
            index_values: list[bytes]) -> list[tuple[bytes, object]]:
    """(key, signed record) pairs for one round, freshly expiring; `index_values`: each index
    identity's list (the same made-up ids every round, as a real index entry would be)."""
    expires = time.time() + RECORD_TTL_S
    out = []
    if mode == "malformed":
        fields = [{"samples_per_s": 1.0, "queue": 0, "step": "oops", "state": "serving"},
                  {"samples_per_s": "fast", "queue": 0, "step": 0, "state": "serving"}]
        for stage in range(stages):
            for identity, bad in zip(identities, fields):
                value = announcement_value("127.0.0.1:9", bad)
                out.append((stage_key(job_id, stage), sign_record(identity, stage_key(job_id, stage),
                                                                  identity.peer_id, value, expires)))
    elif mode == "liar":
        value = announcement_value(DEAD_ADDR, {"samples_per_s": LIAR_SAMPLES_PER_S, "queue": 0, "step": 0,
                                               "state": "serving"})
        out.append((stage_key(job_id, 0), sign_record(identities[0], stage_key(job_id, 0), identities[0].peer_id,
                                                      value, expires)))
    else:
        for identity, value in zip(identities, index_values):
            out.append((index_key(), sign_record(identity, index_key(), identity.peer_id, value, expires)))
    return out


async def store_round(pool: Pool, targets: list[str], pairs: list[tuple[bytes, object]], counts: dict) -> None:
    for target in targets:
        for key, record in pairs:
            try:
                reply = await pool.call(target, dht_protocol.STORE, Message(dht_protocol.store_request(key, [record])),
                                        timeout=10)
                for result in reply.meta["results"]:
                    counts[result] = counts.get(result, 0) + 1
            except (RemoteError, ConnectionError, OSError, TimeoutError) as exc:
                counts[type(exc).__name__] = counts.get(type(exc).__name__, 0) + 1


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("malformed", "liar", "index"), required=True)
    parser.add_argument("--targets", required=True, help="host:port,... of the DHT nodes to store into")
    parser.add_argument("--job-id", default="", help="hex job id (malformed, liar)")
    parser.add_argument("--stages", type=int, default=1)
    args = parser.parse_args()
    targets = [t for t in args.targets.split(",") if t]
    job_id = bytes.fromhex(args.job_id)
    identities = [Identity.generate() for _ in range(INDEX_IDENTITIES if args.mode == "index" else 2)]
    index_values = [encode_index([os.urandom(32) for _ in range(INDEX_IDS)]) for _ in identities]
    pool = Pool(RpcConfig(identity=Identity.generate()))
    counts: dict[str, int] = {}
    stdin_closed = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(None, sys.stdin.read))
    try:
        await store_round(pool, targets, records(args.mode, job_id, args.stages, identities, index_values), counts)
        print(json.dumps({"stores": counts, "signers": [i.peer_id.hex() for i in identities]}), flush=True)
        while not stdin_closed.done():
            await asyncio.wait({stdin_closed}, timeout=RESTORE_S)
            await store_round(pool, targets, records(args.mode, job_id, args.stages, identities, index_values), counts)
        print(json.dumps({"stores": counts}), flush=True)
    finally:
        await pool.close()


if __name__ == "__main__":
    asyncio.run(main())
