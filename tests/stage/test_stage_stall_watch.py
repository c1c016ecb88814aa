"""StallWatch on its own: a stream handler's messages must each be taken within state_stall_s
plus their bytes at the minimum rate, or the task serving the stream is cancelled. Here a plain
task stands in for the transport, taking each yielded item after a pace the test sets."""

from __future__ import annotations

import asyncio

from swarmd.stage.service import StallWatch


async def serve(sizes: list[int], stall_s: float, min_rate: float, pace: dict[int, float],
                ended: list[str]) -> list[int]:
    """Iterate a stream of items of `sizes` bytes under a StallWatch, taking item i after pace[i] s
    (the transport waiting for the reader's window)."""

    async def stream():
        watch = StallWatch(stall_s, min_rate, "test stream")
        try:
            for size in sizes:
                watch.handing(size)
                yield size
                watch.taken()
        finally:
            watch.close()
            ended.append("closed")

    taken = []
    items = stream()
    try:
        async for size in items:
            await asyncio.sleep(pace.get(len(taken), 0.0))
            taken.append(size)
    finally:
        await items.aclose()
    return taken


async def test_a_stream_taken_at_a_steady_pace_is_not_cut_however_long_it_runs():
    """Ten items each taken after 0.05 s with 0.2 s allowed per item: 0.5 s in all, not cut."""
    ended: list[str] = []
    taken = await serve([10] * 10, 0.2, 1e9, {i: 0.05 for i in range(10)}, ended)
    assert taken == [10] * 10 and ended == ["closed"]


async def test_an_item_not_taken_in_time_cancels_the_stream_and_its_finally_runs():
    ended: list[str] = []
    task = asyncio.create_task(serve([10] * 5, 0.2, 1e9, {2: 30.0}, ended))
    loop = asyncio.get_running_loop()
    began = loop.time()
    await asyncio.wait([task], timeout=10)
    assert task.cancelled() and ended == ["closed"]
    assert loop.time() - began < 5  # cut at ~0.2 s, not after the 30 s stall


async def test_bigger_items_are_allowed_their_bytes_at_the_minimum_rate():
    """stall 0.1 s, 1000 B/s: an item of 500 bytes (after one of 500) may take 0.1 + 1.0 s; taken
    after 0.5 s it is not cut, though that is five times the bare stall time."""
    ended: list[str] = []
    taken = await serve([500, 500], 0.1, 1000.0, {1: 0.5}, ended)
    assert taken == [500, 500] and ended == ["closed"]
