"""Inbox: a call's answer frames in order, then its error; the waiting task wakes for either."""

from __future__ import annotations

import asyncio

import pytest

from transport.calls import Inbox
from transport.errors import ConnectionLost
from transport.wire import Frame, Kind


def frame(n: int) -> Frame:
    return Frame(Kind.STREAM_ITEM, {"n": n})


async def test_frames_come_out_in_order_and_a_waiter_wakes_for_the_next():
    inbox = Inbox()
    inbox.push(frame(1))
    assert (await inbox.next()).header == {"n": 1}
    waiting = asyncio.create_task(inbox.next())
    await asyncio.sleep(0)
    assert not waiting.done()
    inbox.push(frame(2))
    assert (await waiting).header == {"n": 2}


async def test_frames_that_arrived_before_the_error_are_still_delivered_then_the_error():
    inbox = Inbox()
    inbox.push(frame(1))
    inbox.fail(ConnectionLost("gone"))
    assert (await inbox.next()).header == {"n": 1}
    with pytest.raises(ConnectionLost, match="gone"):
        await inbox.next()


async def test_a_waiter_cancelled_leaves_the_inbox_usable():
    inbox = Inbox()
    waiting = asyncio.create_task(inbox.next())
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert inbox.waiter is None
    inbox.push(frame(3))
    assert (await inbox.next()).header == {"n": 3}
