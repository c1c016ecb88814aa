"""Transport benchmark: prints one JSON object, every figure beside a baseline measured in the same run.

    .venv/bin/python bench/transport.py [--quick]

- codecs: encode+decode throughput per codec on one core, in GB/s of fp32 input, beside
  torch.save into BytesIO + torch.load(weights_only=True).
- loopback: small-call latency (p50/p99) against a server process, beside a bare uvloop echo of
  64 bytes (the floor the machine sets), and 64 MB tensor goodput.
- shaped_link (root only): two network namespaces joined by a veth pair shaped with
  `tc qdisc ... tbf rate 200mbit`; goodput as a fraction of the link rate for raw fp32 payloads,
  the fp32-equivalent rate with fp16 and fp16+lz4, and the same tensors as torch.save bytes over
  plain asyncio streams as the baseline.
- latency (root only): peers behind links with real delay (bench/wan_link.py: a userspace delay
  line between namespaces, tbf for the rate) at 50/100/200 ms RTT × 50/200 Mb/s: goodput of
  fp32 tensors over one RPC connection as a fraction of the rate, once past the connection's ramp,
  and the p50/p99 of a small call beside the ICMP round trip of the same link measured in the same
  run (the baseline); `rpc_overhead_ms` is the call's p50 less the ping's.
- encryption: what `RpcConfig(encrypt=True)` (ChaCha20-Poly1305 records) costs on loopback, where
  the CPU and not the link is the limit: small-call p50 and 64 MB goodput against two fresh server
  processes, one plain and one encrypted, with the plain one as the baseline of the same run.

All throughputs are GB/s (10^9 bytes per second); ratios are to the shaped link's rate. The test
tensors are activations after a ReLU (fp32, about half zeros), which is what a stage sends forward.

The script is also its own helper processes (`--serve-rpc`, `--serve-raw`, `--serve-echo`,
`--shaped-client`, `--serve-rpc-encrypted`), started as subprocesses, inside the namespaces for the shaped link.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import io
import json
import os
import signal
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
# This file is named like the package it measures: drop bench/ from the path so `transport` is the
# package, not this script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
sys.path.insert(0, str(REPO))

from transport.codecs import CODECS, decode_tensor, encode_tensor  # noqa: E402
from transport.rpc import Message, Pool, Request, Router, RpcConfig, RpcServer, new_event_loop  # noqa: E402

LINK_MBIT = 200
SEED = 0
RAW_HEADER = struct.Struct("!Q")


def activations(numel: int, seed: int = SEED) -> torch.Tensor:
    """ReLU outputs: what a pipeline stage sends forward (about half exact zeros)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.relu(torch.randn(numel, generator=gen))


# ------------------------------------------------------------------------------------- codecs


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm up allocators and lazy imports
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _codec_gbps(x: torch.Tensor, codec: str, repeats: int) -> float:
    def round_trip() -> None:
        meta, buffers = encode_tensor(x, codec)
        decode_tensor(meta, buffers)

    return round(x.nbytes / _best_seconds(round_trip, repeats) / 1e9, 3)


def bench_codecs(numel: int, repeats: int) -> dict:
    """ReLU activations are the headline (lz4 finds their zeros); dense Gaussian data, where the
    adaptive lz4 declines after its sample, is reported beside them."""
    torch.set_num_threads(1)
    x = activations(numel)
    dense = torch.randn(numel, generator=torch.Generator().manual_seed(SEED))
    results = {}
    for codec in CODECS:
        meta, buffers = encode_tensor(x, codec)
        results[codec] = {
            "encode_decode_gbps": _codec_gbps(x, codec, repeats),
            "wire_bytes_ratio": round(sum(b.nbytes for b in buffers) / x.nbytes, 3),
            "gaussian_encode_decode_gbps": _codec_gbps(dense, codec, repeats),
        }
    # `none` hands out and takes views of the tensor's memory: its figure is bookkeeping, not bytes.
    results["none"]["zero_copy"] = True

    def torch_save_round_trip():
        out = io.BytesIO()
        torch.save(x, out)
        torch.load(io.BytesIO(out.getbuffer()), weights_only=True)

    results["torch_save"] = {"encode_decode_gbps": round(x.nbytes / _best_seconds(torch_save_round_trip, repeats) / 1e9, 3)}
    return results


