"""Pipeline throughput of a local swarm against one process, under preemption, and wire bytes by codec.

    .venv/bin/python bench/pipeline.py [--quick] [--stages 4] [--peers-per-stage 2] [--d-model 128]
                                       [--seq-len 128] [--duration 60] [--fault-duration 80] [--kill-every 20]
                                       [--device cpu|cuda] [--codecs none,fp16,lz4,fp16+lz4,int8]

One job spec (a byte-level GPT on the Python standard library's source, sized by the flags) is
measured three ways, and ONE JSON object is printed:

- local: `swarmd.reference.ReferenceTrainer` in this process (same registry, same init, same data
  order, same global batch, same optimizer), timed over `--local-steps` after a warm-up step, with
  one torch thread as each daemon's stage has (on a busy 2-core machine two threads ran 6x slower);
  run before and after the swarm, the mean reported;
- swarm: a `swarmd.swarmproc.LocalSwarm` of real `swarmd` processes on loopback: one daemon whose
  trainer(s) push microbatches and `stages x peers-per-stage` daemons, each serving one stage. After
  `--warmup-steps` commits: half of `--duration` with no faults, a `--fault-duration` window in
  which every `--kill-every` seconds one stage peer (from a stage whose peers are all up) is
  SIGKILLed and at once restarted (same state dir, identity and port; it downloads its stage's
  state from its mate and serves again), then, once every victim serves again, the other half of
  `--duration` with no faults. All on the same job and the same warm processes, the fault window
  bracketed by the no-fault ones, so the ratio isolates the cost of the faults from load that
  drifts during the run (the machine may be shared).
- wire bytes per sample by codec: for each codec, a trainer in this process trains `--wire-steps`
  steps against one real `StageService` per stage over real loopback TCP connections of the
  transport; the bytes are read from the kernel (`TCP_INFO` bytes_acked + bytes_received on the
  trainer's sockets, the hello excluded): every byte the trainer's links carry, frames, headers and
  `stage.info` polls included, not TCP/IP headers. Stage-mates' all-reduce traffic (its own codec,
  the job's `[wire] allreduce`, fp16 by default) is not in it: one peer per stage has no mates.
- control traffic (`control_traffic`, issue 14): 2, 4 and 8 in-process stage peers of one stage on
  loopback (default sync limits) waiting for work, `--control-seconds` each; the mean bytes/s per
  peer their links to each other carry (progress polls and answers: everything but activations,
  gradients and state downloads), read from the kernel (TCP_INFO) on the polling side of each link.
  `--control-only` measures just this.
- the swarm's own wire bytes, for its codec (`--codec`): what the daemons counted themselves
  (`swarmd_transport_{sent,received}_bytes_total`, read from each daemon's metrics endpoint at the
  start and end of each no-fault window), per sample committed in those windows: the trainer's
  daemon's sent + received (its links to the stages: the like of the in-process figure, beside which
  it is reported as a cross-check) and every daemon's sent bytes (each byte on any link once: the
  stage-mates' all-reduce and the DHT included).

Samples/s are windowed: steps committed between the window's start and end, times the global
batch, over the window's length (so a stall at the end of the window counts against it).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import socket
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
# Run as a script, bench/ is first on sys.path and bench/transport.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]

import torch  # noqa: E402

from swarmd.client import Client, ControlError, DaemonUnavailable  # noqa: E402
from swarmd.directory import StagePeer, StaticDirectory  # noqa: E402
from swarmd.job import open_training_data  # noqa: E402
from swarmd.job.spec import JobSpec  # noqa: E402
from swarmd.reference import ReferenceTrainer  # noqa: E402
from swarmd.stage import StageLimits, StageServer, StageService  # noqa: E402
from swarmd.swarmproc import (FAST_ENV, LocalSwarm, PeerProcess, SwarmError, SwarmSettings,  # noqa: E402
                              follow_logs, install_signal_handlers, serve_when_known)
from swarmd.train.trainer import Trainer  # noqa: E402
from transport.codecs import CODECS  # noqa: E402
from transport.rpc import Pool, Router, RpcServer  # noqa: E402

DEFAULT_CODECS = ("none", "fp16", "lz4", "fp16+lz4", "int8")
#: `--quick`: the smallest run that still exercises every part (five daemons, a few kills, the control
#: figure over 2 s per size), about 40 s on a busy 2-core machine. Flags given explicitly still win.
QUICK = {"stages": 2, "peers_per_stage": 2, "d_model": 32, "n_heads": 2, "seq_len": 16, "global_samples": 8,
         "microbatch_samples": 2, "local_steps": 5, "wire_steps": 1, "warmup_steps": 2, "duration": 6.0,
         "fault_duration": 10.0, "kill_every": 4.0, "timeout": 90.0, "control_seconds": 2.0}
#: The swarm's job never ends by itself: the windows end it (cancel). Also the LR schedule's length.
SWARM_STEPS = 1_000_000
#: How long a restarted or fresh daemon may take to find the job's record in the DHT.
JOB_DISCOVERY_S = 30.0
#: `struct tcp_info` (linux/tcp.h): tcpi_bytes_acked and tcpi_bytes_received, u64 each, at byte 120
#: (Linux 4.1+). bytes_acked counts the SYN as one byte; differences from a snapshot cancel it.
TCP_INFO_BYTES_OFFSET = 120
TCP_INFO_LEN = 256
#: Stage-side settings for the in-process wire measurement: a quick sync poll so a step commits in
#: tens of milliseconds instead of the default 0.1 s (fewer trainer `stage.info` polls to count).
WIRE_STAGE_LIMITS = StageLimits(sync_interval_s=0.02, workers=1, torch_threads=1)
WIRE_JOB_ID = hashlib.sha256(b"swarmd bench/pipeline wire bytes").digest()
#: Stage peers per stage the control-traffic figure is measured at, and their (default) sync limits.
CONTROL_PEERS = (2, 4, 8)
CONTROL_STAGE_LIMITS = StageLimits(workers=1, torch_threads=1)
#: The swarm's placement is the bench's, fixed for the whole run: no daemon joins stages on its own
#: (the trainer's daemon would otherwise serve one too) and none moves to another stage mid-window.
#: A restarted victim still rejoins its remembered stage by itself, as a real peer would.
PINNED_ENV = {"SWARMD_JOBS_SERVE": "none", "SWARMD_REBALANCE_ENABLED": "false"}


# ------------------------------------------------------------------------------------ the job


def job_dict(args: argparse.Namespace, steps: int) -> dict[str, Any]:
    """The spec every side trains, as the TOML table `swarmctl submit` would send."""
    return {
        "name": "pipeline-bench", "seed": args.seed, "steps": steps,
        "model": {"arch": "transformer-lm", "d_model": args.d_model, "n_heads": args.n_heads,
                  "layers_per_stage": args.layers_per_stage, "vocab": 256, "dropout": 0.0},
        "data": {"files": ["{stdlib}/*.py"], "seq_len": args.seq_len},
        "batch": {"global_samples": args.global_samples, "microbatch_samples": args.microbatch_samples},
        "optim": {"name": "adamw", "lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1,
                  "schedule": "constant", "clip_norm": 1.0},
        "wire": {"activations": args.codec, "gradients": args.codec},
        "pipeline": {"stages": args.stages, "microbatches_in_flight": args.in_flight, "delayed_updates": False},
        "checkpoint": {"every_steps": 0},
    }


def with_codec(raw: dict[str, Any], codec: str) -> dict[str, Any]:
    return {**raw, "wire": {"activations": codec, "gradients": codec}}


# ------------------------------------------------------------------------------ local baseline


def run_local(spec: JobSpec, steps: int, device: torch.device) -> dict[str, Any]:
    """One process, the same spec: one warm-up step (allocations, kernel selection), then `steps` timed."""
    data = open_training_data(spec.data, spec.batch, spec.model.config.vocab, spec.seed, Path.cwd())
    trainer = ReferenceTrainer(spec, data, device)  # builds its stages there and moves each microbatch
    trainer.train_step()
    started = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - started
    params = sum(p.numel() for p in trainer.model.parameters())
    return {"samples_per_s": steps * spec.batch.global_samples / wall, "steps": steps, "wall_s": round(wall, 3),
            "threads": torch.get_num_threads(), "parameters": params}


# ------------------------------------------------------------------------- wire bytes by codec


def socket_bytes(sock: socket.socket | Any) -> int:
    """Payload bytes this TCP socket has had acknowledged plus those it received, from the kernel."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN)
    acked, received = struct.unpack_from("<QQ", raw, TCP_INFO_BYTES_OFFSET)
    return acked + received


