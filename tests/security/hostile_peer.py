"""A misbehaving peer, run as its own process by the hostile-peer tests.

As a stage peer it serves a real StageService (real Router, RpcServer, sockets, sync with its
stage-mates) and lies in exactly one way, chosen by `--mode`:

- `garbage`: its forward answers are random activations of the right shape and dtype (the checks
  a single reply can get all pass; only a second opinion catches it);
- `nan`: the input gradients it returns and the gradient sums it brings to the all-reduce are NaN;
  it answers a compute call only once every mate has polled it holding that call's microbatch (or
  after `SHOWN_WAIT_S`), so its sum is a round member's before its reply gets it banned;
- `outlier`: the gradient sums it brings to the all-reduce are multiplied by 1e3;
- `liar`: it claims 1e9 samples/s in `stage.info` and its announcement, and is in fact slow.

Other modes do not serve a stage at all; they attack one address (`--target`) of the swarm:

- `flood`: a peer with a valid identity of its own calls `stage.info` on the target from
  `FLOOD_CALLERS` concurrent loops as fast as it gets answers;
- `spoof`: it dials the target again and again claiming the peer id of `--victim-key` (a public
  key it does not hold), and tries `stage.info` on each connection;
- `outsider`: it dials the target of a private swarm again and again with a swarm key of its own
  (not the swarm's), and tries `stage.info` on each connection;
- `forge`: it stores stage announcements pointing at itself into the DHT node at the target,
  under the victim's subkey: once with the victim's public key and its own signature, once
  signed by itself (the subkey is then not the signer's); repeatedly, `FORGE_PAUSE_S` apart;
- `slowloris`: from source address `SLOWLORIS_SOURCE` it keeps `SLOWLORIS_CONNECTIONS` connections
  open to the target, trickling one byte of a hello every `SLOWLORIS_TRICKLE_S`, and opens a new
  one whenever the target drops one.

A stage peer finds its stage-mates from `--mates` on its command line, or, with `--bootstrap
host:port`, the way a daemon does: it runs a DHT node of its own (its own identity, on the same
server as its stage) bootstrapped from that address, reads its mates from the DHT's stage
announcements, and announces itself there as `swarmd.jobs.serving` does, so real daemons'
trainers route to it. Its peer id is then its identity's (`--peer-id` is ignored), and like a
daemon it all-reduces with the job spec's aggregate (`job_limits`) over its `--limits`; with
`--mates` the aggregate is `--limits`' own, as the in-process stages it joins are given theirs.

It prints one JSON line (`addr`, `announcement`, `transport_id`: the peer id its connections prove)
once serving or attacking, and stops when stdin closes; an attacker then prints a second line with
what it saw (for `flood`: calls answered `ok`, refused `rate_limited`, failed `other`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time

import torch

from swarmd.dht import DHTNode
from swarmd.dht import protocol as dht_protocol
from swarmd.dht.records import Record, sign_record, signing_payload
from swarmd.dht.rpc_network import RpcNetwork
from swarmd.directory import StagePeer, StaticDirectory
from swarmd.jobs.directory import DHTStageDirectory, announcement_value, stage_key
from swarmd.jobs.serving import job_limits
from swarmd.job import load_spec
from swarmd.stage import StageLimits, StageServer, StageService
from transport.errors import HandshakeError, RemoteError
from transport.identity import Identity, peer_id_of
from transport.rpc import Message, Pool, Request, Router, RpcConfig, RpcServer

CLAIMED_SAMPLES_PER_S = 1e9
FLOOD_CALLERS = 8
ATTACKS = ("flood", "spoof", "outsider", "forge", "slowloris")
FORGE_PAUSE_S = 0.05
FORGED_ADDR = "127.0.0.1:9"  # where the forged announcements say the victim serves
SPOOF_PAUSE_S = 0.05
SLOWLORIS_SOURCE = "127.0.0.2"  # another loopback address: its per-source quota is not the swarm's
SLOWLORIS_CONNECTIONS = 24
SLOWLORIS_TRICKLE_S = 0.2
SLOWLORIS_REDIAL_S = 0.02  # not a tight loop: the test machine's cores are shared with the swarm
OUTLIER_SCALE = 1e3
LIAR_DELAY_S = 0.05
SHOWN_WAIT_S = 10.0  # the most a `nan` reply waits for its mates' polls (they may never come)
DIRECTORY_TTL_S = 0.5  # how long its DHT reads of its stage-mates are reused


class HostileService(StageService):
    mode = "honest"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pollers: set = set()  # `nan`: the mates (their connections) that saw it holding a sum
        self._polled = asyncio.Event()

    async def forward(self, req: Request) -> Message:
        if self.mode == "liar":
            await asyncio.sleep(LIAR_DELAY_S)
        reply = await super().forward(req)
        if self.mode == "garbage":
            y = reply.tensors[0]
            return Message(reply.meta, [torch.randn(y.shape, dtype=y.dtype) * 3], codec="none")
        return reply

    async def forward_backward(self, req: Request) -> Message:
        reply = await super().forward_backward(req)
        if self.mode == "nan" and reply.tensors:
            await self._shown_to_every_mate()
            return Message(reply.meta, [torch.full_like(reply.tensors[0], float("nan"))], codec="none")
        return reply

    async def sync_progress(self, req: Request) -> Message:
        reply = await super().sync_progress(req)
        if self.mode == "nan" and reply.meta.get("held"):
            self._pollers.add(req.peer.address)
            self._polled.set()
        return reply

    async def _shown_to_every_mate(self) -> None:
        """Until a poll from every mate has come since now and found this peer holding a sum (the
        gradient just added): a leader's round then counts it in, whatever its reply does next."""
        mates = len([p for p in await self.directory.peers(self.job_id, self.stage_index) if p.peer_id != self.peer_id])
        self._pollers.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SHOWN_WAIT_S):
                while len(self._pollers) < mates:
                    self._polled.clear()
                    await self._polled.wait()

    async def backward(self, req: Request) -> Message:
        reply = await super().backward(req)
        if self.mode == "nan" and reply.tensors:
            return Message(reply.meta, [torch.full_like(reply.tensors[0], float("nan"))], codec="none")
        return reply

    def flatten(self, grads):
        flat = super().flatten(grads)
        if self.mode == "nan" and any(g is not None for g in grads):
            return torch.full_like(flat, float("nan"))
        if self.mode == "outlier":
            return flat * OUTLIER_SCALE
        return flat

    async def info(self, req: Request) -> Message:
        reply = await super().info(req)
        if self.mode == "liar":
            return Message({**reply.meta, "samples_per_s": CLAIMED_SAMPLES_PER_S}, codec="none")
        return reply

    def announcement(self):
        claim = super().announcement()
        return {**claim, "samples_per_s": CLAIMED_SAMPLES_PER_S} if self.mode == "liar" else claim


