"""`make demo`: a local swarm trains a byte-level LM through preemptions, and a plot shows it did not hurt.

Several `swarmd` processes start on loopback, each its own peer (own state dir, identity, socket and
port), chained by `--bootstrap`. The job (examples/demo.toml: a small GPT on the Python standard
library's own source) is submitted to the first daemon, whose trainer drives it; the others serve its
stages. While it trains, every `--preempt-every` seconds a random stage peer is SIGKILLed (only from
a stage that keeps another peer: a stage whose last peer dies loses its parameters) and a fresh peer
joins and takes the weakest stage. The bar shows step, loss, tokens/s and peers per stage; at the end
come a summary table and a PNG of the swarm's loss against a single-process baseline of the same
spec (`swarmd.reference`), both against samples seen. Last, the trained model is exported
(`swarmctl export`: model.safetensors + config.json under `out/model`), loaded alone into one
plain module, and asked for a short sample of text, which is printed.

Every process it starts belongs to a `swarmd.swarmproc.LocalSwarm`, so all of them are gone when it
exits: normally, on an error, on Ctrl-C or on SIGTERM.

    python -m swarmd.demo [--peers 6] [--steps N] [--preempt-every 15] [--out demo-out]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import random
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from swarmd.client import FOLLOW_TIMEOUT_S, Client, ControlError, DaemonUnavailable
from swarmd.exitcodes import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK
from swarmd.job.errors import DataError, SpecError
from swarmd.job.spec import JobSpec
from swarmd.plot import LossCurve, baseline_curve, curve_from_events, curve_from_reference, render, write_events
from swarmd.swarmproc import (LocalSwarm, PeerProcess, SwarmError, SwarmSettings, install_signal_handlers,
                              serve_when_known)

log = logging.getLogger(__name__)

DEFAULT_SPEC = Path(__file__).resolve().parent.parent / "examples" / "demo.toml"
EXIT_INTERRUPTED = 130
#: How often the bar's peers-per-stage are read from `job.get` while the job waits for its first step.
WATCH_INTERVAL_S = 1.0
#: Fresh peers tried in turn to replace one preempted peer before the run is declared failed.
REPLACEMENT_ATTEMPTS = 3
#: How long a peer may take to find a just-submitted job in the DHT before `job.serve` gives up.
JOB_DISCOVERY_S = 30.0
#: How long the export after the job's end asks again for a stage caught between leaving and its final checkpoint.
EXPORT_WAIT_S = 30.0
#: What the exported model is asked to continue at the end, and for how many bytes.
SAMPLE_PROMPT = "def "
SAMPLE_TOKENS = 160


@dataclass
class Preemption:
    at: float  # Unix time of the SIGKILL
    victim: str
    stage: int
    done: int  # steps committed before it
    replacement: str = ""
    rejoin_s: float | None = None  # SIGKILL until the replacement serves


@dataclass
class Progress:
    steps: int
    started: float = field(default_factory=time.time)
    done: int = 0  # steps committed
    loss: float | None = None
    tokens_per_s: float | None = None
    peers_per_stage: list[int] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)


class Bar:
    """One redrawn line on a terminal; elsewhere (pipes, CI logs, NO_COLOR) a plain line per tenth."""

    def __init__(self, out: TextIO, live: bool) -> None:
        self.out, self.live = out, live
        self._printed_tenth = -1
        self._drawn = False

    def draw(self, p: Progress) -> None:
        done = p.done
        if self.live:
            width = 24
            filled = int(width * done / max(p.steps, 1))
            self.out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self._fields(p)}\x1b[K")
            self.out.flush()
            self._drawn = True
        elif done * 10 // max(p.steps, 1) > self._printed_tenth:
            self._printed_tenth = done * 10 // max(p.steps, 1)
            self.out.write(self._fields(p) + "\n")
            self.out.flush()

    def note(self, text: str, p: Progress) -> None:
        """A message line (a preemption, a join) above the bar."""
        self.out.write(("\r\x1b[K" if self.live else "") + text + "\n")
        if self.live:
            self.draw(p)

    def finish(self) -> None:
        if self.live and self._drawn:
            self._drawn = False
            self.out.write("\n")
            self.out.flush()

    @staticmethod
    def _fields(p: Progress) -> str:
        loss = "-" if p.loss is None else f"{p.loss:.3f}"
        tps = "-" if p.tokens_per_s is None else f"{p.tokens_per_s:,.0f}"
        peers = "·".join(str(n) for n in p.peers_per_stage) or "-"
        return (f"step {p.done}/{p.steps}  loss {loss}  tok/s {tps}  peers/stage {peers}  "
                f"preempted {len(p.preemptions)}  {_clock(time.time() - p.started)}")


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s"


# ---------------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class Plan:
    spec: JobSpec
    raw: dict[str, Any]  # what is submitted: the TOML as parsed, with --steps applied
    base_dir: Path
    peers: int
    preempt_every_s: float
    timeout_s: float
    rng: random.Random


async def run_job(swarm: LocalSwarm, trainer: PeerProcess, plan: Plan, progress: Progress, bar: Bar) -> dict[str, Any]:
    """Submit, spread the stages, then follow the job to its end while preempting; the final job.get."""
    async with Client(trainer.socket) as client:
        job = (await client.submit(plan.raw, []))["job"]
    servers = [p for p in swarm.live() if p is not trainer]
    for i, peer in enumerate(servers):
        await _serve(peer, job, i % plan.spec.pipeline.stages, bar, progress)
    try:
        async with asyncio.timeout(plan.timeout_s), asyncio.TaskGroup() as tg:
            side = [tg.create_task(_watch(trainer, job, progress, bar), name="watch")]
            if plan.preempt_every_s > 0:
                side.append(tg.create_task(_preempt(swarm, trainer, job, plan, progress, bar), name="preempt"))
            try:
                await _follow(trainer, job, progress, bar)
            finally:
                for task in side:
                    task.cancel()
    except ExceptionGroup as group:  # the first failure is the story; the rest were cancelled by it
        raise group.exceptions[0] from None
    async with Client(trainer.socket) as client:
        return await client.job(job)


async def _follow(trainer: PeerProcess, job: str, progress: Progress, bar: Bar) -> None:
    async with Client(trainer.socket, timeout=FOLLOW_TIMEOUT_S) as client:
        async for event in client.logs(job, follow=True):
            progress.events.append(event)
            if event.get("kind") == "step":
                progress.done = max(progress.done, int(event["step"]))
                if event.get("peers_per_stage"):
                    progress.peers_per_stage = list(event["peers_per_stage"])
                progress.loss = event["loss"] if event.get("loss") is not None else progress.loss
                progress.tokens_per_s = event.get("tokens_per_s") or progress.tokens_per_s
                bar.draw(progress)
            elif event.get("kind") in ("warning", "info") and event.get("message"):
                bar.note(f"  {event['kind']}: {event['message']}", progress)


async def _watch(trainer: PeerProcess, job: str, progress: Progress, bar: Bar) -> None:
    """Peers per stage from `job.get` until the first step; from then on the step events carry the
    trainer's own count, which is the truth (the DHT lists a dead peer until its record expires)."""
    while not progress.done:
        try:
            async with Client(trainer.socket) as client:
                view = await client.job(job)
            progress.peers_per_stage = [len(s["peers"]) for s in view["stages"]]
            bar.draw(progress)
        except (ControlError, DaemonUnavailable) as exc:
            log.debug("job.get: %s", exc)
        await asyncio.sleep(WATCH_INTERVAL_S)