async def wire_bytes_for(raw: dict[str, Any], codec: str, steps: int) -> dict[str, Any]:
    """Train `steps` steps with `codec` on both directions against one real stage peer per stage;
    the bytes the trainer's connections carried, per sample."""
    spec = JobSpec.from_dict(with_codec(raw, codec))
    data = open_training_data(spec.data, spec.batch, spec.model.config.vocab, spec.seed, Path.cwd())
    directory = StaticDirectory()
    opened: list[tuple[StageService, RpcServer, Pool]] = []
    trainer_pool = Pool()
    try:
        for stage in range(spec.pipeline.stages):
            router = Router()
            server = StageServer(router)
            rpc = await RpcServer.serve_tcp(router, "127.0.0.1", 0)
            pool = Pool()
            addr = f"{rpc.address[0]}:{rpc.address[1]}"
            peer_id = hashlib.sha256(b"wire peer %d" % stage).digest()
            service = StageService(spec, WIRE_JOB_ID, stage, peer_id, server, pool, directory, address=addr,
                                   limits=WIRE_STAGE_LIMITS)
            opened.append((service, rpc, pool))
            await service.start()
            directory.set(WIRE_JOB_ID, stage, [StagePeer(peer_id, addr, stage)])
        addrs = [f"{rpc.address[0]}:{rpc.address[1]}" for _, rpc, _ in opened]
        connections = [await trainer_pool.connect(a) for a in addrs]
        before = sum(socket_bytes(c.get_extra_info("socket")) for c in connections)
        trainer = Trainer(spec, WIRE_JOB_ID, directory, trainer_pool, data)
        await trainer.run(0, steps)
        now = [await trainer_pool.connect(a) for a in addrs]
        if any(a is not b for a, b in zip(now, connections)):
            raise RuntimeError(f"codec {codec}: a trainer connection was replaced mid-run; its bytes are lost")
        total = sum(socket_bytes(c.get_extra_info("socket")) for c in connections) - before
    finally:
        await trainer_pool.close()
        for service, rpc, pool in reversed(opened):
            await service.stop()
            await rpc.close()
            await pool.close()
    samples = steps * spec.batch.global_samples
    return {"bytes": total, "samples": samples, "bytes_per_sample": total / samples}


