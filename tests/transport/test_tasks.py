"""TaskSet: tasks forget themselves when done, close cancels and waits, and a failure reaches the owner."""

from __future__ import annotations

import asyncio
import logging

import pytest

from transport.errors import ConnectionLost
from transport.tasks import TaskSet


async def test_a_finished_task_leaves_the_set_and_close_cancels_and_waits_for_the_rest():
    tasks = TaskSet("owner")
    stopped = []

    async def forever():
        try:
            await asyncio.Event().wait()
        finally:
            stopped.append("forever")

    done = tasks.spawn(asyncio.sleep(0), "quick")
    tasks.spawn(forever(), "forever")
    await done
    await asyncio.sleep(0)  # the done callback runs
    assert len(tasks) == 1
    await tasks.aclose("test over")
    assert stopped == ["forever"] and len(tasks) == 0


async def test_a_closed_set_refuses_new_tasks_and_closes_their_coroutine():
    tasks = TaskSet("owner")
    await tasks.aclose()
    coro = asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="owner is closed; cannot start late"):
        tasks.spawn(coro, "late")
    assert coro.cr_frame is None  # closed: no "never awaited" warning, nothing left to run


async def test_a_bug_in_a_task_is_logged_with_its_traceback_and_handed_to_the_owner(caplog):
    heard = []
    tasks = TaskSet("owner", on_failure=lambda name, exc: heard.append((name, exc)))

    async def broken():
        raise KeyError("bug")

    with caplog.at_level(logging.ERROR, logger="transport.tasks"):
        task = tasks.spawn(broken(), "loop")
        await asyncio.wait([task])
        await asyncio.sleep(0)
    assert [(name, type(exc)) for name, exc in heard] == [("owner:loop", KeyError)]
    assert "owner: task owner:loop failed" in caplog.text and "KeyError" in caplog.text


async def test_expected_transport_errors_and_cancellation_do_not_reach_the_owner():
    heard = []
    tasks = TaskSet("owner", on_failure=lambda name, exc: heard.append(name))

    async def lost():
        raise ConnectionLost("peer went away")

    failing = tasks.spawn(lost(), "dial")
    waiting = tasks.spawn(asyncio.Event().wait(), "wait")
    await asyncio.wait([failing])
    await tasks.aclose()
    assert waiting.cancelled() and heard == []
