"""The SWARM paper's square-cube law, measured on this machine: prints one JSON object, writes a PNG.

    .venv/bin/python bench/square_cube.py [--quick] [--layers K] [--share-layers] [--gpu]

For the built-in transformer block at hidden size n (sequence 512, one sample per microbatch), a
middle stage of K blocks:

- compute: measured forward (no grad) + recompute-with-grad + backward on this device, which is
  what a swarmd stage does per microbatch (its `backward` RPC recomputes the forward);
- wire bytes per microbatch for every codec, from `encode_tensor` on the stage's real activations
  and gradients, counted the way swarmd's trainer-mediated protocol moves them (docs/square-cube.md);
- transfer time at 100, 200 and 500 Mb/s from the transport's goodput fraction measured over a real
  `tc tbf` link (root only; otherwise an assumed fraction, said so in the JSON), and a 100 ms RTT;
- stage utilisation compute / (compute + unhidden communication) under the pipeline's overlap;
- the exponent of compute/communication against n (log-log least squares);
- one point confirmed end to end: a real stage RPC server in one network namespace, a client with
  microbatches in flight in the other, per-microbatch time measured against the model's prediction.

The script is also its own helper processes (`--serve`, `--client`), run inside the namespaces.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch

BENCH = Path(__file__).resolve().parent
# Run as a script, bench/ is first on sys.path and bench/transport.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]

from swarmd.model import build_stage  # noqa: E402
from swarmd.model.transformer import TransformerConfig  # noqa: E402
from transport.codecs import CODECS, DEFAULT_CODEC, encode_tensor  # noqa: E402
from transport.rpc import Message, Pool, Request, Router, RpcConfig, RpcServer, new_event_loop  # noqa: E402

OUT = BENCH / "out"
SEQ_LEN = 512
MICROBATCH_SAMPLES = 1  # the paper's setting: one sample per microbatch, the hardest case for overlap
HEAD_DIM = 64  # GPT convention; n_heads = n / 64
CPU_SIZES = (256, 512, 1024, 2048)
QUICK_SIZES = (256, 512)
GPU_EXTRA_SIZES = (4096, 8192)
CPU_MAX_N = 2048
"""Above this one CPU rep takes over ten seconds per block at sequence 512; larger sizes need --gpu."""
BANDWIDTHS_MBIT = (100, 200, 500)
RTT_S = 0.100
"""The paper's wide-area setting; the tbf link has no delay of its own (netem is not in this kernel),
so it enters the model as a term, and the confirmed point uses the link's measured RTT instead."""
IN_FLIGHT = 4  # swarmd's default `pipeline.microbatches_in_flight`
ASSUMED_GOODPUT = 0.95
"""Used only when no shaped link can be built (not root): this script measured 0.944-0.946 of a tbf
rate at 200 Mb/s for the RPC transport's raw tensors (TCP/IP headers, framing, call turnaround)."""
LINK_MBIT = 200
LINK_BURST = "32kb"
"""The tbf bucket a link starts each message with after it idles: a WAN link gives no such credit,
and netns' 256 KB default would carry half of a 512 KB activation for free at each call (0.2 s of a
10 Mb/s link). 32 KB kept the RPC goodput at 200 Mb/s within 0.005 of 256 KB's when measured here."""
SLOW_LINK_MBIT = 10
"""Second confirmation rate: slow enough that communication, not CPU compute, bounds the period."""
CONFIRM_N = 512
CONFIRM_CODEC = "fp16+lz4"
GOODPUT_TENSOR_BYTES = 4 * 1024 * 1024
GOODPUT_TENSORS = 6  # 24 MB: ~1 s at 200 Mb/s, long enough that connection start-up is noise
RPC_TIMEOUT_S = 120.0
SEED = 0


# ------------------------------------------------------------------------------ the pure model


@dataclass(frozen=True)
class Traffic:
    """Encoded bytes through one stage peer's link per microbatch, per direction.

    swarmd's trainer sits between stages (it keeps each stage's input so a backward can go to any
    peer): the stage receives x (forward), then x again with the output gradient dy (backward); it
    sends y (forward reply) and dx (backward reply). The link is full duplex, each direction shaped.
    """

    inbound: int
    outbound: int

    @property
    def total(self) -> int:
        return self.inbound + self.outbound