# ------------------------------------------------------------------------------ helper servers


def _router() -> Router:
    router = Router()

    async def ping(req: Request) -> Message:
        return Message()

    async def sink(req: Request) -> Message:
        return Message({"n": sum(t.numel() for t in req.tensors)})

    router.unary("ping", ping)
    router.unary("sink", sink)
    return router


async def serve_rpc(host: str, port: int, encrypt: bool = False) -> None:
    server = await RpcServer.serve_tcp(_router(), host, port, RpcConfig(encrypt=encrypt))
    print(server.port, flush=True)
    await asyncio.Event().wait()


async def serve_raw(host: str, port: int) -> None:
    """Baseline receiver: length-prefixed torch.save blobs over plain asyncio streams, loaded with
    weights_only=True and acknowledged with one byte."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (size,) = RAW_HEADER.unpack(await reader.readexactly(RAW_HEADER.size))
                blob = await reader.readexactly(size)
                torch.load(io.BytesIO(blob), weights_only=True)
                writer.write(b"k")
                await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()

    server = await asyncio.start_server(handle, host, port)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


class _Echo(asyncio.Protocol):
    """Latency floor: bytes straight back, no framing, no RPC."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)


async def serve_echo(host: str, port: int) -> None:
    server = await asyncio.get_running_loop().create_server(_Echo, host, port)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


def start_helper(args: list[str], prefix: list[str] = ()) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([*prefix, sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"helper {args} exited with {proc.wait()}")
    return proc, int(line)


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    proc.stdout.close()


# ---------------------------------------------------------------------------------- loopback


async def measure_latency(pool: Pool, address, calls: int) -> tuple[float, float]:
    for _ in range(200):
        await pool.call(address, "ping", timeout=10)
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        await pool.call(address, "ping", timeout=10)
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2] * 1e6, samples[int(len(samples) * 0.99)] * 1e6


class _EchoClient(asyncio.Protocol):
    def __init__(self) -> None:
        self.reply: asyncio.Future[bytes] | None = None

    def data_received(self, data: bytes) -> None:
        if self.reply is not None and not self.reply.done():
            self.reply.set_result(data)


