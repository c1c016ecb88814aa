"""The demo refuses bad input before it starts a single process, and draws its bar without a terminal."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from swarmd.demo import DEFAULT_SPEC, Bar, Preemption, Progress, make_plan, parser, preemption_marks
from swarmd.job.errors import SpecError


def plan_for(*argv: str):
    return make_plan(parser().parse_args(list(argv)))


def test_the_default_spec_is_valid_and_steps_can_be_replaced() -> None:
    plan = plan_for("--steps", "7", "--peers", "3")
    assert plan.spec.steps == 7 and plan.raw["steps"] == 7 and plan.spec.pipeline.stages == 3
    assert plan.base_dir == DEFAULT_SPEC.parent


@pytest.mark.parametrize("argv, field", [
    (("--steps", "0"), "steps"),
    (("--peers", "2"), "--peers"),
    (("--peers", "0"), "--peers"),
])
def test_bad_flags_are_spec_errors_naming_the_field(argv, field) -> None:
    with pytest.raises(SpecError) as err:
        plan_for(*argv)
    assert err.value.field == field


@pytest.mark.slow
def test_a_bad_spec_file_exits_2_and_starts_nothing(tmp_path: Path, procs) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("name = 'x'\nsteps = [\n")
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "swarmd.demo", "--spec", str(bad), "--out", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "<toml>" in run.stderr
    assert not (out / "swarm").exists()


def test_bar_prints_plain_lines_off_a_terminal_the_first_step_and_each_tenth() -> None:
    out = io.StringIO()
    bar, progress = Bar(out, live=False), Progress(steps=20)
    for step in range(20):
        progress.done, progress.loss, progress.tokens_per_s = step + 1, 5.0 - step * 0.1, 1234.0
        progress.peers_per_stage = [2, 1, 2]
        bar.draw(progress)
    lines = out.getvalue().splitlines()
    assert len(lines) == 11 and "\r" not in out.getvalue()  # the first step, then each tenth
    assert lines[-1].startswith("step 20/20  loss 3.100  tok/s 1,234  peers/stage 2·1·2  preempted 0")


def test_preemptions_are_marked_after_the_steps_committed_before_them() -> None:
    kills = [Preemption(0.0, "peer2", 1, done=0), Preemption(0.0, "peer5", 0, done=10)]
    assert preemption_marks(kills, 16) == [0, 160]