async def until_stdin_closes() -> None:
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def flood(pool: Pool, target: str, job_id: bytes, stage: int, stop: asyncio.Event) -> dict:
    counts = {"ok": 0, "rate_limited": 0, "other": 0}
    message = Message({"job": job_id, "stage": stage}, codec="none")

    async def caller() -> None:
        while not stop.is_set():
            try:
                await pool.call(target, "stage.info", message, timeout=10)
                counts["ok"] += 1
            except RemoteError as exc:
                counts["rate_limited" if exc.code == "rate_limited" else "other"] += 1
            except (ConnectionError, OSError, TimeoutError):
                counts["other"] += 1
                await asyncio.sleep(0.05)

    async with asyncio.TaskGroup() as tg:
        for _ in range(FLOOD_CALLERS):
            tg.create_task(caller())
    return counts


async def spoof(pool: Pool, target: str, job_id: bytes, stage: int, stop: asyncio.Event) -> dict:
    """Each call dials afresh (a refused hello leaves no connection) and must fail in the hello."""
    counts = {"refused_hello": 0, "answered": 0, "other": 0}
    message = Message({"job": job_id, "stage": stage}, codec="none")
    while not stop.is_set():
        try:
            await pool.call(target, "stage.info", message, timeout=10)
            counts["answered"] += 1
        except HandshakeError:
            counts["refused_hello"] += 1
        except Exception:  # noqa: BLE001 - anything else is reported to the test, which expects none
            counts["other"] += 1
        await asyncio.sleep(SPOOF_PAUSE_S)
    return counts