def measure_wire(raw: dict[str, Any], codecs: list[str], steps: int) -> dict[str, dict[str, Any]]:
    return {codec: asyncio.run(wire_bytes_for(raw, codec, steps)) for codec in codecs}


async def control_bytes_for(raw: dict[str, Any], peers: int, seconds: float) -> float:
    """Mean control bytes/s per stage peer of one stage of `peers` real StageServices on loopback
    (default limits), waiting for work: every byte their connections to each other carry (progress
    polls and answers; no activation, gradient or state moves), counted by the kernel on the
    polling side of each link, so each byte once."""
    spec = JobSpec.from_dict(raw)
    directory = StaticDirectory()
    opened: list[tuple[StageService, RpcServer, Pool]] = []
    try:
        for i in range(peers):
            router = Router()
            rpc = await RpcServer.serve_tcp(router, "127.0.0.1", 0)
            pool = Pool()
            addr = f"{rpc.address[0]}:{rpc.address[1]}"
            peer_id = hashlib.sha256(b"control peer %d" % i).digest()
            service = StageService(spec, WIRE_JOB_ID, 0, peer_id, StageServer(router), pool, directory,
                                   address=addr, limits=CONTROL_STAGE_LIMITS)
            await service.start()
            opened.append((service, rpc, pool))
            directory.set(WIRE_JOB_ID, 0, [*await directory.peers(WIRE_JOB_ID, 0), StagePeer(peer_id, addr, 0)])
        await asyncio.sleep(1.0)  # every link dialled
        addrs = [s.address for s, _, _ in opened]

        async def total() -> int:
            counted = 0
            for service, _, pool in opened:
                for a in addrs:
                    if a != service.address:
                        counted += socket_bytes((await pool.connect(a)).get_extra_info("socket"))
            return counted

        before, began = await total(), time.monotonic()
        await asyncio.sleep(seconds)
        return (await total() - before) / (time.monotonic() - began) / peers
    finally:
        for service, rpc, pool in reversed(opened):
            await service.stop()
            await rpc.close()
            await pool.close()


