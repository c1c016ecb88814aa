"""The Supervisor the daemon's job loops run under: an unexpected error is logged with its
traceback, recorded for `swarmctl status` and the loop restarted after a bounded backoff; errors
the owner expects to end the task, and cancellation, go through."""

from __future__ import annotations

import asyncio
import logging

import pytest

from swarmd.supervisor import Backoff, Faults, Supervisor

FAST = Backoff(initial_s=0.01, max_s=0.04)


def test_backoff_doubles_up_to_its_bound() -> None:
    backoff = Backoff(initial_s=0.5, max_s=30.0)
    assert [backoff.delay(n) for n in (1, 2, 3, 7, 50)] == [0.5, 1.0, 2.0, 30.0, 30.0]
    with pytest.raises(ValueError):
        Backoff(initial_s=2.0, max_s=1.0)


async def test_an_unexpected_error_is_logged_shown_and_the_task_restarted(caplog) -> None:
    caplog.set_level(logging.ERROR, logger="swarmd.supervisor")
    faults = Faults()
    runs = []

    async def flaky() -> str:
        runs.append(len(runs))
        if len(runs) <= 3:
            raise ValueError(f"invalid literal for int() with base 10: 'oops' (run {len(runs)})")
        return "done"

    assert await Supervisor("stage sync", faults, FAST).run("job 1/0", flaky) == "done"
    assert len(runs) == 4
    shown = faults.status()
    assert shown["failures_total"] == 3
    [task] = shown["tasks"]
    assert task["task"] == "stage sync: job 1/0" and task["restarts"] == 3 and task["retry_in_s"] is None
    assert task["last_error"] == "ValueError: invalid literal for int() with base 10: 'oops' (run 3)"
    tracebacks = [r for r in caplog.records if "Traceback" in r.getMessage()]
    assert len(tracebacks) == 3 and "flaky" in tracebacks[0].getMessage()


async def test_final_errors_and_cancellation_are_not_restarted() -> None:
    supervisor = Supervisor("trainers", backoff=FAST)

    async def gives_up() -> None:
        raise KeyError("the owner's own verdict")

    with pytest.raises(KeyError):
        await supervisor.run("t", gives_up, final=(KeyError,))
    assert supervisor.faults.status()["failures_total"] == 0

    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    task = supervisor.spawn("loop", forever)
    await started.wait()
    await supervisor.aclose()
    assert task.cancelled()


def test_the_board_is_bounded_and_forgets_the_least_recently_failed() -> None:
    faults = Faults(max_shown=2)
    for name in ("a", "b", "a", "c"):
        faults.failed(name, RuntimeError(name), 1.0)
    assert [t["task"] for t in faults.status()["tasks"]] == ["c", "a"]
    assert faults.get("a").restarts == 2 and faults.total == 4


def test_swarmctl_status_prints_the_faults() -> None:
    from swarmd.ctl import _supervision_rows

    faults = Faults()
    assert _supervision_rows(faults.status()) == [("faults", "none")]
    faults.failed("joining: poll jobs", ValueError("invalid literal for int() with base 10: 'oops'"), 2.0)
    rows = _supervision_rows(faults.status())
    assert rows[0] == ("faults", "1 restarts of supervised loops")
    assert rows[1][1] == ("joining: poll jobs: 1 restarts (restarting): "
                          "ValueError: invalid literal for int() with base 10: 'oops'")
