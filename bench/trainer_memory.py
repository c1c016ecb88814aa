"""A trainer's peak memory against `global_samples`, at fixed work in flight.

    .venv/bin/python bench/trainer_memory.py [--quick] [--samples 64,1024] [--d-model 128] [--seq-len 128]

The trainer keeps a finished microbatch's tensors (each stage's input and output gradient, needed
only to re-send a backward a stage lost) on disk until its step commits (swarmd/train/held.py), so
its memory should follow the microbatches in flight, not the global batch. For each
`global_samples` a fresh child process runs one `Trainer` (microbatch size and
`microbatches_in_flight` fixed) for `--steps` steps against real `StageService` peers served by this
process on loopback TCP, and reports its own peak RSS (VmHWM, which includes torch and the data;
`ru_maxrss` would include the parent's, being kept across execve). ONE JSON object is printed:

    {"config": {...}, "runs": {"64": {"peak_rss_mib": ..., "held_bytes_per_step": ...}, "1024": {...}},
     "ratio": peak(largest) / peak(smallest), "goal": "ratio < 1.2"}

`held_bytes_per_step` is what the old trainer held in memory per step (every stage's fp32 input and
output gradient of every microbatch) and this one writes to disk instead.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]

import torch  # noqa: E402

from swarmd.directory import StagePeer, StaticDirectory  # noqa: E402
from swarmd.job import open_training_data  # noqa: E402
from swarmd.job.spec import JobSpec  # noqa: E402
from swarmd.stage import StageLimits, StageServer, StageService  # noqa: E402
from swarmd.train.trainer import Trainer, TrainerConfig  # noqa: E402
from transport.rpc import Pool, Router, RpcServer  # noqa: E402

JOB_ID = hashlib.sha256(b"bench trainer memory").digest()
QUICK = {"samples": "8,64", "d_model": 32, "seq_len": 16, "steps": 1}


def raw_spec(args: argparse.Namespace, global_samples: int, corpus: Path) -> dict:
    return {"name": "trainer-memory", "seed": 1, "steps": args.steps,
            "model": {"arch": "transformer-lm", "d_model": args.d_model, "n_heads": 4, "layers_per_stage": 1,
                      "vocab": 256, "dropout": 0.0},
            "data": {"files": [str(corpus)], "seq_len": args.seq_len},
            "batch": {"global_samples": global_samples, "microbatch_samples": args.microbatch_samples},
            "optim": {"name": "sgd", "lr": 0.01, "schedule": "constant"},
            "wire": {"activations": "none", "gradients": "none"},
            "pipeline": {"stages": args.stages, "microbatches_in_flight": args.in_flight}}


async def serve(spec: JobSpec, stages: int) -> tuple[list, list[StagePeer]]:
    """One real stage peer per stage on loopback; the directory entries a trainer needs."""
    directory, made, peers = StaticDirectory(), [], []
    limits = StageLimits(sync_interval_s=0.05, torch_threads=1)
    for stage in range(stages):
        router = Router()
        rpc = await RpcServer.serve_tcp(router, "127.0.0.1", 0)
        pool = Pool()
        addr = f"127.0.0.1:{rpc.address[1]}"
        peer_id = bytes([stage + 1]) * 32
        directory.set(JOB_ID, stage, [StagePeer(peer_id, addr, stage)])
        service = StageService(spec, JOB_ID, stage, peer_id, StageServer(router), pool, directory, address=addr,
                               limits=limits)
        await service.start()
        made.append((service, rpc, pool))
        peers.append(StagePeer(peer_id, addr, stage))
    return made, peers


async def child(args: argparse.Namespace) -> None:
    """Run the trainer alone in this process and print its peak RSS."""
    torch.set_num_threads(1)
    spec = JobSpec.from_dict(json.loads(args.spec))
    directory = StaticDirectory()
    for peer in json.loads(args.peers):
        directory.set(JOB_ID, peer[2], [StagePeer(bytes.fromhex(peer[0]), peer[1], peer[2])])
    data = open_training_data(spec.data, spec.batch, spec.model.config.vocab, spec.seed, "/")
    pool = Pool()
    trainer = Trainer(spec, JOB_ID, directory, pool, data, config=TrainerConfig(held_dir=args.held_dir))
    series: list[float] = []
    sampler = asyncio.create_task(sample_rss(series))
    events = await trainer.run(0, spec.steps)
    sampler.cancel()
    await pool.close()
    print(json.dumps({"peak_rss_mib": status_mib("VmHWM"), "rss_mib_every_s": series, "steps": len(events),
                      "peak_in_memory": trainer.peak_in_memory,
                      "stage_samples": [list(e.stage_samples) for e in events]}))


def status_mib(field: str) -> float:
    """A size from /proc/self/status in MiB. The peak is VmHWM, this process image's own high-water
    mark: `ru_maxrss` is kept across execve, so a child would report its parent's peak at fork."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no {field} in /proc/self/status")


async def sample_rss(series: list[float]) -> None:
    """This process's resident MiB once a second: where a growth happens, not only how much."""
    while True:
        series.append(status_mib("VmRSS"))
        await asyncio.sleep(1.0)


def held_bytes(args: argparse.Namespace, global_samples: int) -> int:
    """Per step, every stage's fp32 input (stages 1..n-1) and output gradient (stages 0..n-2)."""
    per_tensor = args.seq_len * args.d_model * 4
    return global_samples * 2 * (args.stages - 1) * per_tensor


async def measure(args: argparse.Namespace, global_samples: int, corpus: Path, held_dir: str) -> dict:
    raw = raw_spec(args, global_samples, corpus)
    spec = JobSpec.from_dict(raw)
    made, peers = await serve(spec, args.stages)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--child", "--spec", json.dumps(raw), "--held-dir", held_dir,
            "--peers", json.dumps([[p.peer_id.hex(), p.addr, p.stage] for p in peers]),
            stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"the trainer process failed ({proc.returncode})")
        result = json.loads(out.decode().strip().splitlines()[-1])
    finally:
        for service, rpc, pool in made:
            await service.stop()
            await rpc.close()
            await pool.close()
    result["held_bytes_per_step"] = held_bytes(args, global_samples)
    return result


async def main(args: argparse.Namespace) -> dict:
    sizes = [int(s) for s in args.samples.split(",")]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="bench-trainer-memory-") as root:
        corpus = Path(root) / "corpus.txt"
        corpus.write_text("\n".join(p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py"))) * 4)
        for size in sizes:
            runs[str(size)] = await measure(args, size, corpus, root)
            print(f"global_samples {size}: {runs[str(size)]}", file=sys.stderr, flush=True)
    peaks = [runs[str(s)]["peak_rss_mib"] for s in sizes]
    config = {k: getattr(args, k) for k in ("d_model", "seq_len", "stages", "microbatch_samples", "in_flight", "steps")}
    return {"config": config, "runs": runs, "ratio": peaks[-1] / peaks[0], "goal": "ratio < 1.2"}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model and batches, for a test")
    parser.add_argument("--samples", default="64,1024", help="global_samples values, smallest first")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--microbatch-samples", type=int, default=8)
    parser.add_argument("--in-flight", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--peers", help=argparse.SUPPRESS)
    parser.add_argument("--held-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


if __name__ == "__main__":
    arguments = parse()
    if arguments.child:
        asyncio.run(child(arguments))
    else:
        print(json.dumps(asyncio.run(main(arguments))))