def measure_control(raw: dict[str, Any], seconds: float) -> dict[str, Any]:
    """`control_traffic`: {"2": B, "4": B, "8": B}, mean control bytes/s per stage peer; the goal
    (issue 14) is the 8-peer figure at most 1.5x the 2-peer one."""
    figures = {str(p): round(asyncio.run(control_bytes_for(raw, p, seconds)), 1) for p in CONTROL_PEERS}
    return {"control_traffic": figures,
            "control_traffic_ratio_8_to_2": round(figures["8"] / figures["2"], 3) if figures["2"] else None,
            "control_traffic_method": (f"{seconds:g} s of {', '.join(map(str, CONTROL_PEERS))} in-process stage "
                                       "peers of one stage on loopback waiting for work, default sync limits; "
                                       "TCP_INFO bytes of their links to each other, polling side")}


# ------------------------------------------------------------------------------ the local swarm


@dataclass
class ServedPeer:
    """A stage daemon of the run and the stage it is pinned to; `up` is false from its SIGKILL
    until it serves again (its stage is then not a candidate for the next kill)."""

    peer: PeerProcess
    stage: int
    up: bool = True


@dataclass
class Kill:
    at: float  # Unix time of the SIGKILL
    victim: str
    stage: int
    rejoin_s: float | None = None  # SIGKILL until it serves its stage again
    failed: str | None = None  # why the restart did not bring it back


@dataclass
class SwarmRun:
    events: list[dict[str, Any]] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    windows: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: Per no-fault window, every daemon's (sent, received) transport bytes at its start and end.
    traffic: dict[str, tuple[dict[str, tuple[float, float]], dict[str, tuple[float, float]]]] = field(
        default_factory=dict)
    skipped_ticks: int = 0  # kill ticks at which no stage had all its peers up
    startup_s: float = 0.0
    job_state: str | None = None

    def committed_by(self, t: float) -> int:
        """Steps committed at Unix time t, from the trainers' step events."""
        return max((int(e["step"]) for e in self.events if e.get("kind") == "step" and e["ts"] <= t), default=0)

    def window(self, names: tuple[str, ...], global_samples: int) -> dict[str, Any]:
        """Samples/s over the named windows together: their steps over their summed length."""
        spans = [self.windows[n] for n in names]
        steps = sum(self.committed_by(end) - self.committed_by(start) for start, end in spans)
        seconds = sum(end - start for start, end in spans)
        return {"samples_per_s": steps * global_samples / seconds, "steps": steps, "window_s": round(seconds, 2)}

    def wire(self, names: tuple[str, ...], trainer: str, global_samples: int) -> dict[str, Any]:
        """Bytes the daemons counted over the named windows, per sample committed in them."""
        trainer_bytes = swarm_sent = steps = 0.0
        for name in names:
            (start, end), (t0, t1) = self.traffic[name], self.windows[name]
            if any(end[p][i] < start[p][i] for p in start for i in (0, 1)):
                raise RuntimeError(f"a daemon's transport counters went back in window {name}: it restarted")
            trainer_bytes += sum(end[trainer]) - sum(start[trainer])
            swarm_sent += sum(end[p][0] - start[p][0] for p in start)
            steps += self.committed_by(t1) - self.committed_by(t0)
        samples = steps * global_samples
        return {"samples": int(samples), "trainer_bytes": int(trainer_bytes), "swarm_sent_bytes": int(swarm_sent),
                "trainer_bytes_per_sample": trainer_bytes / samples if samples else None,
                "swarm_bytes_per_sample": swarm_sent / samples if samples else None}


