"""TaskSet: tasks forget themselves when done, close cancels and waits (from inside too, without
hanging), and a failure reaches the owner in order, even one raised while being cancelled."""

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


async def test_closing_from_inside_one_of_its_tasks_cancels_every_task_itself_included_without_hanging():
    tasks = TaskSet("owner")
    sibling = tasks.spawn(asyncio.Event().wait(), "sibling")
    reached = []

    async def closer():
        await tasks.aclose("closed from inside")
        reached.append("past aclose")

    inside = tasks.spawn(closer(), "closer")
    await asyncio.wait([inside, sibling], timeout=5)
    assert inside.cancelled() and sibling.cancelled() and reached == [] and len(tasks) == 0


async def test_a_bug_raised_while_a_task_is_being_cancelled_still_reaches_the_owner():
    heard = []
    tasks = TaskSet("owner", on_failure=lambda name, exc: heard.append((name, type(exc))))
    started = asyncio.Event()

    async def broken_cleanup():
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            raise KeyError("cleanup bug")

    tasks.spawn(broken_cleanup(), "loop")
    await started.wait()
    await tasks.aclose()
    assert heard == [("owner:loop", KeyError)]


async def test_failures_reach_the_owner_in_the_order_the_tasks_failed_and_the_awaiter_still_gets_them():
    heard = []
    tasks = TaskSet("owner", on_failure=lambda name, exc: heard.append(name))
    second_may_fail = asyncio.Event()

    async def fail(name: str, after: asyncio.Event | None) -> None:
        if after is not None:
            await after.wait()
        raise RuntimeError(name)

    second = tasks.spawn(fail("second", second_may_fail), "second")
    first = tasks.spawn(fail("first", None), "first")
    with pytest.raises(RuntimeError, match="first"):
        await first
    second_may_fail.set()
    with pytest.raises(RuntimeError, match="second"):
        await second
    await asyncio.sleep(0)  # the done callbacks run
    assert heard == ["owner:first", "owner:second"] and len(tasks) == 0


async def test_cancel_all_from_a_callback_refuses_later_tasks_and_cancels_the_running_ones():
    tasks = TaskSet("owner")
    running = tasks.spawn(asyncio.Event().wait(), "running")
    asyncio.get_running_loop().call_soon(tasks.cancel_all, "peer sent GOAWAY")
    with pytest.raises(asyncio.CancelledError):
        await running
    coro = asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="closed"):
        tasks.spawn(coro, "late")
    await tasks.aclose()
    assert len(tasks) == 0
