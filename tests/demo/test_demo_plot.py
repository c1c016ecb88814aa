"""The loss plot: curves from recorded events and from the reference, final loss, and a valid PNG."""

from __future__ import annotations

import argparse
import json
import math
import struct
from pathlib import Path

import pytest
import torch
from jobspec import job_spec

from swarmd import ctl
from swarmd.exitcodes import EXIT_CONFIG, EXIT_OK
from swarmd.job.spec import load_spec
from swarmd.plot import (
    baseline_curve,
    curve_from_events,
    final_loss,
    plot_command,
    render,
    write_events,
)
from swarmd.reference import ReferenceTrainer

torch.set_num_threads(1)

#: Two stages of TINY_JOB's model, four heads wide, on the stdlib's json package, with swarmd's default
#: optimizer (no [optim]).
SPEC = dict(files=["{stdlib}/json/*.py"], model={"n_heads": 4}, batch={"global_samples": 8, "microbatch_samples": 4},
            optim=None, pipeline={"stages": 2})
TINY = job_spec("plot-tiny", seed=3, steps=6, **SPEC)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, after checking the signature and chunk type."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def tiny_spec(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return path


def test_final_loss_is_the_mean_of_the_last_tenth() -> None:
    assert final_loss([5.0] * 90 + [2.0] * 10) == 2.0
    assert final_loss([3.0, 1.0]) == 1.0  # at least one step
    assert final_loss([4.0, 2.0, 1.0] * 7) == pytest.approx((1.0 + 4.0 + 2.0) / 3)  # ceil(2.1) = 3
    assert math.isnan(final_loss([]))


def test_curve_from_events_keeps_steps_with_a_loss_and_the_last_report_of_each() -> None:
    """A step event's `step` counts the steps committed: 1 is the first optimizer step (index 0)."""
    events = [
        {"kind": "info", "step": 0, "loss": None, "message": "started"},
        {"kind": "step", "step": 2, "loss": 4.0},
        {"kind": "step", "step": 1, "loss": 5.0},
        {"kind": "step", "step": 2, "loss": 3.5},  # re-reported: replaces the first
        {"kind": "step", "step": 3, "loss": None},
        {"kind": "step", "step": 4, "loss": float("nan")},
        {"kind": "done", "step": 4, "loss": None},
    ]
    curve = curve_from_events(events, global_samples=8)
    assert curve.steps == (0, 1) and curve.losses == (5.0, 3.5) and curve.samples == [8, 16]


def test_baseline_is_the_reference_trainer(tiny_spec: Path) -> None:
    spec = load_spec(tiny_spec)
    curve = baseline_curve(spec, tiny_spec.parent, steps=3)
    expected = [r.loss for r in ReferenceTrainer.from_spec(spec, tiny_spec.parent).train(3)]
    assert list(curve.losses) == expected and curve.global_samples == 8


def test_render_writes_a_png_with_both_curves(tmp_path: Path, tiny_spec: Path) -> None:
    spec = load_spec(tiny_spec)
    base = baseline_curve(spec, tiny_spec.parent)
    swarm = curve_from_events([{"kind": "step", "step": s + 1, "loss": x * 1.01} for s, x in enumerate(base.losses)], 8)
    path = render([swarm, base], tmp_path / "sub" / "loss.png", "tiny", marks=[16, 32])
    assert png_size(path) == (990, 550)  # 9x5 inches at 110 dpi

    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == (550, 990) and pixels.std() > 0  # decodes, and is not blank


def plot_args(*argv: str) -> argparse.Namespace:
    return ctl.parser().parse_args(["plot", *argv])


def test_plot_command_from_recorded_events_trains_the_baseline(tmp_path: Path, tiny_spec: Path, capsys) -> None:
    events = tmp_path / "events.jsonl"
    write_events([{"kind": "step", "step": s + 1, "loss": 5.5 - 0.1 * s, "tokens_per_s": 100.0} for s in range(6)],
                 events)
    out = tmp_path / "plot.png"
    args = plot_args("J1", "-o", str(out), "--spec", str(tiny_spec), "--events", str(events), "--json")
    assert plot_command(args) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["output"] == str(out) and report["swarm_final_loss"] == pytest.approx(5.0)
    assert report["baseline_final_loss"] > 0
    png_size(out)


def test_plot_command_refuses_bad_input_with_a_sentence(tmp_path: Path, tiny_spec: Path, capsys) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text("{not json\n")
    out = tmp_path / "plot.png"
    assert plot_command(plot_args("J1", "-o", str(out), "--events", str(events))) == EXIT_CONFIG
    assert "--spec" in capsys.readouterr().err  # the baseline needs a spec
    assert plot_command(plot_args("J1", "-o", str(out), "--events", str(events), "--no-baseline")) == EXIT_CONFIG
    assert "cannot read events" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text(job_spec("plot-tiny", seed=3, steps=-1, **SPEC))
    assert plot_command(plot_args("J1", "-o", str(out), "--spec", str(bad), "--events", str(events))) == EXIT_CONFIG
    assert "steps" in capsys.readouterr().err
    assert not out.exists()