async def serve_stage(peer: PeerProcess, job: str, stage: int) -> None:
    """`swarmctl serve JOB --stage I` on that daemon, retried while it has not read the job yet."""
    await serve_when_known(peer, job, stage, discovery_s=JOB_DISCOVERY_S)


async def wait_steps(run: SwarmRun, steps: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while run.committed_by(time.time()) < steps:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the swarm committed {run.committed_by(time.time())} of {steps} warm-up steps "
                               f"in {timeout:g} s")
        await asyncio.sleep(0.2)


async def restart(swarm: LocalSwarm, target: ServedPeer, job: str, kill: Kill) -> None:
    """Bring the victim back on its stage (a restarted daemon rejoins the stages it remembers by
    itself; `job.serve` then waits for that join). A restart that fails is recorded, not raised: the
    window goes on with the stage one peer short (and that stage is never chosen again)."""
    try:
        swarm.restart(target.peer, wait=False)
        await swarm.wait_ready_async([target.peer])
        await serve_stage(target.peer, job, target.stage)
    except (SwarmError, ControlError, DaemonUnavailable) as exc:
        kill.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return
    kill.rejoin_s = time.time() - kill.at
    target.up = True


async def preempt(swarm: LocalSwarm, peers: list[ServedPeer], job: str, args: argparse.Namespace,
                  run: SwarmRun, rng: random.Random) -> None:
    """The fault window: a kill at its start and every `kill_every` s after, each victim restarting
    in its own task. Restarts still under way when the window closes are waited for (outside it),
    so the window after this one starts with every stage whole."""
    start, end = time.time(), time.monotonic() + args.fault_duration
    async with asyncio.TaskGroup() as restarts:
        tick = time.monotonic()
        while tick < end:
            await asyncio.sleep(max(0.0, tick - time.monotonic()))
            tick += args.kill_every
            whole = {s for s in range(args.stages) if all(p.up for p in peers if p.stage == s)}
            choices = [p for p in peers if p.stage in whole]
            if not choices:
                run.skipped_ticks += 1
                continue
            target = rng.choice(choices)
            swarm.kill(target.peer)
            target.up = False
            kill = Kill(time.time(), target.peer.name, target.stage)
            run.kills.append(kill)
            restarts.create_task(restart(swarm, target, job, kill), name=f"restart {target.peer.name}")
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        run.windows["faults"] = (start, time.time())


async def transport_bytes(daemons: list[PeerProcess]) -> dict[str, tuple[float, float]]:
    """Each daemon's own count of the bytes it sent and received on peer connections."""
    counted = await asyncio.gather(*(asyncio.to_thread(d.counters) for d in daemons))
    return {d.name: (c["swarmd_transport_sent_bytes_total"], c["swarmd_transport_received_bytes_total"])
            for d, c in zip(daemons, counted)}


async def no_fault_window(run: SwarmRun, name: str, seconds: float, daemons: list[PeerProcess]) -> None:
    before = await transport_bytes(daemons)
    start = time.time()
    await asyncio.sleep(seconds)
    run.windows[name] = (start, time.time())
    run.traffic[name] = (before, await transport_bytes(daemons))


