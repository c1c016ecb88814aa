"""`swarmctl plot JOB -o FILE.png`: the swarm's loss curve beside a single-process baseline.

The paper's central claim is that training through preemptions reaches the loss ordinary training
reaches; the picture that shows it puts both curves on one axis of *samples seen*, not of time or
of steps, because that is what both runs spend equally. The baseline is `swarmd.reference` on the
same spec (the same model and data code in one process), so the two curves start from the same bits
and see the same samples in the same order; any gap between them is what the swarm did to training.

The swarm's curve comes from the job's `step` events (`job.logs`, docs/control-api.md), or from a
recorded JSON-lines file of them (`--events`), which is how the demo and the benchmark plot a run
after its daemons are gone. A job with `[eval]` adds its held-out loss curve: the step events
that carry an evaluation (`eval_loss`, `eval_step`), and the baseline evaluating the same held-out
samples after the same steps, so train and eval curves of both runs share the axis. matplotlib is imported only when drawing, with the file-only Agg backend.

`swarmd.ctl` declares the `plot` subcommand's flags with the others and calls `plot_command(args)`;
`ControlError` and `DaemonUnavailable` propagate to swarmctl's usual handling.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from swarmd.exitcodes import EXIT_CONFIG, EXIT_OK

if TYPE_CHECKING:
    from swarmd.job.spec import JobSpec

#: The final loss is the mean over this last share of the steps: one step's loss is one batch's
#: noise, a tenth of the run is the level the run ended at.
FINAL_FRACTION = 0.1


@dataclass(frozen=True)
class LossCurve:
    """One run's mean loss per optimizer step; step s has seen (s+1)·global_samples samples."""

    label: str
    steps: tuple[int, ...]
    losses: tuple[float, ...]
    global_samples: int
    # "train": each step's batch loss before its update; "eval": the held-out loss of the
    # parameters step s produced ([eval]), drawn with markers.
    kind: str = "train"

    @property
    def samples(self) -> list[int]:
        return [(s + 1) * self.global_samples for s in self.steps]

    def final_loss(self, fraction: float = FINAL_FRACTION) -> float:
        """A training curve's level at the end (mean of its last `fraction`); an eval curve's last
        evaluation (each is already a mean over the same held-out samples)."""
        if self.kind == "eval":
            return self.losses[-1] if self.losses else math.nan
        return final_loss(self.losses, fraction)

    @property
    def summary_key(self) -> str:
        return self.label.split(" ")[0] + ("_eval_loss" if self.kind == "eval" else "_final_loss")


def final_loss(losses: Sequence[float], fraction: float = FINAL_FRACTION) -> float:
    """Mean of the last `fraction` of the losses (at least one); NaN for an empty run."""
    if not losses:
        return math.nan
    tail = max(1, math.ceil(len(losses) * fraction))
    return sum(losses[-tail:]) / tail


def step_index(event: dict[str, Any]) -> int:
    """The optimizer step a `step` event reports: its `step` field counts the steps committed (as
    `job.get`'s does), so the event of step s (from 0) says s + 1."""
    return int(event["step"]) - 1