async def _serve(peer: PeerProcess, job: str, stage: int | None, bar: Bar, progress: Progress) -> int | None:
    """Ask the peer to serve a stage (None: the weakest), its stage; asked again while the peer has
    not read the job's record from the DHT (`serve_when_known`). A peer that cannot serve is noted
    and skipped."""
    try:
        return (await serve_when_known(peer, job, stage, discovery_s=JOB_DISCOVERY_S))["stage"]
    except ControlError as exc:
        if exc.code == "not_available":  # these daemons cannot serve stages: the job would wait forever
            raise
        bar.note(f"  {peer.name} could not serve stage {stage}: {exc}", progress)
        return None
    except DaemonUnavailable as exc:  # e.g. a busy machine's daemon past the call timeout: note it, go on
        bar.note(f"  {peer.name} could not serve stage {stage}: {exc}", progress)
        return None


async def _preempt(swarm: LocalSwarm, trainer: PeerProcess, job: str, plan: Plan, progress: Progress,
                   bar: Bar) -> None:
    """At a fixed rate, SIGKILL a random stage peer whose stage keeps another live one; a fresh peer
    replaces it on the same stage, joining in its own task so a slow join does not slow the rate."""
    async with asyncio.TaskGroup() as joins:
        next_kill = time.monotonic() + plan.preempt_every_s
        while True:
            await asyncio.sleep(max(0.0, next_kill - time.monotonic()))
            next_kill += plan.preempt_every_s
            try:
                async with Client(trainer.socket) as client:
                    view = await client.job(job)
            except (ControlError, DaemonUnavailable) as exc:  # one missed look skips one round, as _watch does
                bar.note(f"  no preemption this round: job.get failed: {exc}", progress)
                continue
            victim, stage = _choose_victim(swarm, trainer, view, plan.rng)
            if victim is None:
                bar.note("  no stage has a spare live peer to preempt this round", progress)
                continue
            swarm.kill(victim)
            event = Preemption(time.time(), victim.name, stage, progress.done)
            progress.preemptions.append(event)
            bar.note(f"  preempted {victim.name} (stage {stage}, SIGKILL) after step {progress.done}", progress)
            joins.create_task(_replace(swarm, job, event, bar, progress), name=f"replace {victim.name}")