async def drive(swarm: LocalSwarm, trainer: PeerProcess, servers: list[PeerProcess], raw: dict[str, Any],
                args: argparse.Namespace, run: SwarmRun) -> None:
    async with Client(trainer.socket) as client:
        job = (await client.submit(raw, [], trainers=args.trainers))["job"]
    peers = [ServedPeer(peer, i % args.stages) for i, peer in enumerate(servers)]
    daemons = [trainer, *servers]
    await asyncio.gather(*(serve_stage(p.peer, job, p.stage) for p in peers))
    async with asyncio.TaskGroup() as tg:
        follower = tg.create_task(follow_logs(trainer, job, run.events), name="follow job.logs")
        try:
            await wait_steps(run, args.warmup_steps, args.timeout)
            if args.fault_duration > 0:  # bracketed: load that drifts during the run hits both sides
                await no_fault_window(run, "no_faults_before", args.duration / 2, daemons)
                await preempt(swarm, peers, job, args, run, random.Random(args.seed))
                await no_fault_window(run, "no_faults_after", args.duration / 2, daemons)
            else:
                await no_fault_window(run, "no_faults", args.duration, daemons)
            await asyncio.sleep(1.0)  # the last step events of the window reach us
        finally:
            follower.cancel()
    async with Client(trainer.socket) as client:
        run.job_state = (await client.job(job)).get("state")
        await client.cancel(job)


def run_swarm(raw: dict[str, Any], args: argparse.Namespace, root: Path) -> tuple[SwarmRun, str]:
    """The run, and the name of the trainer's daemon (whose counters are the trainer's links)."""
    run = SwarmRun()
    settings = SwarmSettings(log_level="warning", device=args.device, env={**FAST_ENV, **PINNED_ENV}, metrics=True)
    with LocalSwarm(root, settings) as swarm:
        started = time.monotonic()
        trainer, *servers = swarm.start(1 + args.stages * args.peers_per_stage)
        run.startup_s = round(time.monotonic() - started, 2)
        try:
            asyncio.run(drive(swarm, trainer, servers, raw, args, run))
        except ExceptionGroup as group:  # the first failure is the story; the rest were cancelled by it
            raise first_leaf(group) from None
    return run, trainer.name


def first_leaf(group: BaseExceptionGroup) -> BaseException:
    first = group.exceptions[0]
    return first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


# ------------------------------------------------------------------------------------ the bench


