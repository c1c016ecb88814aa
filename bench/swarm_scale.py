"""A swarm of dozens of real daemons: per-daemon control traffic, memory and step time as it grows.

    .venv/bin/python bench/swarm_scale.py [--daemons 8,16,32] [--idle 20] [--churn 60] [--kill-every 20]

For each size N, a fresh `swarmd.swarmproc.LocalSwarm` of N daemons on loopback with automatic
joining (`jobs.serve = "all"`) and rebalancing on, liveness and discovery at the local-swarm pace
(FAST_ENV):

1. idle: once every daemon is up, `--idle` seconds with no job: each daemon's own transport byte
   counters (sent + received, from its metrics endpoint) over the window are its control traffic
   (DHT, liveness pings, discovery gossip: nothing else runs);
2. training: daemon 0 submits a tiny 8-stage job with 2 trainer shards; the others join stages on
   their own. After `--warmup-steps` commits, `--churn` seconds in which every `--kill-every`
   seconds a random daemon other than the trainers' is SIGKILLed and restarted (same identity and
   port). Reported: the median step time in the window, whether every committed step was exact
   (every stage summed exactly the global batch, no duplicates: samples, not bits; the stages
   all-reduce at the default codec, fp16), and each daemon's RSS.

`control_growth` is the median per-daemon idle control bytes/s at the largest N over that at the
smallest. Both windows also put bytes on methods: each daemon's `swarmd_rpc_served_bytes_total`
(requests it served and its replies, by method) gives `control_by_method`, the mean per-daemon
bytes/s of each method (DHT, liveness pings, gossip, and while training stage.info, stage sync and
commit polls); a call is served by one daemon, so the swarm's sum of served bytes is its traffic
once. `training_control_bytes_per_s` is the median per daemon of the served bytes of every method
but the data plane's (DATA_METHODS: activations, gradients, state downloads, gradient averaging).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
sys.path.insert(0, str(BENCH.parent))

from swarmd.client import Client, ControlError, DaemonUnavailable  # noqa: E402
from swarmd.swarmproc import (FAST_ENV, LocalSwarm, PeerProcess, SwarmError, SwarmSettings,  # noqa: E402
                              install_signal_handlers)

STAGES = 8
TRAINERS = 2
JOB = {
    "name": "swarm-scale", "seed": 0, "steps": 1_000_000,
    "model": {"arch": "transformer-lm", "d_model": 32, "n_heads": 2, "layers_per_stage": 1, "vocab": 256,
              "dropout": 0.0},
    "data": {"files": ["{stdlib}/*.py"], "seq_len": 16},
    "batch": {"global_samples": 16, "microbatch_samples": 2},
    "optim": {"name": "adamw", "lr": 1e-3, "schedule": "constant"},
    "wire": {"activations": "fp16+lz4", "gradients": "fp16+lz4"},
    "pipeline": {"stages": STAGES, "microbatches_in_flight": 4},
    "checkpoint": {"every_steps": 0},
}
ENV = {**FAST_ENV, "SWARMD_JOBS_SERVE": "all"}
#: Methods that move tensors a step needs (activations, gradients, a stage's state, averaged
#: gradients): the data plane. Every other peer method is control traffic.
DATA_METHODS = frozenset({"stage.forward", "stage.backward", "stage.forward_backward", "stage.state",
                          "stage.sync.reduce", "stage.sync.gather"})
SERVED = "swarmd_rpc_served_bytes_total"
#: The warm-up steps not committed within this (daemons joining stages on their own, on a busy
#: machine) mean the swarm is stuck.
WARMUP_TIMEOUT_S = 600.0


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def traffic(daemons: list[PeerProcess]) -> dict[str, float]:
    """Each live daemon's sent + received transport bytes (its own counters)."""
    out = {}
    for d in daemons:
        try:
            c = d.counters()
        except OSError:
            continue
        out[d.name] = c["swarmd_transport_sent_bytes_total"] + c["swarmd_transport_received_bytes_total"]
    return out