async def measure_echo_floor(port: int, calls: int) -> float:
    """p50 of a 64-byte ping-pong on the same loop type with no RPC at all: what the machine's
    scheduler and loopback cost before our code runs."""
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_connection(_EchoClient, "127.0.0.1", port)
    samples = []
    try:
        for _ in range(calls):
            proto.reply = loop.create_future()
            start = time.perf_counter()
            transport.write(b"x" * 64)
            await proto.reply
            samples.append(time.perf_counter() - start)
    finally:
        transport.close()
    samples.sort()
    return samples[len(samples) // 2] * 1e6


async def send_tensors(pool: Pool, address, tensors: list[torch.Tensor], codec: str, parallel: int = 2) -> float:
    """Seconds to deliver every tensor (acknowledged), with `parallel` calls in flight."""
    queue = list(tensors)

    async def worker() -> None:
        while queue:
            tensor = queue.pop()
            await pool.call(address, "sink", Message({}, [tensor], codec=codec), timeout=600)

    start = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(parallel):
            group.create_task(worker())
    return time.perf_counter() - start


def fork_rpc_server() -> tuple[int, int]:
    """The RPC server in a forked child (pid, port). Forked, it shares this process's read-only
    pages (interpreter heap, code objects), so the two ends stop competing for this small VM's
    cache, much as two machines would not. Called before any event loop exists here."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        os.dup2(write_end, 1)
        try:
            asyncio.Runner(loop_factory=new_event_loop).run(serve_rpc("127.0.0.1", 0))
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as lines:
        return pid, int(lines.readline())


async def bench_loopback(quick: bool, forked_port: int) -> dict:
    proc, port = start_helper(["--serve-rpc", "127.0.0.1", "0"])
    echo, echo_port = start_helper(["--serve-echo", "127.0.0.1", "0"])
    pool = Pool(RpcConfig())
    try:
        address = ("127.0.0.1", port)
        calls = 1000 if quick else 5000
        floor = await measure_echo_floor(echo_port, calls)
        p50, p99 = await measure_latency(pool, address, calls)
        forked_p50, _ = await measure_latency(pool, ("127.0.0.1", forked_port), calls)
        tensor = torch.ones(16 * 1024 * 1024)  # 64 MB
        count = 4 if quick else 16
        await send_tensors(pool, address, [tensor], "none")
        seconds = await send_tensors(pool, address, [tensor] * count, "none")
        return {
            "rpc_p50_us": round(p50, 1),
            "rpc_p99_us": round(p99, 1),
            "raw_echo_p50_us": round(floor, 1),
            "rpc_p50_us_forked_server": round(forked_p50, 1),
            "goodput_gbps": round(count * tensor.nbytes / seconds / 1e9, 3),
        }
    finally:
        await pool.close()
        stop(proc)
        stop(echo)


async def bench_encryption(quick: bool) -> dict:
    """Plain and encrypted servers side by side, measured the same way, alternating; the plain one
    is the baseline."""
    plain, plain_port = start_helper(["--serve-rpc", "127.0.0.1", "0"])
    sealed, sealed_port = start_helper(["--serve-rpc-encrypted", "127.0.0.1", "0"])
    pools = {"plain": Pool(RpcConfig()), "encrypted": Pool(RpcConfig(encrypt=True))}
    ports = {"plain": plain_port, "encrypted": sealed_port}
    try:
        calls = 1000 if quick else 5000
        tensor = torch.ones(16 * 1024 * 1024)  # 64 MB
        count = 4 if quick else 8
        figures: dict[str, dict] = {}
        for name, pool in pools.items():
            address = ("127.0.0.1", ports[name])
            p50, _ = await measure_latency(pool, address, calls)
            await send_tensors(pool, address, [tensor], "none")
            seconds = await send_tensors(pool, address, [tensor] * count, "none")
            figures[name] = {"p50_us": p50, "gbps": count * tensor.nbytes / seconds / 1e9}
        return {
            "cipher": "ChaCha20-Poly1305",
            "rpc_p50_us_plain": round(figures["plain"]["p50_us"], 1),
            "rpc_p50_us_encrypted": round(figures["encrypted"]["p50_us"], 1),
            "latency_ratio": round(figures["encrypted"]["p50_us"] / figures["plain"]["p50_us"], 3),
            "goodput_gbps_plain": round(figures["plain"]["gbps"], 3),
            "goodput_gbps_encrypted": round(figures["encrypted"]["gbps"], 3),
            "goodput_ratio": round(figures["encrypted"]["gbps"] / figures["plain"]["gbps"], 3),
        }
    finally:
        for pool in pools.values():
            await pool.close()
        stop(plain)
        stop(sealed)


# ------------------------------------------------------------------------------- shaped link


async def raw_send(host: str, port: int, tensors: list[torch.Tensor]) -> float:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        start = time.perf_counter()
        for tensor in tensors:
            out = io.BytesIO()
            torch.save(tensor, out)
            writer.write(RAW_HEADER.pack(out.getbuffer().nbytes))
            writer.write(out.getbuffer())
            await writer.drain()
            await reader.readexactly(1)
        return time.perf_counter() - start
    finally:
        writer.close()


async def shaped_client(host: str, rpc_port: int, raw_port: int, total_mb: int) -> dict:
    """Runs inside namespace b; returns the link's figures as ratios of LINK_MBIT."""
    torch.set_num_threads(1)
    per = 16 * 1024 * 1024 // 4  # 16 MB fp32 tensors
    tensors = [activations(per, seed) for seed in range(max(2, total_mb // 16))]
    fp32_bytes = sum(t.nbytes for t in tensors)
    link_bytes_per_s = LINK_MBIT * 1e6 / 8
    pool = Pool(RpcConfig())
    address = (host, rpc_port)
    try:
        await send_tensors(pool, address, tensors[:1], "none")  # connect, warm up TCP
        out = {}
        for key, codec in (("raw_goodput_ratio", "none"), ("fp16_fp32_equiv_ratio", "fp16"),
                           ("fp16_lz4_fp32_equiv_ratio", "fp16+lz4")):
            seconds = await send_tensors(pool, address, tensors, codec)
            out[key] = round(fp32_bytes / seconds / link_bytes_per_s, 3)
    finally:
        await pool.close()
    await raw_send(host, raw_port, tensors[:1])
    out["torch_save_goodput_ratio"] = round(fp32_bytes / await raw_send(host, raw_port, tensors) / link_bytes_per_s, 3)
    out["megabytes_per_codec"] = round(fp32_bytes / 1e6)
    return out


def _load_bench(name: str, filename: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def bench_shaped(quick: bool) -> tuple[dict | None, str | None]:
    netns = _load_bench("swarmd_bench_netns", "netns.py")
    reason = netns.unavailable_reason()
    if reason is not None:
        return None, reason
    with netns.shaped_link(rate_mbit=LINK_MBIT) as link:
        rpc, rpc_port = start_helper(["--serve-rpc", link.addr_a, "0"], link.exec_prefix("a"))
        raw, raw_port = start_helper(["--serve-raw", link.addr_a, "0"], link.exec_prefix("a"))
        try:
            total_mb = 64 if quick else 192
            done = subprocess.run(
                [*link.exec_prefix("b"), sys.executable, __file__, "--shaped-client", link.addr_a,
                 str(rpc_port), str(raw_port), str(total_mb)],
                capture_output=True, text=True, check=True,
            )
            figures = json.loads(done.stdout)
        finally:
            stop(rpc)
            stop(raw)
        stats = link.qdisc_stats("b")
        if "tbf" not in stats:
            raise RuntimeError(f"tbf is not installed on the client's end: {stats}")
        sent = int(stats.split("Sent ")[1].split(" bytes")[0])
        return {"link_mbps": LINK_MBIT, **figures, "qdisc": "tbf", "qdisc_sent_bytes": sent}, None


# ------------------------------------------------------------------------------- latency

LATENCY_RTTS_MS = (50, 100, 200)
LATENCY_RATES_MBIT = (50, 200)
# Past the connection's ramp (BBR start-up and receive-window autotuning take a few RTTs).
LATENCY_WARMUP_S = 2.0
LATENCY_MEASURE_S = 5.0
LATENCY_CALLS = 30
# ICMP round trips that give the link's own RTT, the baseline of the small-call latency.
LATENCY_PINGS = 20


async def wan_client(host: str, rpc_port: int, rate_mbit: float, quick: bool) -> dict:
    """Runs inside a peer's namespace: small-call round trips, then tensor goodput past the ramp."""
    torch.set_num_threads(1)
    pool = Pool(RpcConfig())
    address = (host, rpc_port)
    try:
        await pool.call(address, "ping", timeout=30)  # connect
        samples = []
        for _ in range(LATENCY_CALLS // (3 if quick else 1)):
            start = time.perf_counter()
            await pool.call(address, "ping", timeout=30)
            samples.append((time.perf_counter() - start) * 1e3)
        samples.sort()
        link_bytes_per_s = rate_mbit * 1e6 / 8
        tensor = activations(1024 * 1024)  # 4 MB: many per second even at 50 Mb/s
        measure_s = LATENCY_MEASURE_S / (2 if quick else 1)
        warm = max(2, round(LATENCY_WARMUP_S * link_bytes_per_s / tensor.nbytes))
        count = max(4, round(measure_s * link_bytes_per_s / tensor.nbytes))
        await send_tensors(pool, address, [tensor] * warm, "none", parallel=4)
        seconds = await send_tensors(pool, address, [tensor] * count, "none", parallel=4)
    finally:
        await pool.close()
    return {
        "rpc_p50_ms": round(samples[len(samples) // 2], 2),
        "rpc_p99_ms": round(samples[min(len(samples) - 1, int(len(samples) * 0.99))], 2),
        "goodput_ratio": round(count * tensor.nbytes / seconds / link_bytes_per_s, 3),
    }


def bench_latency(quick: bool) -> tuple[list | None, str | None]:
    wan_link = _load_bench("swarmd_bench_wan_link", "wan_link.py")
    reason = wan_link.unavailable_reason()
    if reason is not None:
        return None, reason
    rows = []
    for rtt_ms in LATENCY_RTTS_MS:
        for rate_mbit in LATENCY_RATES_MBIT:
            with wan_link.wan_star(peers=2, rtt_ms=rtt_ms, rate_mbit=rate_mbit) as star:
                rows.append(_latency_row(star, rtt_ms, rate_mbit, quick))
            rows[-1]["delay_line_late_us_mean"] = star.delay_stats.get("late_us_mean")
    return rows, None


def _latency_row(star, rtt_ms: float, rate_mbit: float, quick: bool) -> dict:
    ping_ms = statistics.median(star.ping(1, 0, count=LATENCY_PINGS))
    rpc, port = start_helper(["--serve-rpc", star.addr(0), "0"], star.exec_prefix(0))
    try:
        argv = [sys.executable, __file__, "--wan-client", star.addr(0), str(port), str(rate_mbit), str(int(quick))]
        figures = json.loads(star.run(1, argv, timeout=300))
    finally:
        stop(rpc)
    return {"rtt_ms": rtt_ms, "rate_mbps": rate_mbit, "ping_p50_ms": round(ping_ms, 2), **figures,
            "rpc_overhead_ms": round(figures["rpc_p50_ms"] - ping_ms, 2)}


# ------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller tensors and fewer repeats (~30 s)")
    parser.add_argument("--serve-rpc", nargs=2, metavar=("HOST", "PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--serve-rpc-encrypted", nargs=2, metavar=("HOST", "PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--serve-raw", nargs=2, metavar=("HOST", "PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--serve-echo", nargs=2, metavar=("HOST", "PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--wan-client", nargs=4, metavar=("HOST", "RPC", "MBIT", "QUICK"), help=argparse.SUPPRESS)
    parser.add_argument("--latency-only", action="store_true", help="only the latency rows (root)")
    parser.add_argument("--shaped-client", nargs=4, metavar=("HOST", "RPC", "RAW", "MB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    run = asyncio.Runner(loop_factory=new_event_loop)
    if args.serve_rpc:
        run.run(serve_rpc(args.serve_rpc[0], int(args.serve_rpc[1])))
    elif args.serve_rpc_encrypted:
        run.run(serve_rpc(args.serve_rpc_encrypted[0], int(args.serve_rpc_encrypted[1]), encrypt=True))
    elif args.serve_echo:
        run.run(serve_echo(args.serve_echo[0], int(args.serve_echo[1])))
    elif args.serve_raw:
        run.run(serve_raw(args.serve_raw[0], int(args.serve_raw[1])))
    elif args.wan_client:
        host, rpc_port, rate, quick = args.wan_client
        print(json.dumps(run.run(wan_client(host, int(rpc_port), float(rate), quick == "1"))))
    elif args.latency_only:
        rows, reason = bench_latency(args.quick)
        print(json.dumps({"latency": rows, "latency_skipped": reason}, indent=2))
    elif args.shaped_client:
        host, rpc_port, raw_port, total_mb = args.shaped_client
        print(json.dumps(run.run(shaped_client(host, int(rpc_port), int(raw_port), int(total_mb)))))
    else:
        report: dict = {"units": "throughput in GB/s (1e9 bytes/s) of fp32 input; ratios to the link rate",
                        "quick": args.quick}
        numel = (4 if args.quick else 16) * 1024 * 1024
        report["codecs"] = bench_codecs(numel, 3 if args.quick else 5)
        forked_pid, forked_port = fork_rpc_server()
        try:
            report["loopback"] = run.run(bench_loopback(args.quick, forked_port))
        finally:
            os.kill(forked_pid, signal.SIGKILL)
            os.waitpid(forked_pid, 0)
        report["encryption"] = run.run(bench_encryption(args.quick))
        shaped, reason = bench_shaped(args.quick)
        report["shaped_link"] = shaped
        if reason is not None:
            report["shaped_link_skipped"] = reason
        report["latency"], reason = bench_latency(args.quick)
        if reason is not None:
            report["latency_skipped"] = reason
        print(json.dumps(report, indent=2))
    run.close()


if __name__ == "__main__":
    main()