def bench(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    local_threads = args.local_threads or torch.get_num_threads()
    torch.set_num_threads(local_threads)
    raw = job_dict(args, SWARM_STEPS)
    spec = JobSpec.from_dict(raw)
    config = {k: v for k, v in sorted(vars(args).items()) if k != "codecs"} | {"codecs": list(args.codecs)}
    report: dict[str, Any] = {"bench": "pipeline", "config": config, "cpus": os.cpu_count(),
                              "load_average_1m_at_start": round(os.getloadavg()[0], 2)}

    if args.control_seconds > 0:
        torch.set_num_threads(1)
        report.update(measure_control(raw, args.control_seconds))
        torch.set_num_threads(local_threads)
    if args.control_only:
        return report
    local = [run_local(spec, args.local_steps, device)]

    torch.set_num_threads(1)  # the wire measurement's stage peers share this process
    wire = measure_wire(raw, list(args.codecs), args.wire_steps)
    report.update(wire_report(wire, args.wire_steps))

    with tempfile.TemporaryDirectory(prefix="swarmd-pipeline-") as tmp:
        try:
            run, trainer = run_swarm(raw, args, Path(tmp))
        except (SwarmError, ControlError, DaemonUnavailable, TimeoutError) as exc:
            report["error"] = f"swarm: {type(exc).__name__}: {exc}"
            report["local"] = local[0]
            report["local_samples_per_s"] = round(local[0]["samples_per_s"], 3)
            return report
    torch.set_num_threads(local_threads)
    # Before and after the swarm, so load that others put on the machine meanwhile hits both sides.
    local.append(run_local(spec, args.local_steps, device))
    local_rate = sum(r["samples_per_s"] for r in local) / len(local)
    report["local"] = {"samples_per_s": local_rate, "before": local[0], "after": local[1]}
    report["local_samples_per_s"] = round(local_rate, 3)
    report.update(swarm_report(run, trainer, args, spec.batch.global_samples, local_rate, wire))
    report["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    return report


def wire_report(wire: dict[str, dict[str, Any]], steps: int) -> dict[str, Any]:
    """The in-process wire bytes per sample by codec, and each codec's ratio to `none` (if measured)."""
    report: dict[str, Any] = {"wire_bytes_per_sample": {c: round(w["bytes_per_sample"], 1) for c, w in wire.items()}}
    if "none" in wire:
        report["wire_ratio_to_none"] = {c: round(w["bytes_per_sample"] / wire["none"]["bytes_per_sample"], 4)
                                        for c, w in wire.items()}
    report["wire_method"] = ("TCP_INFO bytes_acked + bytes_received of an in-process trainer's loopback "
                             "connections to one StageService per stage, hello excluded; "
                             f"{steps} steps per codec, compute RPCs and stage.info polls")
    return report


def swarm_report(run: SwarmRun, trainer: str, args: argparse.Namespace, gs: int, local_rate: float,
                 wire: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The swarm's figures: its no-fault rate (and its ratio to the local one), its own wire bytes
    (cross-checked against the in-process figure for its codec), and the fault window's."""
    calm = tuple(n for n in ("no_faults", "no_faults_before", "no_faults_after") if n in run.windows)
    no_faults = run.window(calm, gs)
    report: dict[str, Any] = {
        "swarm": {**no_faults, "peers": args.stages * args.peers_per_stage, "trainers": args.trainers,
                  "startup_s": run.startup_s, "job_state": run.job_state,
                  "windows": {n: run.window((n,), gs) for n in calm}},
        "swarm_samples_per_s": round(no_faults["samples_per_s"], 3),
        "swarm_to_local_ratio": round(no_faults["samples_per_s"] / local_rate, 4)}
    counted = run.wire(calm, trainer, gs)
    per_sample = counted["trainer_bytes_per_sample"]
    report["swarm"]["wire"] = {"codec": args.codec, **{k: round(v, 1) if isinstance(v, float) else v
                                                       for k, v in counted.items()}}
    report["swarm_wire_bytes_per_sample"] = per_sample and round(per_sample, 1)
    if args.codec in wire and per_sample:  # the cross-check: daemons' counters against the kernel's
        report["swarm_wire_to_in_process"] = round(per_sample / wire[args.codec]["bytes_per_sample"], 4)
    if "faults" in run.windows:
        report["faults"] = faults_report(run, args, gs, no_faults)
    return report


def faults_report(run: SwarmRun, args: argparse.Namespace, gs: int, no_faults: dict[str, Any]) -> dict[str, Any]:
    """The fault window's rate (and its ratio to the no-fault one), the preemptions and the rejoins."""
    faults = run.window(("faults",), gs)
    rejoins = [k.rejoin_s for k in run.kills if k.rejoin_s is not None]
    return {
        **faults, "preemptions": len(run.kills), "kill_every_s": args.kill_every,
        "ratio_to_no_faults": (round(faults["samples_per_s"] / no_faults["samples_per_s"], 4)
                               if no_faults["samples_per_s"] > 0 else None),
        "rejoined": len(rejoins), "mean_rejoin_s": round(sum(rejoins) / len(rejoins), 2) if rejoins else None,
        "skipped_ticks": run.skipped_ticks,
        "restart_failures": sum(1 for k in run.kills if k.failed),
        "victims": [{"peer": k.victim, "stage": k.stage, "rejoin_s": k.rejoin_s and round(k.rejoin_s, 2),
                     "failed": k.failed} for k in run.kills],
    }


def _codecs(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in CODECS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown codec(s) {unknown or text!r}; known: {', '.join(CODECS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"the smallest size: {QUICK}")
    size = p.add_argument_group("the job (the same spec on every side)")
    size.add_argument("--stages", type=int, default=4)
    size.add_argument("--d-model", type=int, default=128)
    size.add_argument("--n-heads", type=int, default=4)
    size.add_argument("--layers-per-stage", type=int, default=1)
    size.add_argument("--seq-len", type=int, default=128)
    size.add_argument("--global-samples", type=int, default=32, help="samples per optimizer step")
    size.add_argument("--microbatch-samples", type=int, default=4)
    size.add_argument("--in-flight", type=int, default=4, help="microbatches in flight per trainer")
    size.add_argument("--codec", default="fp16+lz4", choices=CODECS, help="the swarm's wire codec (both directions)")
    size.add_argument("--seed", type=int, default=0, help="init, data order and which peers get killed")
    swarm = p.add_argument_group("the swarm")
    swarm.add_argument("--peers-per-stage", type=int, default=2)
    swarm.add_argument("--trainers", type=int, default=1, help="trainer shards in the submitting daemon")
    swarm.add_argument("--warmup-steps", type=int, default=5, help="steps committed before the first window")
    swarm.add_argument("--duration", type=float, default=60.0, help="seconds of the no-fault window")
    swarm.add_argument("--fault-duration", type=float, default=80.0, help="seconds of the fault window; 0: none")
    swarm.add_argument("--kill-every", type=float, default=20.0, help="seconds between SIGKILLs")
    swarm.add_argument("--timeout", type=float, default=600.0, help="give up waiting for the warm-up steps")
    swarm.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: the daemons' and the local run's")
    other = p.add_argument_group("local run and wire bytes")
    other.add_argument("--local-steps", type=int, default=20, help="timed steps of the one-process run")
    other.add_argument("--local-threads", type=int, default=1,
                       help="its torch threads (default 1, as each daemon's stage; 0: torch's default)")
    other.add_argument("--wire-steps", type=int, default=2, help="steps per codec of the wire measurement")
    other.add_argument("--codecs", type=_codecs, default=DEFAULT_CODECS, help="comma-separated")
    other.add_argument("--control-seconds", type=float, default=10.0,
                       help="seconds per peer count of the control-traffic figure; 0: skip it")
    other.add_argument("--control-only", action="store_true", help="measure only the control-traffic figure")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every bad flag is refused here, before a process starts or a step is taken."""
    for name in ("stages", "d_model", "n_heads", "layers_per_stage", "seq_len", "global_samples",
                 "microbatch_samples", "in_flight", "peers_per_stage", "trainers", "local_steps", "wire_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("warmup_steps", "local_threads"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be at least 0, got {getattr(args, name)}")
    if args.duration <= 0 or args.fault_duration < 0 or args.kill_every <= 0 or args.timeout <= 0:
        parser.error("--duration, --kill-every and --timeout must be positive, --fault-duration at least 0")
    if args.fault_duration > 0 and args.peers_per_stage < 2:
        parser.error("faults need --peers-per-stage >= 2: a stage whose only peer dies loses its parameters")
    if args.trainers > args.global_samples // args.microbatch_samples:
        parser.error("--trainers cannot exceed the microbatches per step (global / microbatch samples)")
    if args.device != "cpu" and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        parser.error(f"--device {args.device}: needs a CUDA device and a CUDA build of torch (or use cpu)")
    try:
        JobSpec.from_dict(job_dict(args, SWARM_STEPS))
    except ValueError as exc:
        parser.error(f"the job these flags describe is invalid: {exc}")


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """With --quick, QUICK replaces the defaults; anything given on the command line still wins."""
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    check_args(parser, args)
    install_signal_handlers()
    result = bench(args)
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