def served(daemons: list[PeerProcess]) -> dict[str, dict[str, float]]:
    """Each live daemon's served bytes of its peer methods (in + out), by method."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for d in daemons:
        if d.metrics_port is None:
            continue
        try:
            with urllib.request.urlopen(f"http://{d.host}:{d.metrics_port}/metrics", timeout=10) as reply:
                text = reply.read().decode()
        except OSError:
            continue
        methods: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == SERVED and sample.labels.get("service") == "peer":
                    method = sample.labels["method"]
                    methods[method] = methods.get(method, 0.0) + sample.value
        out[d.name] = methods
    return out


def by_method(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], seconds: float) -> dict:
    """Mean per-daemon served bytes/s of each method, over daemons counted at both ends that did not
    restart between (no counter went back)."""
    kept = [n for n in before if n in after and all(after[n].get(m, 0.0) >= v for m, v in before[n].items())]
    if not kept:
        return {}
    methods = sorted({m for n in kept for m in after[n]})
    rates = {m: sum(after[n].get(m, 0.0) - before[n].get(m, 0.0) for n in kept) / len(kept) / seconds
             for m in methods}
    return {m: round(r, 1) for m, r in sorted(rates.items(), key=lambda kv: -kv[1]) if r > 0}


def control_rates(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], seconds: float) -> list:
    """Per daemon: served bytes/s of every method outside the data plane."""
    rates = []
    for n in before:
        if n not in after or any(after[n].get(m, 0.0) < v for m, v in before[n].items()):
            continue
        rates.append(sum(v - before[n].get(m, 0.0) for m, v in after[n].items() if m not in DATA_METHODS) / seconds)
    return rates


def per_daemon_rate(before: dict[str, float], after: dict[str, float], seconds: float) -> list[float]:
    """Bytes/s of each daemon counted at both ends whose counter did not go back (a restart)."""
    return [(after[n] - before[n]) / seconds for n in before if n in after and after[n] >= before[n]]


async def step_events(trainer: PeerProcess, job: str, events: list[dict]) -> None:
    async with Client(trainer.socket, timeout=3600.0) as client:
        async for event in client.logs(job, follow=True):
            if event.get("kind") == "step":
                events.append(event)


def exact(event: dict) -> bool:
    """Every stage summed exactly the global batch, with no microbatch counted twice. A stage whose
    peers reported no record of the step (-1) makes it unverified, so not exact either."""
    return (all(s == JOB["batch"]["global_samples"] for s in event.get("stage_samples", []))
            and not any(event.get("duplicates", [])))


def inexact(events: list[dict], limit: int = 5) -> list[dict]:
    """The first few steps that were not exact, as their events gave them: the evidence."""
    return [{"step": e["step"], "stage_samples": e.get("stage_samples"), "duplicates": e.get("duplicates")}
            for e in events if not exact(e)][:limit]


async def train_with_churn(swarm: LocalSwarm, daemons: list[PeerProcess], args: argparse.Namespace) -> dict:
    trainer, others = daemons[0], daemons[1:]
    async with Client(trainer.socket) as client:
        job = (await client.submit(JOB, [], trainers=TRAINERS))["job"]
    events: list[dict] = []
    rng = random.Random(0)
    async with asyncio.TaskGroup() as tg:
        follower = tg.create_task(step_events(trainer, job, events))
        try:
            deadline = time.monotonic() + WARMUP_TIMEOUT_S
            while len({e["step"] for e in events}) < args.warmup_steps:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(events)} step events in {WARMUP_TIMEOUT_S:g} s")
                await asyncio.sleep(0.5)
            start, before, served_before = time.time(), traffic(daemons), served(daemons)
            rss = [r for r in (rss_mb(d.pid) for d in daemons if d.alive) if r is not None]
            end = time.monotonic() + args.churn
            kills = 0
            while time.monotonic() < end:
                await asyncio.sleep(min(args.kill_every, max(0.0, end - time.monotonic())))
                if time.monotonic() >= end:
                    break
                victim = rng.choice([d for d in others if d.alive])
                swarm.kill(victim)
                swarm.restart(victim, wait=False)
                kills += 1
            seconds = time.time() - start
            after, served_after = traffic(daemons), served(daemons)
        finally:
            follower.cancel()
    async with Client(trainer.socket) as client:
        await client.cancel(job)
    window = [e for e in events if start <= e["ts"] <= start + seconds]
    commits = sorted({e["step"]: e["ts"] for e in window}.items())
    steps = [b[1] - a[1] for a, b in zip(commits, commits[1:])]
    return {"step_s": round(statistics.median(steps), 3) if steps else None, "steps_in_window": len(commits),
            "exact": all(exact(e) for e in events), "step_events": len(events), "kills": kills,
            "inexact_steps": inexact(events),
            "rss_mb_median": round(statistics.median(rss), 1), "rss_mb_max": round(max(rss), 1),
            "training_bytes_per_s_median": round(statistics.median(per_daemon_rate(before, after, seconds)), 1),
            "training_control_bytes_per_s": round(statistics.median(control_rates(served_before, served_after,
                                                                                 seconds) or [0.0]), 1),
            "training_control_by_method": by_method(served_before, served_after, seconds)}


def one_size(n: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    settings = SwarmSettings(log_level="warning", env=ENV, metrics=True)
    started = time.monotonic()
    with LocalSwarm(root / f"n{n}", settings) as swarm:
        daemons = swarm.start(n)
        startup = time.monotonic() - started
        time.sleep(args.settle)
        before, served_before, t0 = traffic(daemons), served(daemons), time.time()
        time.sleep(args.idle)
        after, served_after, seconds = traffic(daemons), served(daemons), time.time() - t0
        idle = per_daemon_rate(before, after, seconds)
        row = {"daemons": n, "startup_s": round(startup, 1),
               "control_bytes_per_s": round(statistics.median(idle), 1),
               "control_bytes_per_s_max": round(max(idle), 1),
               "control_by_method": by_method(served_before, served_after, seconds)}
        if args.churn > 0:
            try:
                row.update(asyncio.run(train_with_churn(swarm, daemons, args)))
            except (SwarmError, ControlError, DaemonUnavailable, TimeoutError) as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
    return row


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def scale(args: argparse.Namespace) -> dict[str, Any]:
    rows = {}
    with tempfile.TemporaryDirectory(prefix="swarmd-scale-") as tmp:
        for n in args.daemons:
            try:
                rows[str(n)] = one_size(n, args, Path(tmp))
            except SwarmError as exc:  # e.g. too little memory for N daemons: said, and the next size tried
                rows[str(n)] = {"daemons": n, "error": f"SwarmError: {str(exc)[:500]}"}
            print(json.dumps(rows[str(n)]), file=sys.stderr, flush=True)
    measured = [n for n in sorted(args.daemons) if "control_bytes_per_s" in rows[str(n)]]
    growth = {}
    if len(measured) >= 2:
        smallest, largest = str(measured[0]), str(measured[-1])
        ratio = rows[largest]["control_bytes_per_s"] / rows[smallest]["control_bytes_per_s"]
        growth[f"control_growth_{smallest}_to_{largest}"] = round(ratio, 3)
    return {"daemons": rows, **growth,
            "exact": all(r.get("exact", False) for r in rows.values()) if args.churn > 0 else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--daemons", type=_ints, default=(8, 16, 32))
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after start-up before the idle window")
    parser.add_argument("--idle", type=float, default=20.0)
    parser.add_argument("--churn", type=float, default=180.0, help="seconds of the training window; 0: no job")
    parser.add_argument("--kill-every", type=float, default=20.0)
    parser.add_argument("--warmup-steps", type=int, default=3)
    args = parser.parse_args()
    if min(args.daemons) < STAGES or len(args.daemons) < 2:
        parser.error(f"need at least two sizes of at least {STAGES} daemons (one per stage)")
    install_signal_handlers()
    print(json.dumps({"bench": "swarm_scale", **scale(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
