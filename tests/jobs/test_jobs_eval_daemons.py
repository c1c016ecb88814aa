"""Held-out evaluation with real daemons: a job with `[eval]` trains through two `swarmd` processes,
its eval loss shows in `job.get`, the step events, `swarmctl job`, the metrics and `swarmctl plot`,
and the model exported at the end has, on the same held-out samples, the swarm's last eval loss.

Two daemons `a` (submitter and trainer) and `b`; a two-stage job, stage 0 pinned on `a`, stage 1 on
`b`; codec `none`, plain SGD. [eval] every 2 of 4 steps, 6 held-out samples (three batches of 2),
held out from the training text (`holdout`), or from a file of their own (`files`, relative to
the spec: the trainer's daemon is told where with `swarmctl train --eval-data`, and refuses to
train shard 0 without it).

Tolerance of export vs swarm, 1e-5 relative: the export holds the parameters of step 4 bit for bit
(the stages' final checkpoints of the state they evaluated), and the exported model runs the same
stage modules on the same held-out batches (same samples, same batch sizes, fp32). What may differ
is only the order of float sums inside a matmul (the daemons and this process may pick other
kernels or thread counts), a few ulps of fp32 (~1e-7 relative) per operation."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from swarmd.exitcodes import EXIT_OK
from swarmd.job import open_training_data, parse_toml
from swarmd.model import load_model

pytestmark = pytest.mark.slow

STEPS = 4
JOB = {"model": {"layers_per_stage": 1}, "batch": {"global_samples": 4, "microbatch_samples": 2},
       "optim": {"name": "sgd", "lr": 0.05, "schedule": "constant", "clip_norm": 0.0},
       "wire": {"activations": "none", "gradients": "none"}, "pipeline": {"stages": 2},
       "checkpoint": {"every_steps": 0}}
HELD_OUT = {"holdout": {"every_steps": 2, "samples": 6, "holdout": 0.25},
            "files": {"every_steps": 2, "samples": 6, "files": ["valid.txt"]}}


def ctl(daemon, *args: str) -> subprocess.CompletedProcess[str]:
    """This tree's `swarmctl` (the venv's console script may be another checkout's)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp", "OMP_NUM_THREADS": "1",
           "NO_COLOR": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run([sys.executable, "-m", "swarmd.ctl", "--socket", str(daemon.socket), *args],
                          capture_output=True, text=True, timeout=300, env=env)


def scrape(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("swarmd_trainer_")}


@pytest.mark.parametrize("source", sorted(HELD_OUT))
def test_eval_loss_is_reported_everywhere_and_the_export_reproduces_it(swarm, swarm_root: Path, kit,
                                                                       source: str) -> None:
    torch.set_num_threads(1)
    root = swarm_root / source
    root.mkdir(mode=0o755)
    data, spec_path = kit.write_job(root, "evaluated", copies=1, seed=4, steps=STEPS, eval=HELD_OUT[source], **JOB)
    valid = root / "valid.txt"
    valid.write_text(Path(csv.__file__).read_text())  # other text than the training data's
    spec = parse_toml(spec_path.read_text())
    a, b = swarm.together([f"{source[0]}a", f"{source[0]}b"], env={"SWARMD_METRICS_LISTEN": "127.0.0.1:0"})
    job_id = kit.submit_and_serve(ctl, spec_path, [(a, 0), (b, 1)])
    kit.wait_for(lambda: all(any(p["state"] == "serving" for p in s["peers"]) for s in a.client.job(job_id)["stages"]),
                 60, "both stages served", interval=0.5)
    assert a.client.job(job_id)["eval_loss"] is None  # nothing evaluated yet

    job = train(kit, a, job_id, data, valid if source == "files" else None)
    check_eval_reported(kit, a, job_id, job)
    check_eval_plotted(a, job_id, job, root, spec_path)

    # The exported model of step 4, on the same held-out samples.
    for daemon in (a, b):
        kit.wait_for(lambda: len(daemon.client.status()["serving"]["stages"]) == 0, 60,
                     f"{daemon.name} to leave the job", interval=0.5)
    loss = exported_eval_loss(a, job_id, root / "export", b.socket.parent / "state", spec, spec_path)
    print(f"held-out loss after {STEPS} steps: swarm {job['eval_loss']:.8f}, exported model {loss:.8f}")
    assert abs(loss - job["eval_loss"]) <= 1e-5 * abs(job["eval_loss"])