async def forge(pool: Pool, identity: Identity, target: str, job_id: bytes, stage: int, victim_key: bytes,
                stop: asyncio.Event) -> dict:
    """Count the DHT node's answer to each forged record (its reasons, "ok" if one got in)."""
    counts: dict[str, int] = {}
    key, victim = stage_key(job_id, stage), peer_id_of(victim_key)
    while not stop.is_set():
        expiration = time.time() + 60
        value = announcement_value(FORGED_ADDR, {"samples_per_s": 1e9, "queue": 0, "step": 0, "state": "serving"})
        payload = signing_payload(key, victim, value, expiration)
        records = [Record(key, victim, value, expiration, identity.sign(payload), victim_key),
                   sign_record(identity, key, victim, value, expiration)]
        try:
            reply = await pool.call(target, dht_protocol.STORE,
                                    Message(dht_protocol.store_request(key, records)), timeout=10)
            for result in reply.meta["results"]:
                counts[result] = counts.get(result, 0) + 1
        except (RemoteError, ConnectionError, OSError, TimeoutError) as exc:
            counts[type(exc).__name__] = counts.get(type(exc).__name__, 0) + 1
        await asyncio.sleep(FORGE_PAUSE_S)
    return counts


async def slowloris(target: str, stop: asyncio.Event) -> dict:
    """Count connections the target dropped after we held them (its deadline) and at once (its quota)."""
    host, port = target.rsplit(":", 1)
    counts = {"dropped_after_hold": 0, "dropped_at_once": 0, "connect_failed": 0}

    async def holder() -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(host, int(port), local_addr=(SLOWLORIS_SOURCE, 0))
            except OSError:
                counts["connect_failed"] += 1
                await asyncio.sleep(SLOWLORIS_TRICKLE_S)
                continue
            held = 0
            try:
                while not stop.is_set():
                    writer.write(b"\x00")
                    await writer.drain()
                    try:
                        # Whatever the target says (its hello, a refusal) is read and ignored; EOF is the drop.
                        if await asyncio.wait_for(reader.read(65536), SLOWLORIS_TRICKLE_S) == b"":
                            break
                    except TimeoutError:
                        held += 1
            except OSError:
                pass
            finally:
                writer.close()
            if not stop.is_set():
                counts["dropped_after_hold" if held >= 2 else "dropped_at_once"] += 1
                await asyncio.sleep(SLOWLORIS_REDIAL_S)

    async with asyncio.TaskGroup() as tg:
        for _ in range(SLOWLORIS_CONNECTIONS):
            tg.create_task(holder())
    return counts


async def attack(args: argparse.Namespace, job_id: bytes) -> None:
    identity = Identity.generate()
    if args.mode in ("spoof", "forge") and not args.victim_key:
        raise SystemExit(f"--mode {args.mode} needs --victim-key")
    if args.mode == "spoof":
        victim = bytes.fromhex(args.victim_key)
        # Our own private key behind the victim's public key: the hello claims its id, the
        # signature cannot match.
        identity = Identity(identity.private_key, victim, peer_id_of(victim))
    # An outsider of a private swarm: a key of its own, not the swarm's.
    pool = Pool(RpcConfig(identity=identity, swarm_key=os.urandom(32) if args.mode == "outsider" else None))
    print(json.dumps({"addr": args.target, "announcement": {}, "transport_id": identity.peer_id.hex()}), flush=True)
    stop = asyncio.Event()
    work = {
        "flood": lambda: flood(pool, args.target, job_id, args.stage, stop),
        "spoof": lambda: spoof(pool, args.target, job_id, args.stage, stop),
        "outsider": lambda: spoof(pool, args.target, job_id, args.stage, stop),  # the same: every hello refused
        "forge": lambda: forge(pool, identity, args.target, job_id, args.stage, bytes.fromhex(args.victim_key), stop),
        "slowloris": lambda: slowloris(args.target, stop),
    }[args.mode]
    try:
        async with asyncio.TaskGroup() as tg:
            result = tg.create_task(work())
            await until_stdin_closes()
            stop.set()
        print(json.dumps(result.result()), flush=True)
    finally:
        await pool.close()


