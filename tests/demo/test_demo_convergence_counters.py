"""bench/convergence.py's accounting of the swarm's step events (the benchmark itself is run by hand)."""

from __future__ import annotations

from benchmod import load_bench

conv = load_bench("convergence.py")


def step(s: int, **fields) -> dict:
    """The event of optimizer step s (from 0): its `step` field counts steps committed."""
    return {"kind": "step", "step": s + 1, "loss": 3.0, **fields}


def test_counters_sum_the_last_report_of_each_step_and_find_short_and_missing_steps() -> None:
    events = [
        {"kind": "info", "step": 0, "message": "started"},
        step(0, retries=2, resent=0, duplicates=[0, 1, -1], stage_samples=[16, 16, 16]),
        step(1, retries=9, duplicates=[5, 5, 5], stage_samples=[0, 0, 0]),  # replaced by the next report
        step(1, retries=1, resent=1, duplicates=[0, 0, 0], stage_samples=[16, 12, -1]),
        step(3, retries=0, resent=0, duplicates=[2, 0, 0], stage_samples=[16, 16, -1]),
    ]
    counters = conv.swarm_counters(events, global_samples=16, microbatch_samples=4, steps=5)
    assert counters == {"retries": 3, "resent": 1, "duplicate_microbatches": 3, "duplicate_samples": 12,
                        "short_steps": 1, "missing_steps": 2}


def test_counters_the_daemon_does_not_report_are_none_not_zero() -> None:
    counters = conv.swarm_counters([step(0), step(1)], global_samples=16, microbatch_samples=4, steps=2)
    assert counters == {"retries": None, "resent": None, "duplicate_microbatches": None, "duplicate_samples": None,
                        "short_steps": None, "missing_steps": 0}