def train(kit, a, job_id: str, data: Path, valid: Path | None) -> dict:
    """Train the job to its end on `a` (a held-out file of its own: refused without `--eval-data`);
    the job as `a` reports it then, done."""
    if valid is not None:
        refused = ctl(a, "train", job_id, "--data", str(data))
        assert refused.returncode != EXIT_OK and "eval.files: " in refused.stderr, refused
        trained = ctl(a, "train", job_id, "--data", str(data), "--eval-data", str(valid))
    else:
        trained = ctl(a, "train", job_id, "--data", str(data))
    assert trained.returncode == EXIT_OK, trained.stderr
    kit.wait_for(lambda: kit.finished(a, job_id), 240, "training to finish", interval=0.5)
    job = a.client.job(job_id)
    assert job["state"] == "done", a.client.logs(job_id)
    return job


def check_eval_reported(kit, a, job_id: str, job: dict) -> None:
    """The last eval loss in job.get, the step events, `swarmctl job` and `logs`, and the metrics."""
    # job.get: the last evaluation, of the parameters after the last step.
    assert job["eval_step"] == STEPS and isinstance(job["eval_loss"], float) and math.isfinite(job["eval_loss"])
    # Step events: evaluations after steps 2 and 4, each of the 6 samples.
    evaluated = [e for e in kit.step_events(a, job_id) if "eval_step" in e]
    assert [e["eval_step"] for e in evaluated] == [2, 4], evaluated
    assert all(e["eval_samples"] == 6 and e["eval_loss"] is not None for e in evaluated)
    assert evaluated[-1]["eval_loss"] == job["eval_loss"]
    assert not [e for e in kit.step_events(a, job_id) if "eval_step" not in e and e.get("eval_loss") is not None]
    # swarmctl job and logs say it.
    shown = ctl(a, "job", job_id)
    assert shown.returncode == EXIT_OK and f"eval loss {job['eval_loss']:.4f} (step {STEPS})" in shown.stdout, shown
    logs = ctl(a, "logs", job_id)
    assert f"eval loss {job['eval_loss']:.4f}" in logs.stdout, logs.stdout
    # The metrics: the last loss and two evaluations that went through.
    metrics = scrape(a.client.status()["metrics"])
    assert metrics["swarmd_trainer_eval_loss"] == pytest.approx(job["eval_loss"], rel=1e-12)
    assert metrics['swarmd_trainer_evaluations_total{outcome="ok"}'] == 2
    assert metrics['swarmd_trainer_evaluations_total{outcome="given_up"}'] == 0


def check_eval_plotted(a, job_id: str, job: dict, root: Path, spec_path: Path) -> None:
    """swarmctl plot: the swarm's eval curve beside the baseline's, which evaluates the same samples."""
    plotted = ctl(a, "--json", "plot", job_id, "-o", str(root / "eval.png"), "--spec", str(spec_path))
    assert plotted.returncode == EXIT_OK, plotted.stderr
    summary = json.loads(plotted.stdout)
    print("plot summary:", summary)
    assert summary["swarm_eval_loss"] == job["eval_loss"]
    assert summary["baseline_eval_loss"] == pytest.approx(job["eval_loss"], rel=1e-4)  # parameters within 1e-5
    assert (root / "eval.png").stat().st_size > 0


def exported_eval_loss(a, job_id: str, out: Path, state_dir: Path, spec, spec_path: Path) -> float:
    """Export the job's model of step STEPS through `a` (stage 1 from `state_dir`) and return its
    mean loss over the held-out samples."""
    exported = ctl(a, "--json", "export", job_id, "-o", str(out), "--state-dir", str(state_dir))
    assert exported.returncode == EXIT_OK, exported.stderr
    assert json.loads(exported.stdout)["step"] == STEPS
    model = load_model(out)
    held_out = open_training_data(spec.data, spec.batch, spec.model.config.vocab, spec.seed, spec_path.parent,
                                  evaluation=spec.eval)
    with torch.no_grad():
        batches = [held_out.eval_batch(i) for i in range(held_out.eval_batch_count())]
        return math.fsum(model(b.inputs, b.targets).item() for b in batches) / sum(len(b.sample_indices) for b in batches)
