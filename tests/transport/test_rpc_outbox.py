"""The writer's queue and byte budget, without sockets: who goes next, and who waits."""

from __future__ import annotations

import asyncio

import pytest

from transport.errors import ConnectionLost
from transport.outbox import Budget, Outbox


def _frame(tag: str, payload: int = 0) -> list:
    return [tag.encode(), bytes(payload)] if payload else [tag.encode()]


def _drain(box: Outbox) -> list[str]:
    out = []
    while box:
        out.append(box.pop().frame[0].decode())
    return out


def test_control_first_then_fewest_bytes_left_and_a_calls_frames_stay_in_order():
    box = Outbox()
    box.put(1, [_frame("big-0", 100), _frame("big-1", 100), _frame("big-2", 100)])
    assert box.pop().frame[0] == b"big-0"  # big has 200 left now
    box.put(2, [_frame("mid-0", 50), _frame("mid-1", 50)])  # 100 left: goes ahead of big
    box.put(3, [_frame("small", 0)])
    box.put_control(_frame("ping"))
    assert _drain(box) == ["ping", "small", "mid-0", "mid-1", "big-1", "big-2"]
    assert box.queued_payload == 0


def test_ties_go_to_the_older_call():
    box = Outbox()
    box.put(7, [_frame("a", 10)])
    box.put(3, [_frame("b", 10)])
    assert _drain(box) == ["a", "b"]


def test_drop_says_whether_the_call_was_untouched_or_cut_short():
    box = Outbox()
    box.put(1, [_frame("x0", 10), _frame("x1", 10)])
    box.put(2, [_frame("y0", 5)])
    assert box.drop(2).untouched
    box.pop()  # x0 leaves
    dropped = box.drop(1)
    assert dropped.partial and not dropped.untouched and dropped.payload == 10
    assert not box and box.queued_payload == 0
    gone = box.drop(1)
    assert (gone.payload, gone.partial, gone.untouched) == (0, False, False)


async def test_budget_serves_waiters_in_order_and_lets_an_oversized_reservation_through_alone():
    budget = Budget(100)
    await budget.acquire(80)
    first = asyncio.create_task(budget.acquire(50))
    second = asyncio.create_task(budget.acquire(10))  # would fit, but must not jump the queue
    await asyncio.sleep(0)
    assert not first.done() and not second.done()
    budget.release(80)
    await asyncio.gather(first, second)
    assert budget.used == 60
    budget.release(60)
    await budget.acquire(500)  # bigger than the capacity: granted because nothing else is held
    assert budget.used == 500


async def test_budget_cancelled_waiter_gives_way_and_failure_wakes_everyone():
    budget = Budget(10)
    await budget.acquire(10)
    stuck = asyncio.create_task(budget.acquire(10))
    behind = asyncio.create_task(budget.acquire(5))
    await asyncio.sleep(0)
    stuck.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stuck
    budget.release(5)
    await behind
    assert budget.used == 10
    waiting = asyncio.create_task(budget.acquire(10))
    await asyncio.sleep(0)
    budget.fail(ConnectionLost("gone"))
    with pytest.raises(ConnectionLost):
        await waiting
    with pytest.raises(ConnectionLost):
        await budget.acquire(1)