def _choose_victim(swarm: LocalSwarm, trainer: PeerProcess, view: dict[str, Any],
                   rng: random.Random) -> tuple[PeerProcess | None, int]:
    """A live peer of ours from a stage with at least two live peers (the DHT may still list dead ones)."""
    by_id = {p.peer_id: p for p in swarm.live() if p is not trainer and p.peer_id}
    choices = []
    for stage in view["stages"]:
        live = [by_id[q["peer_id"]] for q in stage["peers"] if q["peer_id"] in by_id]
        if len(live) > 1:
            choices += [(peer, stage["stage"]) for peer in live]
    if not choices:
        return None, -1
    return rng.choice(sorted(choices, key=lambda c: c[0].name))


async def _replace(swarm: LocalSwarm, job: str, event: Preemption, bar: Bar, progress: Progress) -> None:
    """A fresh peer on the victim's stage; one that fails to start is reported and another is tried."""
    for attempt in range(1, REPLACEMENT_ATTEMPTS + 1):
        fresh = swarm.add(wait=False)
        event.replacement = fresh.name
        try:
            await swarm.wait_ready_async([fresh])
            break
        except SwarmError as exc:
            swarm.kill(fresh)
            if attempt == REPLACEMENT_ATTEMPTS:
                raise
            bar.note(f"  {fresh.name} did not start ({str(exc).splitlines()[0]}); trying another", progress)
    joined = await _serve(fresh, job, event.stage, bar, progress)
    if joined is None:
        return  # noted by _serve; the peer runs on, serving nothing
    event.rejoin_s = time.time() - event.at
    bar.note(f"  {fresh.name} joined and serves stage {joined} ({event.rejoin_s:.1f} s after the kill)", progress)


# ---------------------------------------------------------------------------------- summary


def preemption_marks(preemptions: list[Preemption], global_samples: int) -> list[float]:
    """Where each kill falls on the samples axis: after the steps committed before it."""
    return [p.done * global_samples for p in preemptions]


def load_baseline(plan: Plan, out: Path, steps: int) -> tuple[LossCurve, float]:
    """The baseline and its training time; reused when a previous run of the same spec left it in `out`."""
    digest = hashlib.sha256(plan.spec.to_msgpack()).hexdigest()[:12]
    cache = out / f"baseline-{digest}.json"
    gs, label = plan.spec.batch.global_samples, "baseline (one process)"
    if cache.exists():
        saved = json.loads(cache.read_text())
        if len(saved["losses"]) >= steps:
            share = steps / len(saved["losses"])
            return curve_from_reference({"losses": saved["losses"][:steps]}, gs, label), saved["wall_s"] * share
    started = time.monotonic()
    curve = baseline_curve(plan.spec, plan.base_dir, steps=steps)
    wall_s = time.monotonic() - started
    cache.write_text(json.dumps({"job": plan.spec.name, "steps": steps, "losses": list(curve.losses),
                                 "wall_s": wall_s}) + "\n")
    return curve, wall_s


def summary_table(rows: list[tuple[str, str, str]]) -> str:
    width = max(len(r[0]) for r in rows) + 2
    col = max(len(r[1]) for r in rows) + 3
    lines = [f"{'':<{width}}{'swarm':<{col}}baseline"]
    lines += [f"{name:<{width}}{swarm:<{col}}{base}" for name, swarm, base in rows]
    return "\n".join(lines)