def stage_traffic(x_act: int, y_act: int, x_grad: int, dy: int, dx: int) -> Traffic:
    """`x_act`/`y_act`: the input/output encoded with the activation codec; `x_grad`, `dy`, `dx`:
    what the backward call carries, encoded with the gradient codec."""
    return Traffic(inbound=x_act + x_grad + dy, outbound=y_act + dx)


def transfer_s(nbytes: float, rate_mbit: float, goodput: float) -> float:
    """Seconds to move `nbytes` of payload over a link of `rate_mbit` delivering `goodput` of it."""
    if rate_mbit <= 0 or not 0 < goodput <= 1:
        raise ValueError(f"need rate > 0 and 0 < goodput <= 1, got {rate_mbit}, {goodput}")
    return nbytes * 8 / (rate_mbit * 1e6 * goodput)


def microbatch_period(compute_s: float, in_s: float, out_s: float, latency_s: float, in_flight: int) -> float:
    """Steady-state seconds per microbatch at one stage with `in_flight` microbatches cycling through
    it (a closed pipeline whose other stages are not the bottleneck).

    Three single-server resources in a cycle: the inbound link, the stage's compute, the outbound
    link, plus a pure delay (`latency_s`, one RTT per RPC). For deterministic service times the
    throughput of such a cycle is exactly the smaller of the busiest resource's rate and
    in_flight / (one microbatch's whole cycle): with one in flight nothing overlaps, with enough in
    flight communication hides entirely behind compute (or compute behind communication).
    """
    if in_flight < 1:
        raise ValueError(f"in_flight must be at least 1, got {in_flight}")
    cycle = compute_s + in_s + out_s + latency_s
    return max(compute_s, in_s, out_s, cycle / in_flight)


def utilization(compute_s: float, period_s: float) -> float:
    """compute / (compute + unhidden communication), the unhidden part being period - compute."""
    return compute_s / period_s


def fit_exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Slope of log y against log x by least squares: y ~ x^slope."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"need at least two (x, y) pairs of equal length, got {len(xs)} and {len(ys)}")
    if min(xs) <= 0 or min(ys) <= 0:
        raise ValueError("a power law is fitted on positive values only")
    if len(set(xs)) < 2:
        raise ValueError("need at least two distinct x")
    slope, _ = numpy.polyfit(numpy.log(xs), numpy.log(ys), 1)
    return float(slope)


def point_figures(compute_s: float, traffic: Traffic, goodput: float, rtt_s: float, in_flight: int,
                  bandwidths: Sequence[float] = BANDWIDTHS_MBIT) -> dict:
    """Per-bandwidth communication time, compute/communication ratio and utilisation of one point,
    with `in_flight` microbatches and with one (no overlap at all: the law's bare form).

    `comm_s` is the time to move all of the microbatch's bytes (both directions, back to back):
    what a stage with nothing to overlap pays, and the denominator of compute/communication.
    The latency term is two RTTs: the forward and the backward RPC each wait one round trip.
    """
    out: dict = {}
    for mbit in bandwidths:
        key = f"{mbit:g}mbps"
        in_s, out_s = transfer_s(traffic.inbound, mbit, goodput), transfer_s(traffic.outbound, mbit, goodput)
        period = microbatch_period(compute_s, in_s, out_s, 2 * rtt_s, in_flight)
        out[f"comm_s_{key}"] = round(in_s + out_s, 5)
        out[f"compute_to_comm_{key}"] = round(compute_s / (in_s + out_s), 4)
        alone = microbatch_period(compute_s, in_s, out_s, 2 * rtt_s, 1)
        out[f"period_s_{key}"] = round(period, 5)
        out[f"utilization_{key}"] = round(utilization(compute_s, period), 4)
        out[f"utilization_{key}_one_in_flight"] = round(utilization(compute_s, alone), 4)
    return out


# ------------------------------------------------------------------------- stage measurements


