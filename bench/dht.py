"""Benchmark: swarmd's DHT against the `kademlia` package, real sockets on loopback.

For each N (64, 256) and each failure mode (none; 30% killed: their processes SIGKILLed, sockets
closed, so peers see refused connections; 30% frozen: SIGSTOPped, sockets open but silent, as a
preempted host looks from outside), a fresh swarm is built from worker processes, 200 keys get 5
writers each, then every key is read once by a random live node. `swarmd` success means all 5
subkeys came back; `kademlia` holds one value per key (a write overwrites), so success there means
some value came back. The victims (30% of the nodes) live in their own worker process, which is
what lets them be killed or frozen as a whole; the other workers host the live nodes and run the
workload. Prints one JSON object: `runs` (one entry per impl x nodes x failure) and `ratios`
(kademlia / swarmd get latency and success per setting, measured in this same run).

    .venv/bin/python bench/dht.py            # full: N=64 and 256, 200 keys x 5 writers
    .venv/bin/python bench/dht.py --quick    # N=32, 40 keys: a smoke run of the same code

`latency` rows: the 64-node killed and frozen settings again with every call crossing a 100 ms
round trip (50 ms each way, as bench/wan_link.py gives a pair of peers), on the in-memory fabric
(swarmd.dht.simulation) under a virtual clock, so the figures are the protocol's and not this
machine's load; the same swarm with no latency is the baseline of the same run. A frozen peer on
the fabric, as on a socket, answers nothing and costs the caller its call timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VICTIM_FRACTION = 0.3
LIVE_WORKERS = 2
GET_TIMEOUT_S = 30.0  # a get still unanswered after this counts as failed
# Transport heartbeats: a daemon hosts one node, so the 2.5 s default costs it little; a worker here
# hosts ~100 nodes with thousands of open connections, whose heartbeats alone would saturate a core.
# The DHT detects dead peers by its own call timeouts, so a slow heartbeat changes nothing else.
HEARTBEAT_S = 30.0


# ------------------------------------------------------------------ worker side (one process)

class SwarmdWorker:
    def __init__(self, tag: str, count: int) -> None:
        self.tag, self.count, self.nodes = tag, count, []

    async def start(self) -> list[str]:
        from swarmd.dht import DHTConfig, DHTNode
        from swarmd.dht.rpc_network import RpcNetwork
        from transport.identity import Identity
        from transport.rpc import RpcConfig
        config = DHTConfig()
        for i in range(self.count):
            identity = Identity.from_seed(f"bench-{self.tag}-{i}".encode())
            rpc = RpcConfig(identity=identity, heartbeat_interval_s=HEARTBEAT_S, heartbeat_timeout_s=4 * HEARTBEAT_S)
            node = DHTNode(identity, await RpcNetwork.listen(identity, config=config, rpc=rpc), config)
            await node.start()
            self.nodes.append(node)
        return [n.address for n in self.nodes]

    async def bootstrap(self, node: int, addr: str) -> None:
        await self.nodes[node].bootstrap([addr])

    async def refresh(self, node: int) -> None:
        n = self.nodes[node]
        await n.find_nearest(n.peer_id)

    async def store(self, node: int, key: int) -> bool:
        from swarmd.dht import dht_key
        n = self.nodes[node]
        return await n.store(dht_key("bench", key), n.peer_id, b"writer %d" % node, time.time() + 600) > 0

    async def get(self, node: int, key: int, writers: int) -> bool:
        from swarmd.dht import dht_key
        return len(await self.nodes[node].get(dht_key("bench", key), latest=True)) == writers

    async def stop(self) -> None:
        for n in self.nodes:
            await n.stop()


class KademliaWorker:
    def __init__(self, tag: str, count: int) -> None:
        self.tag, self.count, self.nodes = tag, count, []

    async def start(self) -> list[str]:
        from kademlia.network import Server
        for _ in range(self.count):
            server = Server()
            await server.listen(0, interface="127.0.0.1")
            self.nodes.append(server)
        return [f"127.0.0.1:{s.transport.get_extra_info('sockname')[1]}" for s in self.nodes]

    async def bootstrap(self, node: int, addr: str) -> None:
        host, port = addr.rsplit(":", 1)
        await self.nodes[node].bootstrap([(host, int(port))])

    async def refresh(self, node: int) -> None:
        s = self.nodes[node]
        await s.bootstrap(s.bootstrappable_neighbors())

    async def store(self, node: int, key: int) -> bool:
        return bool(await self.nodes[node].set(f"bench/{key}", f"writer {node}"))

    async def get(self, node: int, key: int, writers: int) -> bool:
        return await self.nodes[node].get(f"bench/{key}") is not None

    async def stop(self) -> None:
        for s in self.nodes:
            s.stop()


async def timed_all(jobs: list, concurrency: int) -> tuple[list[float], list[bool]]:
    """Run coroutine factories with bounded concurrency; per job its seconds and success."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = [0.0] * len(jobs)
    ok: list[bool] = [False] * len(jobs)

    async def one(i: int, job) -> None:
        async with gate:
            start = time.perf_counter()
            try:
                ok[i] = await asyncio.wait_for(job(), GET_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a benchmark counts any failure of the library under test
                ok[i] = False
            latencies[i] = time.perf_counter() - start

    async with asyncio.TaskGroup() as tg:
        for i, job in enumerate(jobs):
            tg.create_task(one(i, job))
    return latencies, ok


async def worker_main(impl: str, tag: str, count: int, store_concurrency: int, get_concurrency: int) -> None:
    """Serve commands from the coordinator, one JSON line in, one JSON line out."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    worker = SwarmdWorker(tag, count) if impl == "swarmd" else KademliaWorker(tag, count)
    reply: dict[str, Any] = {"addresses": await worker.start()}
    while True:
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line:
            break
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        if op == "bootstrap":
            # join in batches so each batch finds the ones before it
            for start in range(0, count, 16):
                async with asyncio.TaskGroup() as tg:
                    for node in range(start, min(count, start + 16)):
                        tg.create_task(worker.bootstrap(node, cmd["addrs"][node]))
            reply = {"done": True}
        elif op == "refresh":
            await timed_all([lambda n=n: worker.refresh(n) for n in range(count)], store_concurrency)
            reply = {"done": True}
        elif op == "store":
            lat, ok = await timed_all([lambda n=n, k=k: worker.store(n, k) for n, k in cmd["jobs"]],
                                      store_concurrency)
            reply = {"latencies": lat, "ok": ok}
        elif op == "get":
            lat, ok = await timed_all([lambda n=n, k=k: worker.get(n, k, cmd["writers"]) for n, k in cmd["jobs"]],
                                      get_concurrency)
            reply = {"latencies": lat, "ok": ok}
    await worker.stop()


# ------------------------------------------------------------------ coordinator side

class Worker:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.addresses: list[str] = []

    @classmethod
    async def spawn(cls, impl: str, tag: str, count: int, concurrency: tuple[int, int]) -> "Worker":
        proc = await asyncio.create_subprocess_exec(
            sys.executable, os.path.abspath(__file__), "--worker", impl, "--tag", tag, "--count", str(count),
            "--concurrency", *map(str, concurrency), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=64 * 1024 * 1024)
        self = cls(proc)
        self.addresses = (await self.read())["addresses"]
        return self

    async def read(self) -> dict:
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench worker {self.proc.pid} exited")
        return json.loads(line)

    async def ask(self, **cmd: Any) -> dict:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()
        return await self.read()

    async def close(self) -> None:
        if self.proc.returncode is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(self.proc.pid, sig)
                except ProcessLookupError:
                    pass
        await self.proc.wait()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def one_run(impl: str, nodes: int, failure: str, keys: int, writers: int, concurrency: tuple[int, int],
                  seed: int) -> dict:
    rng = random.Random(seed)
    victims = round(nodes * VICTIM_FRACTION)
    live = nodes - victims
    sizes = [live // LIVE_WORKERS + (1 if i < live % LIVE_WORKERS else 0) for i in range(LIVE_WORKERS)]
    tag = f"{impl}-{nodes}-{failure}-{seed}"
    started = time.perf_counter()
    workers = [await Worker.spawn(impl, f"{tag}-{i}", c, concurrency) for i, c in enumerate(sizes)]
    victim = await Worker.spawn(impl, f"{tag}-victims", victims, concurrency)
    everyone = workers + [victim]
    try:
        seeds = workers[0].addresses[:1]
        await workers[0].ask(op="bootstrap", addrs=[seeds[0]] * len(workers[0].addresses))
        pool = list(workers[0].addresses)
        for w in everyone[1:]:
            await w.ask(op="bootstrap", addrs=[rng.choice(pool) for _ in w.addresses])
            pool += w.addresses
        await asyncio.gather(*(w.ask(op="refresh") for w in everyone))
        build_s = time.perf_counter() - started

        live_nodes = [(wi, ni) for wi, w in enumerate(workers) for ni in range(len(w.addresses))]
        store_jobs: list[list[list[int]]] = [[] for _ in workers]
        for key in range(keys):
            for wi, ni in rng.sample(live_nodes, writers):
                store_jobs[wi].append([ni, key])
        replies = await asyncio.gather(*(w.ask(op="store", jobs=j) for w, j in zip(workers, store_jobs)))
        store_lat = [x for r in replies for x in r["latencies"]]
        stores_ok = sum(sum(r["ok"]) for r in replies)

        if failure == "killed":
            os.kill(victim.proc.pid, signal.SIGKILL)
            await victim.proc.wait()
        elif failure == "frozen":
            os.kill(victim.proc.pid, signal.SIGSTOP)
        await asyncio.sleep(0.5)

        get_jobs: list[list[list[int]]] = [[] for _ in workers]
        for key in range(keys):
            wi, ni = rng.choice(live_nodes)
            get_jobs[wi].append([ni, key])
        replies = await asyncio.gather(*(w.ask(op="get", jobs=j, writers=writers) for w, j in zip(workers, get_jobs)))
        get_lat = [x for r in replies for x in r["latencies"]]
        get_ok = [x for r in replies for x in r["ok"]]
    finally:
        for w in everyone:
            await w.close()
    return {
        "impl": impl, "nodes": nodes, "failure": failure,
        "failed_fraction": 0.0 if failure == "none" else victims / nodes,
        "success_rate": round(sum(get_ok) / len(get_ok), 4),
        "get_p50_ms": round(statistics.median(get_lat) * 1000, 1),
        "get_p99_ms": round(percentile(get_lat, 0.99) * 1000, 1),
        "store_p50_ms": round(statistics.median(store_lat) * 1000, 1),
        "store_p99_ms": round(percentile(store_lat, 0.99) * 1000, 1),
        "stores_acknowledged": round(stores_ok / len(store_lat), 4),
        "keys": keys, "writers": writers, "build_s": round(build_s, 1),
    }


# ------------------------------------------------------------------ latency (in-memory fabric)

LATENCY_RTT_S = 0.1


def latency_key(key: int) -> bytes:
    from swarmd.dht import dht_key

    return dht_key("open", "bench", key)


def latency_run(nodes: int, failure: str, keys: int, writers: int, one_way_s: float, seed: int) -> dict:
    """One swarm on the in-memory fabric with a fixed one-way delay, in virtual time."""
    from swarmd.clock import VirtualClock, run_virtual

    clock = VirtualClock()
    return run_virtual(_latency_swarm(clock, nodes, failure, keys, writers, one_way_s, seed), clock)


async def _latency_swarm(clock, nodes: int, failure: str, keys: int, writers: int, one_way_s: float,
                         seed: int) -> dict:
    from swarmd.dht.simulation import build_swarm

    rng = random.Random(seed)
    swarm = await build_swarm(nodes, clock, seed=seed, latency=(one_way_s, one_way_s))
    try:
        for node in swarm.nodes:
            await node.find_nearest(node.peer_id)
        # Under an open namespace: a key of any other namespace is an announcement, held at most
        # max_announce_ttl (150 s) whatever expiration its writer asks. At 100 ms the 200 keys' stores
        # take ~160 s of virtual time and the reads as long, so every key had expired before it was
        # read: success 0.0 was this, not the DHT (the RTT-0 run takes no virtual time at all).
        expires = clock.time() + 24 * 3600  # outlives the run however long the stores take
        for key in range(keys):
            async with asyncio.TaskGroup() as group:
                for node in rng.sample(swarm.nodes, writers):
                    group.create_task(node.store(latency_key(key), node.peer_id, b"w", expires))
        victims = rng.sample(swarm.nodes, round(nodes * VICTIM_FRACTION))
        for node in victims:
            (swarm.kill if failure == "killed" else swarm.freeze)(node)
        alive = [node for node in swarm.nodes if node not in victims]
        latencies, found = [], 0
        for key in range(keys):
            start = clock.monotonic()
            got = await rng.choice(alive).get(latency_key(key), latest=True)
            latencies.append(clock.monotonic() - start)
            found += len(got) == writers
    finally:
        await swarm.stop()
    return {"nodes": nodes, "failure": failure, "rtt_ms": round(2 * one_way_s * 1000), "success_rate": found / keys,
            "get_p50_ms": round(statistics.median(latencies) * 1000, 1),
            "get_p99_ms": round(percentile(latencies, 0.99) * 1000, 1)}


def latency_rows(keys: int, writers: int, seed: int) -> list[dict]:
    rows = []
    for failure in ("killed", "frozen"):
        base = latency_run(64, failure, keys, writers, 0.0, seed)
        row = latency_run(64, failure, keys, writers, LATENCY_RTT_S / 2, seed)
        row["baseline_rtt_0_get_p99_ms"] = base["get_p99_ms"]
        row["baseline_rtt_0_success_rate"] = base["success_rate"]
        rows.append(row)
    return rows


async def coordinator(args: argparse.Namespace) -> dict:
    runs = []
    for nodes in args.nodes:
        for failure in ("none", "killed", "frozen"):
            for impl in args.impl:
                run = await one_run(impl, nodes, failure, args.keys, args.writers,
                                    (args.store_concurrency, args.get_concurrency), args.seed)
                print(json.dumps(run), file=sys.stderr)
                runs.append(run)
    ratios = []
    for nodes in args.nodes:
        for failure in ("none", "killed", "frozen"):
            pair = {r["impl"]: r for r in runs if r["nodes"] == nodes and r["failure"] == failure}
            if "swarmd" in pair and "kademlia" in pair:
                s, k = pair["swarmd"], pair["kademlia"]
                ratios.append({"nodes": nodes, "failure": failure,
                               "get_p50_kademlia_over_swarmd": round(k["get_p50_ms"] / max(s["get_p50_ms"], 0.1), 2),
                               "get_p99_kademlia_over_swarmd": round(k["get_p99_ms"] / max(s["get_p99_ms"], 0.1), 2),
                               "success_swarmd_minus_kademlia": round(s["success_rate"] - k["success_rate"], 4)})
    return {"bench": "dht", "quick": args.quick, "keys": args.keys, "writers": args.writers,
            "store_concurrency": args.store_concurrency, "get_concurrency": args.get_concurrency,
            "rpc_heartbeat_s": HEARTBEAT_S, "load_average_at_start": os.getloadavg()[0], "runs": runs, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="N=32 and 40 keys")
    parser.add_argument("--nodes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--writers", type=int, default=5)
    parser.add_argument("--impl", nargs="+", default=["swarmd", "kademlia"], choices=["swarmd", "kademlia"])
    parser.add_argument("--store-concurrency", type=int, default=4, help="stores in flight per worker")
    parser.add_argument("--get-concurrency", type=int, default=4, help="gets in flight per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency-only", action="store_true", help="only the 100 ms rows (in-memory, ~1 min)")
    parser.add_argument("--worker", choices=["swarmd", "kademlia"], help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    from transport.rpc import run
    if args.worker:
        run(worker_main(args.worker, args.tag, args.count, *args.concurrency))
        return
    if args.quick:
        args.nodes, args.keys = [32], 40
    if args.latency_only:
        print(json.dumps({"bench": "dht", "latency": latency_rows(args.keys, args.writers, args.seed)}, indent=1))
        return
    report = run(coordinator(args))
    report["latency"] = latency_rows(args.keys, args.writers, args.seed)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
