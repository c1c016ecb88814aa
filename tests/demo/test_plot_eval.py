"""`swarmctl plot` with `[eval]`: the swarm's held-out curve from the step events and the baseline's
from the reference evaluating the same samples after the same steps."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from jobspec import job_spec

from swarmd import ctl
from swarmd.exitcodes import EXIT_OK
from swarmd.job.spec import load_spec
from swarmd.plot import baseline_curves, eval_curve_from_events, plot_command, write_events
from swarmd.reference import ReferenceTrainer

torch.set_num_threads(1)

#: Two stages of TINY_JOB's model, four heads wide, on the stdlib's json package, with swarmd's default
#: optimizer (no [optim]), evaluated every second step.
TINY = job_spec("plot-eval", seed=3, steps=6, files=["{stdlib}/json/*.py"], model={"n_heads": 4},
                batch={"global_samples": 8, "microbatch_samples": 4}, optim=None, pipeline={"stages": 2},
                eval={"every_steps": 2, "samples": 6, "holdout": 0.1})


@pytest.fixture
def spec_path(tmp_path: Path) -> Path:
    path = tmp_path / "eval.toml"
    path.write_text(TINY)
    return path


def test_eval_curve_takes_evaluated_steps_and_leaves_given_up_ones_out() -> None:
    events = [{"kind": "step", "step": 2, "loss": 5.0, "eval_loss": 4.8, "eval_step": 2},
              {"kind": "step", "step": 3, "loss": 4.9},
              {"kind": "step", "step": 4, "loss": 4.7, "eval_loss": None, "eval_step": 4, "eval_failed": "x"},
              {"kind": "info", "step": 5, "loss": 4.6, "eval_loss": 1.0, "eval_step": 5},
              {"kind": "step", "step": 6, "loss": 4.5, "eval_loss": 4.4, "eval_step": 6},
              {"kind": "step", "step": 6, "loss": 4.5, "eval_loss": 4.3, "eval_step": 6}]  # a re-report wins
    curve = eval_curve_from_events(events, global_samples=8)
    assert curve.kind == "eval" and curve.steps == (1, 5) and curve.losses == (4.8, 4.3)
    assert curve.samples == [16, 48] and curve.final_loss() == 4.3


def test_the_baseline_evaluates_after_the_steps_the_swarm_does(spec_path: Path) -> None:
    spec = load_spec(spec_path)
    trained, held_out = baseline_curves(spec, spec_path.parent)
    assert trained.kind == "train" and len(trained.losses) == 6
    assert held_out.kind == "eval" and held_out.steps == (1, 3, 5)
    reference = ReferenceTrainer.from_spec(spec, spec_path.parent)
    expected = []
    for step in range(6):
        reference.train_step()
        if step in held_out.steps:
            expected.append(reference.evaluate())
    assert list(held_out.losses) == expected


def test_plot_command_reports_both_eval_curves(tmp_path: Path, spec_path: Path, capsys) -> None:
    events = tmp_path / "events.jsonl"
    write_events([{"kind": "step", "step": s + 1, "loss": 5.5 - 0.1 * s,
                   **({"eval_loss": 5.6 - 0.1 * s, "eval_step": s + 1} if (s + 1) % 2 == 0 else {})}
                  for s in range(6)], events)
    out = tmp_path / "plot.png"
    args = ctl.parser().parse_args(["plot", "J1", "-o", str(out), "--spec", str(spec_path), "--events", str(events),
                                    "--json"])
    assert isinstance(args, argparse.Namespace) and plot_command(args) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["swarm_eval_loss"] == pytest.approx(5.1) and report["swarm_final_loss"] == pytest.approx(5.0)
    assert report["baseline_eval_loss"] > 0 and report["baseline_final_loss"] > 0
    assert out.stat().st_size > 0