def step_events(events: Iterable[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """By step index, the last `step` event with a finite loss (a re-reported step replaces the first)."""
    by_step: dict[int, dict[str, Any]] = {}
    for event in events:
        loss = event.get("loss")
        if event.get("kind") == "step" and isinstance(loss, (int, float)) and math.isfinite(loss):
            by_step[step_index(event)] = event
    return dict(sorted(by_step.items()))


def curve_from_events(events: Iterable[dict[str, Any]], global_samples: int, label: str = "swarm") -> LossCurve:
    steps = step_events(events)
    return LossCurve(label, tuple(steps), tuple(float(e["loss"]) for e in steps.values()), global_samples)


def eval_curve_from_events(events: Iterable[dict[str, Any]], global_samples: int,
                           label: str = "swarm eval") -> LossCurve:
    """The held-out losses the step events carry (`eval_loss` of the parameters after `eval_step`
    steps; given-up evaluations, with no loss, are left out), by step index eval_step - 1."""
    by_step: dict[int, float] = {}
    for event in events:
        loss, step = event.get("eval_loss"), event.get("eval_step")
        if event.get("kind") == "step" and isinstance(loss, (int, float)) and math.isfinite(loss) \
                and isinstance(step, int) and step > 0:
            by_step[step - 1] = float(loss)
    ordered = sorted(by_step.items())
    return LossCurve(label, tuple(s for s, _ in ordered), tuple(v for _, v in ordered), global_samples, "eval")


def curve_from_reference(summary: dict[str, Any], global_samples: int, label: str = "baseline") -> LossCurve:
    """From the JSON `python -m swarmd.reference --out` writes."""
    losses = tuple(float(x) for x in summary["losses"])
    return LossCurve(label, tuple(range(len(losses))), losses, global_samples)


def baseline_curve(spec: "JobSpec", base_dir: Path, steps: int | None = None, threads: int = 1,
                   progress: Callable[[int, float], None] | None = None) -> LossCurve:
    """Train the reference on the spec in this process (`threads` torch threads) for `steps`
    (default: the spec's); relative data paths are taken from `base_dir`. Raises DataError when
    the data cannot be read."""
    return baseline_curves(spec, base_dir, steps, threads, progress)[0]


def baseline_curves(spec: "JobSpec", base_dir: Path, steps: int | None = None, threads: int = 1,
                    progress: Callable[[int, float], None] | None = None) -> list[LossCurve]:
    """`baseline_curve`, and with `[eval]` its held-out curve too: the reference evaluated after
    the steps the swarm evaluates after (EvalSpec.due)."""
    import torch

    from swarmd.reference import ReferenceTrainer

    torch.set_num_threads(threads)
    trainer = ReferenceTrainer.from_spec(spec, base_dir)
    losses, evaluated = [], {}
    for _ in range(spec.steps if steps is None else steps):
        losses.append(trainer.train_step().loss)
        if spec.eval.due(len(losses), spec.steps):
            evaluated[len(losses) - 1] = trainer.evaluate()
        if progress is not None:
            progress(len(losses) - 1, losses[-1])
    gs = spec.batch.global_samples
    curves = [LossCurve("baseline (one process)", tuple(range(len(losses))), tuple(losses), gs)]
    if spec.eval.enabled:
        curves.append(LossCurve("baseline eval (one process)", tuple(evaluated), tuple(evaluated.values()), gs, "eval"))
    return curves


def read_events(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file of job events (what `swarmctl logs --json` prints, one per line)."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_events(events: Iterable[dict[str, Any]], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for event in events:
            handle.write(json.dumps(event, sort_keys=True) + "\n")


def render(curves: Sequence[LossCurve], path: Path, title: str, marks: Sequence[float] = (),
           mark_label: str = "preemption") -> Path:
    """Every curve against samples seen, with its final loss in the legend; `marks` are vertical
    lines at sample counts (e.g. where peers were killed). Writes a PNG and returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    styles = [dict(color="tab:blue", lw=1.6), dict(color="black", lw=1.2, ls="--"), dict(color="tab:green", lw=1.2)]
    trained = [c for c in curves if c.kind != "eval"]
    for curve, style in zip(trained, styles * (len(trained) // len(styles) + 1)):
        ax.plot(curve.samples, curve.losses, label=f"{curve.label}: final {curve.final_loss():.3f}", **style)
    # Held-out curves: markers at each evaluation, the swarm's filled orange, the baseline's larger,
    # hollow and dashed black on top (the two coincide when the swarm is exact).
    evals = [dict(color="tab:orange", lw=1.2, marker="o", ms=4),
             dict(color="black", lw=1.0, ls="--", marker="o", ms=8, mfc="none")]
    for curve, style in zip([c for c in curves if c.kind == "eval"], evals * len(curves)):
        ax.plot(curve.samples, curve.losses, label=f"{curve.label}: last {curve.final_loss():.3f}", **style)
    for i, x in enumerate(marks):
        ax.axvline(x, color="tab:red", lw=0.7, alpha=0.5, ls=":", label=f"{mark_label} ({len(marks)})" if i == 0 else None)
    ax.set_title(title)
    ax.set_xlabel("samples seen")
    held_out = any(c.kind == "eval" for c in curves)
    ax.set_ylabel(("training and held-out" if held_out else "training") + " loss (mean cross-entropy per token, nats)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------- swarmctl plot


def plot_command(args: argparse.Namespace) -> int:
    """Fetch (or read) the events, train or read the baseline, draw; the exit status."""
    from swarmd.job.errors import DataError, SpecError
    from swarmd.job.sources import resolve_sources
    from swarmd.job.spec import load_spec

    want_baseline = not args.no_baseline
    if want_baseline and args.spec is None and args.events is not None:
        return _fail(args, "the baseline of recorded events needs the job's spec: give --spec JOB.toml "
                           "(or --no-baseline)")
    try:
        spec = load_spec(args.spec) if args.spec else None
        if spec is not None and args.baseline is None:
            resolve_sources(spec.data, args.spec.parent)  # before fetching anything: say so now
    except (SpecError, DataError) as exc:
        return _fail(args, f"{args.spec}: {exc}")
    base_dir = args.spec.resolve().parent if args.spec else Path.cwd()
    if args.events is not None:
        try:
            events = read_events(args.events)
        except (OSError, ValueError) as exc:
            return _fail(args, f"{args.events}: cannot read events: {exc}")
        title = args.job
    else:
        events, title, published = _fetch_job(args)
        if spec is None and want_baseline:
            if published is None:
                return _fail(args, f"job {args.job}: its spec is not in the DHT; give --spec JOB.toml")
            spec = published
    global_samples = spec.batch.global_samples if spec else _global_samples(events)
    swarm = curve_from_events(events, global_samples, label="swarm")
    if not swarm.steps:
        return _fail(args, f"job {args.job} has no step with a loss yet")
    curves = [swarm]
    held_out = eval_curve_from_events(events, global_samples)
    if held_out.steps:
        curves.append(held_out)
    if args.baseline is not None:
        try:
            curves.append(curve_from_reference(json.loads(args.baseline.read_text()), global_samples,
                                               label="baseline (one process)"))
        except (OSError, ValueError, KeyError) as exc:
            return _fail(args, f"{args.baseline}: cannot read baseline: {exc}")
    elif want_baseline:
        try:
            curves += baseline_curves(spec, base_dir, steps=max(swarm.steps) + 1, threads=args.threads)
        except (SpecError, DataError) as exc:
            return _fail(args, f"baseline of {spec.name}: {exc}")
    path = render(curves, args.output, f"{title}: loss against samples seen")
    summary = {"output": str(path), **{c.summary_key: c.final_loss() for c in curves}}
    if args.json:
        sys.stdout.write(json.dumps(summary, sort_keys=True) + "\n")
    else:
        sys.stdout.write(f"wrote {path}: " + ", ".join(f"{k} {v:.4f}" for k, v in summary.items() if k != "output") + "\n")
    return EXIT_OK


def _fetch_job(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str, "JobSpec | None"]:
    """The job's events, a title, and its spec as published in the DHT (`("job", id, "spec")`, see
    swarmd.jobs.registry), or None when no record decodes to a spec of that name."""
    from swarmd.client import SyncClient
    from swarmd.job.errors import SpecError
    from swarmd.job.spec import JobSpec

    client = SyncClient(args.socket, timeout=args.timeout)
    job = client.job(args.job)
    published = None
    for record in client.dht_get(["job", bytes.fromhex(job["job"]), "spec"])["records"]:
        try:
            candidate = JobSpec.from_msgpack(record["value"])
        except (SpecError, ValueError):
            continue
        if candidate.name == job["name"]:
            published = candidate
            break
    return client.logs(job["job"], follow=False), f"{job['name']} ({job['job'][:12]})", published


def _global_samples(events: list[dict[str, Any]]) -> int:
    """Without a spec, samples seen are counted from what the step events report, else steps."""
    for event in events:
        if event.get("kind") == "step" and isinstance(event.get("samples"), int) and event["samples"] > 0:
            return event["samples"]
    return 1


def _fail(args: argparse.Namespace, message: str) -> int:
    if getattr(args, "json", False):
        print(json.dumps({"error": {"code": "bad_usage", "message": message}}), file=sys.stderr)
    else:
        print(f"swarmctl plot: {message}", file=sys.stderr)
    return EXIT_CONFIG