async def serve_through_dht(args: argparse.Namespace, spec, job_id: bytes) -> None:
    """Serve the stage as a daemon would: one server and pool with our identity for the DHT and the
    stage, mates from the DHT, our announcement refreshed there until we stop."""
    identity = Identity.generate()
    config = RpcConfig(identity=identity)
    router = Router()
    rpc = await RpcServer.serve_tcp(router, "127.0.0.1", 0, config=config)
    addr = f"{rpc.address[0]}:{rpc.address[1]}"
    pool = Pool(config)
    dht = DHTNode(identity, RpcNetwork(router, pool, addr))
    await dht.start()
    service = None
    try:
        if await dht.bootstrap([args.bootstrap]) == 0:
            raise SystemExit(f"no DHT node answered at {args.bootstrap}")
        HostileService.mode = args.mode
        service = HostileService(spec, job_id, args.stage, identity.peer_id, StageServer(router), pool,
                                 DHTStageDirectory(dht, DIRECTORY_TTL_S), address=addr,
                                 limits=job_limits(StageLimits(**json.loads(args.limits)), spec))
        await service.start()
        announcement = dht.announce(stage_key(job_id, args.stage),
                                    lambda: announcement_value(addr, service.announcement()))
        ready = {"addr": addr, "announcement": service.announcement(), "transport_id": identity.peer_id.hex()}
        print(json.dumps(ready), flush=True)
        await until_stdin_closes()
        await dht.withdraw(announcement)
    finally:
        if service is not None:
            await service.stop()
        await dht.stop()
        await rpc.close()
        await pool.close()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--peer-id", default="", help="hex peer id of a stage peer without --bootstrap")
    parser.add_argument("--mode", choices=("garbage", "nan", "outlier", "liar", *ATTACKS), required=True)
    parser.add_argument("--target", default="", help="host:port an attacking mode attacks (required by those)")
    parser.add_argument("--victim-key", default="", help="hex public key whose peer id `spoof` claims")
    parser.add_argument("--mates", default="", help="peer_id_hex@host:port,... of its stage-mates")
    parser.add_argument("--limits", default="{}", help="StageLimits fields as JSON")
    parser.add_argument("--bootstrap", default="", help="host:port of a DHT node: find mates and announce there")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = load_spec(args.job)
    job_id = bytes.fromhex(args.job_id)
    if args.mode in ATTACKS:
        if not args.target:
            parser.error(f"--mode {args.mode} needs --target")
        return await attack(args, job_id)
    if args.bootstrap:
        return await serve_through_dht(args, spec, job_id)
    router = Router()
    rpc = await RpcServer.serve_tcp(router, "127.0.0.1", 0)
    addr = f"{rpc.address[0]}:{rpc.address[1]}"
    peer_id = bytes.fromhex(args.peer_id)
    mates = [StagePeer(bytes.fromhex(m.split("@")[0]), m.split("@")[1], args.stage)
             for m in args.mates.split(",") if m]
    directory = StaticDirectory({(job_id, args.stage): [*mates, StagePeer(peer_id, addr, args.stage)]})
    pool = Pool()
    HostileService.mode = args.mode
    service = HostileService(spec, job_id, args.stage, peer_id, StageServer(router), pool, directory,
                             address=addr, limits=StageLimits(**json.loads(args.limits)))
    await service.start()
    print(json.dumps({"addr": addr, "announcement": service.announcement(), "transport_id": None}), flush=True)
    try:
        await until_stdin_closes()
    finally:
        await service.stop()
        await rpc.close()
        await pool.close()


if __name__ == "__main__":
    asyncio.run(main())