def summarize(plan: Plan, progress: Progress, final: dict[str, Any], swarm_curve: LossCurve,
              baseline: LossCurve | None, wall_s: float, baseline_s: float, plot: Path) -> tuple[str, dict]:
    gs = plan.spec.batch.global_samples
    swarm_final = swarm_curve.final_loss()
    base_final = baseline.final_loss() if baseline else None
    rejoins = [p.rejoin_s for p in progress.preemptions if p.rejoin_s is not None]
    data = {
        "job": final.get("job"), "state": final.get("state"), "steps": len(swarm_curve.steps),
        "swarm_final_loss": swarm_final, "baseline_final_loss": base_final,
        "final_loss_ratio": swarm_final / base_final if base_final else None,
        "preemptions": len(progress.preemptions), "swarm_wall_s": wall_s,
        "swarm_samples_per_s": len(swarm_curve.steps) * gs / wall_s if wall_s > 0 else None,
        "baseline_samples_per_s": len(baseline.steps) * gs / baseline_s if baseline and baseline_s > 0 else None,
        "mean_rejoin_s": sum(rejoins) / len(rejoins) if rejoins else None,
        "peers_per_stage_at_end": progress.peers_per_stage, "plot": str(plot),
    }
    base = "-" if base_final is None else f"{base_final:.4f}"
    rows = [
        ("state", str(data["state"]), ""),
        ("steps", str(data["steps"]), str(len(baseline.steps)) if baseline else "-"),
        ("final loss", f"{swarm_final:.4f}", base),
        ("loss ratio", "-" if data["final_loss_ratio"] is None else f"{data['final_loss_ratio']:.3f}", "1"),
        ("wall time", _clock(wall_s), _clock(baseline_s) if baseline else "-"),
        ("samples/s", f"{data['swarm_samples_per_s'] or 0:.1f}",
         "-" if data["baseline_samples_per_s"] is None else f"{data['baseline_samples_per_s']:.1f}"),
        ("preemptions", str(len(progress.preemptions)), "-"),
        ("rejoin (mean)", "-" if not rejoins else f"{data['mean_rejoin_s']:.1f} s", "-"),
        ("peers/stage", "·".join(map(str, data["peers_per_stage_at_end"])) or "-", "-"),
        ("plot", str(plot), ""),
    ]
    return summary_table(rows), data


# ---------------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m swarmd.demo", description=__doc__.splitlines()[0])
    p.add_argument("--spec", type=Path, default=DEFAULT_SPEC, metavar="JOB.toml", help="job spec (default: %(default)s)")
    p.add_argument("--peers", type=int, default=6, metavar="N",
                   help="stage peers besides the trainer's daemon (default 6: two per stage)")
    p.add_argument("--steps", type=int, metavar="N", help="optimizer steps (default: the spec's)")
    p.add_argument("--preempt-every", type=float, default=15.0, metavar="S",
                   help="seconds between preemptions; 0 for none (default 15)")
    p.add_argument("--out", type=Path, default=Path("demo-out"), metavar="DIR",
                   help="plot, events, summary and the peers' state dirs and logs (default ./demo-out)")
    p.add_argument("--seed", type=int, default=0, help="which peers get preempted (default 0)")
    p.add_argument("--no-baseline", action="store_true", help="skip the single-process baseline")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                   help="give up (and stop everything) after this long (default 1800)")
    return p


