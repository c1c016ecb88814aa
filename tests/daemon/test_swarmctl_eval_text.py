"""What `swarmctl job` and `swarmctl logs` print of a job's held-out evaluation ([eval]), from
replies and events as the daemon sends them; an older daemon's reply (no eval fields) still prints."""

from __future__ import annotations

import io

from swarmd import ctl

JOB = {"job": "cd" * 32, "name": "tiny", "status": "running: every stage has peers", "step": 8, "steps": 20,
       "loss": 2.5, "samples_per_s": 3.0, "stages": []}


def test_job_text_shows_the_last_eval_loss_and_its_step() -> None:
    line = ctl._job_text({**JOB, "eval_loss": 2.71828, "eval_step": 8}).splitlines()[2]
    assert line == "step       8 / 20, loss 2.5000, eval loss 2.7183 (step 8), 3.0 samples/s"
    assert "eval" not in ctl._job_text({**JOB, "eval_loss": None, "eval_step": None})
    assert "eval" not in ctl._job_text(JOB)  # an older daemon's reply


def test_log_lines_show_an_evaluation_or_that_it_was_given_up() -> None:
    step = {"ts": 0.0, "kind": "step", "step": 4, "loss": 2.5, "tokens_per_s": 100.0, "message": "m"}
    assert "loss 2.5000 eval loss 2.2500 100 tokens/s" in ctl._event_text({**step, "eval_loss": 2.25, "eval_step": 4})
    assert "eval given up" in ctl._event_text({**step, "eval_loss": None, "eval_step": 4, "eval_failed": "x"})
    assert "eval" not in ctl._event_text(step)


def test_the_progress_bar_keeps_the_last_eval_loss() -> None:
    out = io.StringIO()
    bar = ctl._ProgressBar(out, 20, colour=False)
    bar.show({"ts": 0.0, "kind": "step", "step": 2, "loss": 3.0, "tokens_per_s": 10.0, "eval_loss": 2.9, "eval_step": 2})
    bar.show({"ts": 0.0, "kind": "step", "step": 3, "loss": 2.8, "tokens_per_s": 10.0})
    assert out.getvalue().rsplit("\r", 1)[-1].startswith("[") and "loss 2.8000  eval 2.9000  tokens/s 10" in out.getvalue()