def stage_config(n: int, layers: int, share_layers: bool) -> TransformerConfig:
    return TransformerConfig(d_model=n, n_heads=max(1, n // HEAD_DIM), max_seq_len=SEQ_LEN,
                             layers_per_stage=layers, share_layers=share_layers)


@dataclass
class StageTensors:
    """A middle stage and one microbatch's real tensors around it: x from stage 0 on tokens, y its
    output, dy the gradient of the last stage's loss, dx the gradient it sends back."""

    stage: torch.nn.Module
    x: torch.Tensor
    y: torch.Tensor
    dy: torch.Tensor
    dx: torch.Tensor


def stage_tensors(config: TransformerConfig, seed: int, device: torch.device) -> StageTensors:
    """Stage 1 of 3, with its neighbours built only to produce realistic x and dy, then dropped."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab, (MICROBATCH_SAMPLES, SEQ_LEN + 1), generator=gen).to(device)
    first = build_stage(config, 0, 3, seed, device=device)
    with torch.no_grad():
        x = first(tokens[:, :-1])  # (B, T, n)
    del first
    middle = build_stage(config, 1, 3, seed, device=device)
    last = build_stage(config, 2, 3, seed, device=device)
    x_in = x.detach().requires_grad_()
    y = middle(x_in)
    y_out = y.detach().requires_grad_()
    last(y_out, tokens[:, 1:]).backward()
    y.backward(y_out.grad)
    middle.zero_grad(set_to_none=True)
    return StageTensors(middle, x.detach(), y.detach(), y_out.grad.detach(), x_in.grad.detach())


def forward_no_grad(stage: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return stage(x)


def recompute_backward(stage: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """What a stage's `backward` RPC computes: the forward again with grad, then backward from dy;
    parameter gradients accumulate as they would over a step's microbatches."""
    x = x.detach().requires_grad_()
    stage(x).backward(dy)
    return x.grad


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_clock(device: torch.device) -> Callable[[], float]:
    """The clock compute is timed with. With one torch thread on CPU every op runs on the calling
    thread, so its CPU time is what an idle core would take in wall time, and other processes sharing
    this machine's cores do not inflate it; otherwise wall time (after a CUDA sync)."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def median_seconds(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """One warm-up call (allocator, kernels), then the median of `reps` timed calls."""
    clock = compute_clock(device)
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        start = clock()
        fn()
        _sync(device)
        times.append(clock() - start)
    return statistics.median(times)


def encoded_bytes(tensor: torch.Tensor, codec: str) -> int:
    _, buffers = encode_tensor(tensor, codec)
    return sum(memoryview(b).nbytes for b in buffers)


def codec_traffic(t: StageTensors, codec: str) -> Traffic:
    return stage_traffic(x_act=encoded_bytes(t.x, codec), y_act=encoded_bytes(t.y, codec),
                         x_grad=encoded_bytes(t.x, codec), dy=encoded_bytes(t.dy, codec),
                         dx=encoded_bytes(t.dx, codec))


def measure_point(n: int, layers: int, share_layers: bool, reps: int, device: torch.device) -> dict:
    t = stage_tensors(stage_config(n, layers, share_layers), SEED, device)
    fwd = median_seconds(lambda: forward_no_grad(t.stage, t.x), reps, device)
    bwd = median_seconds(lambda: recompute_backward(t.stage, t.x, t.dy), reps, device)
    by_codec = {codec: codec_traffic(t, codec) for codec in CODECS}
    default = by_codec[DEFAULT_CODEC]
    return {
        "n": n, "layers": layers, "share_layers": share_layers, "n_heads": max(1, n // HEAD_DIM),
        "compute_s": round(fwd + bwd, 5), "forward_s": round(fwd, 5), "recompute_backward_s": round(bwd, 5),
        "wire_bytes": default.total, "wire_bytes_in": default.inbound, "wire_bytes_out": default.outbound,
        "wire_bytes_by_codec": {codec: tr.total for codec, tr in by_codec.items()},
    }


# ------------------------------------------------------------------------ the real stage server


def stage_router(stage: torch.nn.Module, executor: ThreadPoolExecutor, codec: str) -> Router:
    """`forward` and `backward` as a swarmd stage serves them, compute in a one-worker executor (the
    stage computes one microbatch at a time, as the model assumes); each reply reports its compute
    seconds (wall, and CPU time of the computing thread) so the client can separate compute from the
    link. `sink` and `ping` measure the link."""
    router = Router()
    loop = asyncio.get_running_loop()

    device = next(stage.parameters()).device

    def timed(fn, *tensors: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Host-to-device copies and back count as the stage's work (a no-op on CPU)."""
        wall, cpu = time.perf_counter(), time.thread_time()
        result = fn(stage, *(t.to(device) for t in tensors)).cpu()
        return result, {"compute_s": time.perf_counter() - wall, "compute_cpu_s": time.thread_time() - cpu}

    async def forward(req: Request) -> Message:
        y, seconds = await loop.run_in_executor(executor, timed, forward_no_grad, req.tensors[0])
        return Message(seconds, [y], codec=codec)

    async def backward(req: Request) -> Message:
        x, dy = req.tensors
        dx, seconds = await loop.run_in_executor(executor, timed, recompute_backward, x, dy)
        return Message(seconds, [dx], codec=codec)

    async def sink(req: Request) -> Message:
        return Message({"bytes": sum(t.nbytes for t in req.tensors)})

    async def ping(req: Request) -> Message:
        return Message()

    for name, handler in (("forward", forward), ("backward", backward), ("sink", sink), ("ping", ping)):
        router.unary(name, handler)
    return router


async def serve(host: str, n: int, layers: int, share_layers: bool, codec: str, device: torch.device) -> None:
    stage = build_stage(stage_config(n, layers, share_layers), 1, 3, SEED, device=device)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage") as executor:
        server = await RpcServer.serve_tcp(stage_router(stage, executor, codec), host, 0, RpcConfig())
        try:
            print(server.port, flush=True)
            await asyncio.Event().wait()
        finally:
            await server.close()


async def link_goodput(pool: Pool, address) -> float:
    """Payload bytes per second through the RPC transport (codec `none`, two calls in flight)."""
    gen = torch.Generator().manual_seed(SEED)
    tensors = [torch.randn(GOODPUT_TENSOR_BYTES // 4, generator=gen) for _ in range(GOODPUT_TENSORS)]
    await pool.call(address, "sink", Message({}, tensors[:1], codec="none"), timeout=RPC_TIMEOUT_S)
    queue = list(tensors)

    async def worker() -> None:
        while queue:
            await pool.call(address, "sink", Message({}, [queue.pop()], codec="none"), timeout=RPC_TIMEOUT_S)

    start = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(2):
            group.create_task(worker())
    return sum(t.nbytes for t in tensors) / (time.perf_counter() - start)


async def link_rtt(pool: Pool, address, calls: int = 30) -> float:
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        await pool.call(address, "ping", timeout=RPC_TIMEOUT_S)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


async def one_microbatch(pool: Pool, address, x: torch.Tensor, dy: torch.Tensor, codec: str) -> tuple[float, float]:
    """A forward then a backward call, as the trainer makes them; returns the server's compute
    seconds, wall and CPU."""
    fwd = await pool.call(address, "forward", Message({}, [x], codec=codec), timeout=RPC_TIMEOUT_S)
    bwd = await pool.call(address, "backward", Message({}, [x, dy], codec=codec), timeout=RPC_TIMEOUT_S)
    return (fwd.meta["compute_s"] + bwd.meta["compute_s"], fwd.meta["compute_cpu_s"] + bwd.meta["compute_cpu_s"])


async def run_microbatches(pool: Pool, address, x: torch.Tensor, dy: torch.Tensor, codec: str,
                           in_flight: int, count: int) -> dict:
    """`count` microbatches, `in_flight` at a time. The period is taken between completions after the
    first `in_flight`, so the pipeline's fill is not counted."""
    if count < in_flight + 1:
        raise ValueError(f"need more than {in_flight} microbatches for a steady period, got {count}")
    done: list[float] = []
    compute: list[tuple[float, float]] = []
    remaining = count

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            compute.append(await one_microbatch(pool, address, x, dy, codec))
            done.append(time.perf_counter())

    async with asyncio.TaskGroup() as group:
        for _ in range(in_flight):
            group.create_task(worker())
    steady = done[in_flight - 1:]
    return {
        "in_flight": in_flight,
        "microbatches": count,
        "measured_s_per_microbatch": (steady[-1] - steady[0]) / (len(steady) - 1),
        "server_compute_s_per_microbatch": statistics.median(c[0] for c in compute),
        "server_compute_cpu_s_per_microbatch": statistics.median(c[1] for c in compute),
    }


def confirm_counts(in_flight: int, quick: bool) -> int:
    """Enough completions after the fill for a steady period: three per slot (two when quick)."""
    return in_flight + (2 if quick else 3) * in_flight + 1


async def client(host: str, port: int, n: int, layers: int, share_layers: bool, codec: str,
                 in_flights: Sequence[int], quick: bool, measure_link: bool) -> dict:
    torch.set_num_threads(1)
    t = stage_tensors(stage_config(n, layers, share_layers), SEED, torch.device("cpu"))
    address = (host, port)
    pool = Pool(RpcConfig())
    try:
        out: dict = {}
        if measure_link:
            out["goodput_bytes_per_s"] = await link_goodput(pool, address)
        out["rtt_s"] = await link_rtt(pool, address)
        await one_microbatch(pool, address, t.x, t.dy, codec)  # warm up both ends
        out["runs"] = [await run_microbatches(pool, address, t.x, t.dy, codec, m, confirm_counts(m, quick))
                       for m in in_flights]
        return out
    finally:
        await pool.close()


# ------------------------------------------------------------------------------- the shaped link


def _load_netns():
    spec = importlib.util.spec_from_file_location("swarmd_bench_netns", BENCH / "netns.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _stage_args(args: argparse.Namespace) -> list[str]:
    flags = ["--layers", str(args.layers), "--threads", str(args.threads), "--in-flight", str(args.in_flight)]
    for name in ("share_layers", "quick", "gpu"):
        if getattr(args, name):
            flags.append(f"--{name.replace('_', '-')}")
    return flags


def run_shaped(args: argparse.Namespace, netns) -> dict:
    """Server in namespace a, client in b: goodput and RTT at LINK_MBIT, then the confirmation runs
    at LINK_MBIT and (unless --quick) at SLOW_LINK_MBIT, where the link is the bottleneck."""
    results: dict = {"link_mbit": LINK_MBIT, "burst": LINK_BURST, "rates": {}}
    with netns.shaped_link(rate_mbit=LINK_MBIT, burst=LINK_BURST) as link:
        server = link.popen("a", [sys.executable, __file__, "--serve", link.addr_a, *_stage_args(args)],
                            stdout=subprocess.PIPE, text=True)
        try:
            line = server.stdout.readline()
            if not line:
                raise RuntimeError(f"stage server exited with {server.wait()}")
            port = line.strip()
            for mbit in (LINK_MBIT,) if args.quick else (LINK_MBIT, SLOW_LINK_MBIT):
                if mbit != LINK_MBIT:
                    link.set_rate(mbit, burst=LINK_BURST)
                argv = [sys.executable, __file__, "--client", link.addr_a, port, *_stage_args(args)]
                if mbit == LINK_MBIT:
                    argv.append("--measure-link")
                done = subprocess.run([*link.exec_prefix("b"), *argv], capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"client failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
                results["rates"][mbit] = json.loads(done.stdout)
        finally:
            server.kill()
            server.wait()
            server.stdout.close()
        stats = link.qdisc_stats("b")
        if "tbf" not in stats:
            raise RuntimeError(f"tbf is not installed on the client's end: {stats}")
        results["qdisc_sent_bytes_client_end"] = int(stats.split("Sent ")[1].split(" bytes")[0])
    return results


def confirmed_point(shaped: dict, point: dict, goodput: float) -> dict:
    """Measured per-microbatch time against the model fed with this point's offline compute and
    wire bytes, the link's rate and measured goodput fraction, and its measured RTT."""
    runs = []
    for mbit, result in shaped["rates"].items():
        for run in result["runs"]:
            in_s = transfer_s(point["wire_bytes_in"], mbit, goodput)
            out_s = transfer_s(point["wire_bytes_out"], mbit, goodput)
            latency = 2 * result["rtt_s"]
            predicted = microbatch_period(point["compute_s"], in_s, out_s, latency, run["in_flight"])
            predicted_server = microbatch_period(run["server_compute_s_per_microbatch"], in_s, out_s, latency,
                                                 run["in_flight"])
            measured = run["measured_s_per_microbatch"]
            runs.append({
                "link_mbit": mbit, "in_flight": run["in_flight"], "microbatches": run["microbatches"],
                "link_rtt_s": round(result["rtt_s"], 5),
                "measured_s_per_microbatch": round(measured, 4),
                "predicted_s_per_microbatch": round(predicted, 4),
                "measured_to_predicted": round(measured / predicted, 3),
                "server_compute_s_per_microbatch": round(run["server_compute_s_per_microbatch"], 4),
                "server_compute_cpu_s_per_microbatch": round(run["server_compute_cpu_s_per_microbatch"], 4),
                "predicted_with_server_compute_s": round(predicted_server, 4),
                "measured_to_predicted_with_server_compute": round(measured / predicted_server, 3),
                # the stage's busy fraction, both sides from the compute the server timed in this run
                "measured_utilization": round(run["server_compute_s_per_microbatch"] / measured, 4),
                "predicted_utilization": round(utilization(run["server_compute_s_per_microbatch"],
                                                           predicted_server), 4),
            })
    return {"n": point["n"], "layers": point["layers"], "codec": CONFIRM_CODEC,
            "wire_bytes_in": point["wire_bytes_in"], "wire_bytes_out": point["wire_bytes_out"],
            "compute_s": point["compute_s"], "goodput_fraction": round(goodput, 4),
            "qdisc": "tbf", "burst": shaped["burst"], "qdisc_sent_bytes_client_end": shaped["qdisc_sent_bytes_client_end"], "runs": runs}


# ----------------------------------------------------------------------------------------- plot


def plot(points: list[dict], bandwidths: Sequence[float], in_flight: int, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [p["n"] for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = [f"C{i}" for i in range(len(bandwidths))]
    for mbit, colour in zip(bandwidths, colours):
        left.plot(ns, [p[f"utilization_{mbit:g}mbps"] for p in points], marker="o", color=colour,
                  label=f"{mbit:g} Mb/s, {in_flight} in flight")
        left.plot(ns, [p[f"utilization_{mbit:g}mbps_one_in_flight"] for p in points], marker="x", color=colour,
                  linestyle=":", label=f"{mbit:g} Mb/s, 1 in flight")
    left.set(xscale="log", xlabel="hidden size n", ylabel="stage utilisation", ylim=(0, 1.05),
             title="compute / (compute + unhidden comm)")
    right.plot(ns, [p["compute_s"] for p in points], marker="o", color="black", label="compute (fwd + recompute + bwd)")
    for mbit, colour in zip(bandwidths, colours):
        right.plot(ns, [p[f"comm_s_{mbit:g}mbps"] for p in points], marker="s", linestyle="--", color=colour,
                   label=f"transfer at {mbit:g} Mb/s")
    right.set(xscale="log", yscale="log", xlabel="hidden size n", ylabel="seconds per microbatch",
              title="compute grows ~n², bytes ~n")
    for axis in (left, right):
        axis.set_xticks(ns, [str(n) for n in ns])
        axis.minorticks_off()
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------- main


def sizes_for(args: argparse.Namespace) -> tuple[int, ...]:
    sizes = QUICK_SIZES if args.quick else CPU_SIZES + (GPU_EXTRA_SIZES if args.gpu else ())
    return tuple(args.sizes) if args.sizes else sizes


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.gpu and not torch.cuda.is_available():
        parser.error("--gpu needs a CUDA device and a CUDA build of torch")
    for n in args.sizes or ():
        if n < HEAD_DIM or n % HEAD_DIM:
            parser.error(f"--sizes: {n} must be a positive multiple of {HEAD_DIM} (the head size)")
        if n > CPU_MAX_N and not args.gpu:
            parser.error(f"--sizes: {n} exceeds {CPU_MAX_N} without --gpu (a CPU rep would take minutes)")
    for name in ("layers", "threads", "in_flight", "reps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def bench(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    device = torch.device("cuda" if args.gpu else "cpu")
    if args.gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.set_num_threads(args.threads)
    reps = args.reps or (1 if args.quick else 3)
    sizes = sizes_for(args)
    points = [measure_point(n, args.layers, args.share_layers, reps, device) for n in sizes]

    netns = _load_netns()
    reason = netns.unavailable_reason()
    shaped = None
    if reason is None and not args.no_link:
        shaped = run_shaped(args, netns)
        bytes_per_s = shaped["rates"][LINK_MBIT]["goodput_bytes_per_s"]
        goodput = min(1.0, bytes_per_s * 8 / (LINK_MBIT * 1e6))
        goodput_info = {"fraction": round(goodput, 4), "source": f"measured: RPC codec none over tbf {LINK_MBIT} Mb/s",
                        "payload_mb": GOODPUT_TENSORS * GOODPUT_TENSOR_BYTES / 1e6}
    else:
        goodput = ASSUMED_GOODPUT
        why = "--no-link" if args.no_link else reason
        goodput_info = {"fraction": goodput, "source": f"assumed, not measured ({why})"}

    for point in points:
        point.update(point_figures(point["compute_s"], Traffic(point["wire_bytes_in"], point["wire_bytes_out"]),
                                   goodput, RTT_S, args.in_flight))
    ns = [p["n"] for p in points]
    ratios = [p["compute_to_comm_200mbps"] for p in points]
    report = {
        "device": _device_name(device, args.threads),
        "seq_len": SEQ_LEN, "microbatch_samples": MICROBATCH_SAMPLES, "layers": args.layers,
        "share_layers": args.share_layers, "in_flight": args.in_flight, "rtt_s": RTT_S, "reps": reps,
        "codec": DEFAULT_CODEC, "goodput": goodput_info,
        "compute_clock": "CPU time of the computing thread" if compute_clock(device) is time.thread_time
                         else "wall time",
        "model": "period = max(compute, in, out, (compute + in + out + 2 RTT) / in_flight); "
                 "utilization = compute / period; in = x + x + dy, out = y + dx (encoded bytes)",
        "points": points,
        "compute_to_comm_exponent": round(fit_exponent(ns, ratios), 3) if len(ns) > 1 else None,
        "compute_exponent": round(fit_exponent(ns, [p["compute_s"] for p in points]), 3) if len(ns) > 1 else None,
        "wire_bytes_exponent": round(fit_exponent(ns, [p["wire_bytes"] for p in points]), 3) if len(ns) > 1 else None,
        "compute_to_comm_grows_with_n": all(a < b for a, b in zip(ratios, ratios[1:])),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    if shaped is None:
        report["confirmed_point"] = None
        report["confirmed_point_skipped"] = goodput_info["source"]
    else:
        confirm = next((p for p in points if p["n"] == CONFIRM_N), None)
        if confirm is None:  # not plotted, but the confirmation needs its offline figures
            confirm = measure_point(CONFIRM_N, args.layers, args.share_layers, reps, device)
        report["confirmed_point"] = confirmed_point(shaped, confirm, goodput)
    title = (f"{report['device']}; seq {SEQ_LEN}, 1 sample/microbatch, {args.layers} block(s)/stage, "
             f"{args.in_flight} in flight, RTT {RTT_S * 1e3:g} ms, {DEFAULT_CODEC}, goodput {goodput:.3f}")
    report["png"] = str(plot(points, BANDWIDTHS_MBIT, args.in_flight, args.png, title))
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def _device_name(device: torch.device, threads: int) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)} (fp32, TF32 matmuls)"
    return f"cpu: {os.cpu_count()} cores, torch threads {threads}, fp32"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"n in {QUICK_SIZES}, one rep, one confirmation rate")
    parser.add_argument("--gpu", action="store_true", help=f"compute on CUDA, adding n in {GPU_EXTRA_SIZES}")
    parser.add_argument("--sizes", type=int, nargs="+", help="hidden sizes to measure (overrides the defaults)")
    parser.add_argument("--layers", type=int, default=1, help="blocks per stage (default 1)")
    parser.add_argument("--share-layers", action="store_true", help="one block applied --layers times (ALBERT)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for compute (default 1)")
    parser.add_argument("--in-flight", type=int, default=IN_FLIGHT, help="microbatches in flight per trainer")
    parser.add_argument("--reps", type=int, help="timed reps per measurement after one warm-up (default 3)")
    parser.add_argument("--no-link", action="store_true", help="skip the shaped link (assumed goodput)")
    parser.add_argument("--png", type=Path, default=OUT / "square_cube.png")
    parser.add_argument("--serve", metavar="HOST", help=argparse.SUPPRESS)
    parser.add_argument("--client", nargs=2, metavar=("HOST", "PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--measure-link", action="store_true", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    check_args(parser, args)
    if args.serve:
        torch.set_num_threads(args.threads)
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            runner.run(serve(args.serve, CONFIRM_N, args.layers, args.share_layers, CONFIRM_CODEC,
                             torch.device("cuda" if args.gpu else "cpu")))
    elif args.client:
        in_flights = sorted({1, args.in_flight})
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            print(json.dumps(runner.run(client(args.client[0], int(args.client[1]), CONFIRM_N, args.layers,
                                               args.share_layers, CONFIRM_CODEC, in_flights, args.quick,
                                               args.measure_link))))
    else:
        print(json.dumps(bench(args), indent=2))


if __name__ == "__main__":
    main()