def make_plan(args: argparse.Namespace) -> Plan:
    """Read and validate the spec before any process starts: bad input costs nothing."""
    if args.peers < 1:
        raise SpecError("--peers", "at least one stage peer is needed")
    try:
        raw = tomllib.loads(args.spec.read_text())
    except OSError as exc:
        raise SpecError("<file>", f"{args.spec}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError("<toml>", f"{args.spec}: {exc}") from None
    if args.steps is not None:
        raw["steps"] = args.steps
    spec = JobSpec.from_dict(raw)
    if args.peers < spec.pipeline.stages:
        raise SpecError("--peers", f"{spec.pipeline.stages} stages need at least {spec.pipeline.stages} peers")
    return Plan(spec, raw, args.spec.resolve().parent, args.peers, args.preempt_every, args.timeout,
                random.Random(args.seed))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("transport").setLevel(logging.CRITICAL)
    try:
        plan = make_plan(args)
    except SpecError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    install_signal_handlers()
    bar = Bar(sys.stdout, sys.stdout.isatty() and not os.environ.get("NO_COLOR"))
    progress = Progress(plan.spec.steps)
    try:
        try:
            final, wall_s = _train(plan, out, progress, bar)
        finally:
            bar.finish()
            write_events(progress.events, out / "events.jsonl")
        return _report(plan, args, out, progress, final, wall_s)
    except KeyboardInterrupt:
        print("demo: interrupted; every peer it started has been stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (SwarmError, ControlError, DaemonUnavailable, TimeoutError) as exc:
        print(f"demo: {type(exc).__name__}: {exc}\n(peer logs are under {out / 'swarm'})", file=sys.stderr)
        return EXIT_FAILURE


def _train(plan: Plan, out: Path, progress: Progress, bar: Bar) -> tuple[dict[str, Any], float]:
    with LocalSwarm(out / "swarm", SwarmSettings()) as swarm:
        print(f"starting {plan.peers + 1} swarmd peers on loopback (state and logs in {out / 'swarm'}) ...", flush=True)
        trainer, *_ = swarm.start(plan.peers + 1)
        chaos = f"a peer preempted every {plan.preempt_every_s:g} s" if plan.preempt_every_s > 0 else "no preemptions"
        print(f"training {plan.spec.name}: {plan.spec.steps} steps, {plan.spec.pipeline.stages} stages, "
              f"{plan.spec.batch.global_samples} samples/step; {chaos}", flush=True)
        started = time.monotonic()
        progress.started = time.time()
        final = asyncio.run(run_job(swarm, trainer, plan, progress, bar))
        wall_s = time.monotonic() - started
        if final.get("state") == "done":
            export_model(swarm, trainer, final["job"], out / "model")
        return final, wall_s


def export_model(swarm: LocalSwarm, trainer: PeerProcess, job: str, out: Path) -> None:
    """`swarmctl export` of the finished job into `out`, with every peer's state dir to fall back on.
    Just after the end a stage may be in between (its announcement withdrawn, its final checkpoint
    not yet written): a missing stage is asked for again, for at most EXPORT_WAIT_S."""
    from swarmd.exporter import export_command
    from swarmd.model.export import ExportError

    args = argparse.Namespace(socket=trainer.socket, timeout=60.0, job=job, out=out,
                              state_dir=[p.state_dir for p in swarm.peers])
    deadline = time.monotonic() + EXPORT_WAIT_S
    while True:
        try:
            result = export_command(args)
            break
        except ExportError as exc:
            if time.monotonic() >= deadline:
                print(f"demo: export: {exc}", file=sys.stderr)
                return
            time.sleep(0.5)
    print(f"exported the trained model at step {result['step']} to {out} "
          f"({result['parameters']:,} parameters, model.safetensors + config.json)", flush=True)


def sample_text(model_dir: Path, prompt: str = SAMPLE_PROMPT, tokens: int = SAMPLE_TOKENS) -> str:
    """A short sample from the exported model alone (no swarm), seeded so a run can be repeated."""
    import torch

    from swarmd.job.data import ByteTokenizer
    from swarmd.model import load_model

    model = load_model(model_dir)
    idx = torch.tensor([list(prompt.encode())], dtype=torch.int64)
    out = model.generate(idx, tokens, temperature=0.8, top_k=40, generator=torch.Generator().manual_seed(0))
    return ByteTokenizer().decode(out[0]).decode("utf-8", errors="replace")


def _report(plan: Plan, args: argparse.Namespace, out: Path, progress: Progress, final: dict[str, Any],
            wall_s: float) -> int:
    gs = plan.spec.batch.global_samples
    swarm_curve = curve_from_events(progress.events, gs, "swarm (with preemptions)")
    baseline, baseline_s = None, 0.0
    if not args.no_baseline and swarm_curve.steps:
        print("training the single-process baseline of the same spec ...", flush=True)
        try:
            baseline, baseline_s = load_baseline(plan, out, max(swarm_curve.steps) + 1)
        except DataError as exc:
            print(f"demo: baseline: {exc}", file=sys.stderr)
    plot = out / "loss.png"
    curves = [swarm_curve] + ([baseline] if baseline else [])
    if swarm_curve.steps:
        render(curves, plot, f"{plan.spec.name}: a swarm through {len(progress.preemptions)} preemptions vs one process",
               marks=preemption_marks(progress.preemptions, gs))
    table, data = summarize(plan, progress, final, swarm_curve, baseline, wall_s, baseline_s, plot)
    (out / "summary.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(table)
    if (out / "model" / "config.json").exists():
        sample = sample_text(out / "model")
        (out / "sample.txt").write_text(sample)
        print(f"\na sample from the exported model ({out / 'model'}, loaded alone with swarmd.model.load_model):\n")
        print(sample)
    return EXIT_OK if final.get("state") == "done" else EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
