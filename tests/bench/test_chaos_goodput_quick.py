"""bench/chaos_goodput.py: its figures on known events, and its smallest run for real (slow).

The quick run starts five real `swarmd` processes (the trainer's daemon and 2 stages x 2 peers),
SIGKILLs and restarts a stage peer in each kill window and duty-cycles one peer with SIGSTOP/SIGCONT."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchmod import load_bench

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "chaos_goodput.py"
#: Five daemons to start on a busy 2-core machine, then 5 windows of 6 s and two of 3 s (a kill
#: window lasts until its restart is done).
QUICK_TIMEOUT_S = 400


cg = load_bench("chaos_goodput.py")


def step(ts: float, stage_samples=(16, 16), duplicates=(0, 0), answers_lost=0) -> dict:
    return {"kind": "step", "ts": ts, "stage_samples": list(stage_samples), "duplicates": list(duplicates),
            "answers_lost": answers_lost, "retries": 0, "taken_over": 0}


def test_figures_ratios_and_exactness_from_known_events():
    args = cg.parse(["--window", "10", "--kill-every", "60,30,15"])
    run = cg.Run()
    run.windows = {"no_faults_before": (0, 5), "kill_60s": (5, 15), "kill_30s": (15, 25), "kill_15s": (25, 35),
                   "slow_peer": (35, 45), "no_faults_after": (45, 50)}
    run.kills = {"kill_60s": 1, "kill_30s": 1, "kill_15s": 1}
    run.events = [step(t + 0.5) for t in range(0, 5)] + [step(t + 0.5) for t in range(45, 50)]  # 1 step/s
    run.events += [step(5.5 + t) for t in range(8)]  # 8 steps in 10 s, all exact
    run.events += [step(15.5), step(16.5, duplicates=(1, 0), stage_samples=(18, 16))]  # one summed twice
    run.events += [step(25.5, answers_lost=1), step(26.5, stage_samples=(-1, 16), duplicates=(-1, 0))]
    result = cg.summarize(run, args)
    assert result["no_faults"]["samples_per_s"] == pytest.approx(16.0)
    assert set(result["scenarios"]) == {"kill_60s", "kill_30s", "kill_15s", "slow_peer"}
    k60, k30, k15, slow = (result["scenarios"][n] for n in ("kill_60s", "kill_30s", "kill_15s", "slow_peer"))
    assert k60["ratio"] == pytest.approx(0.8) and k60["exact"] is True and k60["kills"] == 1
    assert k30["exact"] is False and k30["duplicates"] == 1
    assert k15["exact"] is False and k15["answers_lost"] == 1 and k15["unknown_records"] == 1
    assert slow["ratio"] == 0 and slow["exact"] is False  # nothing committed proves nothing


@pytest.mark.slow
def test_quick_run_prints_the_json_and_draws_the_png(tmp_path: Path) -> None:
    png, out = tmp_path / "goodput.png", tmp_path / "goodput.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--png", str(png), "--json", str(out),
                           "--root", str(tmp_path / "swarm")], capture_output=True, text=True,
                          timeout=QUICK_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=1))
    assert result == json.loads(out.read_text())
    assert result["no_faults"]["samples_per_s"] > 0 and result["no_faults"]["exact"] is True
    assert set(result["scenarios"]) == {"kill_60s", "kill_30s", "kill_15s", "slow_peer"}
    for name, figures in result["scenarios"].items():
        assert figures["ratio"] >= 0 and isinstance(figures["exact"], bool), name
        assert figures.get("kills", 1) == 1, name  # a 6 s window holds the kill at its start only
    assert png.stat().st_size > 1000
