"""Executor on its own: a bounded queue (full -> QueueFull at once), batches of compatible work up
to max_batch answered item by item, callers that left skipped, failures confined to their batch,
and close failing what is still queued. The compute function is a stand-in that the test holds
and releases, so nothing waits on a fixed sleep."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
import torch

from swarmd.stage.compute import BACKWARD, FORWARD, Answer, Work
from swarmd.stage.executor import Executor, QueueFull
from swarmd.stage.limits import StageLimits


def work(step: int = 0, mb: int = 0, kind: str = FORWARD, rows: int = 2, deadline: float | None = None) -> Work:
    return Work(kind, step, mb, torch.full((rows, 3), float(mb)), None, False,
                asyncio.get_running_loop().create_future(), deadline=deadline)


class Compute:
    """Records each batch it is given (as mb lists) and answers each item with its own x; blocks
    while `gate` is clear, and raises for a batch holding `fail_mb`."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_mb: int | None = None

    def __call__(self, batch: list[Work]) -> list[Answer]:
        self.batches.append([w.mb for w in batch])
        self.entered.set()
        self.gate.wait(10)
        if self.fail_mb is not None and any(w.mb == self.fail_mb for w in batch):
            raise RuntimeError(f"compute failed on {self.fail_mb}")
        return [Answer(w.x.clone()) for w in batch]


@contextlib.asynccontextmanager
async def running(compute: Compute, workers: int = 1, **limits):
    executor = Executor(compute, StageLimits(**limits), workers, "test")
    task = asyncio.create_task(executor.run())
    try:
        yield executor
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        executor.close(RuntimeError("closed"))
        compute.gate.set()
        await executor.join()


async def entered(compute: Compute) -> None:
    """Until a worker is inside `compute` (the event is set from its thread)."""
    async with asyncio.timeout(5):
        while not compute.entered.is_set():
            await asyncio.sleep(0.005)


async def test_a_full_queue_refuses_at_once_and_depth_counts_queued_and_computing():
    compute = Compute()
    compute.gate.clear()
    async with running(compute, queue_size=2, max_batch=1) as executor:
        first = work(mb=0)
        executor.submit(first)
        await entered(compute)  # taken out of the queue, computing
        executor.submit(work(mb=1))
        executor.submit(work(mb=2))
        assert executor.depth == 3
        with pytest.raises(QueueFull, match="queue_size"):
            executor.submit(work(mb=3))
        compute.gate.set()
        assert torch.equal((await first.future).tensor, first.x)


async def test_compatible_work_is_batched_up_to_max_batch_and_each_gets_its_own_answer():
    """Held behind a first item: five forwards of step 0, one of step 1 and one backward queue up.
    Expected: the step-0 forwards go in batches of at most max_batch (3) in arrival order, the
    others alone, and every future holds its own item's answer."""
    compute = Compute()
    compute.gate.clear()
    async with running(compute, max_batch=3) as executor:
        items = [work(mb=0)]
        executor.submit(items[0])
        await entered(compute)
        items += [work(mb=m) for m in range(1, 6)] + [work(step=1, mb=6)]
        items.append(Work(BACKWARD, 0, 7, torch.zeros(2, 3), torch.zeros(2, 3), False,
                          asyncio.get_running_loop().create_future()))
        for item in items[1:]:
            executor.submit(item)
        compute.gate.set()
        answers = await asyncio.gather(*(item.future for item in items))
    assert compute.batches == [[0], [1, 2, 3], [4, 5], [6], [7]]
    for item, answer in zip(items, answers):
        assert torch.equal(answer.tensor, item.x)
    assert all(item.started for item in items)


async def test_work_whose_caller_left_or_whose_deadline_passed_is_skipped_and_cancelled():
    compute = Compute()
    compute.gate.clear()
    async with running(compute, max_batch=4) as executor:
        head = work(mb=0)
        executor.submit(head)
        await entered(compute)
        gone, late, kept = work(mb=1), work(mb=2, deadline=asyncio.get_running_loop().time()), work(mb=3)
        gone.abandoned = True
        for item in (gone, late, kept):
            executor.submit(item)
        compute.gate.set()
        await kept.future
    assert gone.future.cancelled() and late.future.cancelled()
    assert compute.batches == [[0], [3]]


async def test_a_failed_batch_fails_its_own_items_only_and_the_worker_goes_on():
    compute = Compute()
    compute.fail_mb = 1
    compute.gate.clear()
    async with running(compute, max_batch=2) as executor:
        head = work(mb=0)
        executor.submit(head)
        await entered(compute)
        failing = [work(mb=1), work(mb=2)]  # one batch: both fail
        later = work(step=1, mb=3)  # incompatible: a batch of its own, after
        for item in (*failing, later):
            executor.submit(item)
        compute.gate.set()
        await head.future
        for item in failing:
            with pytest.raises(RuntimeError, match="compute failed on 1"):
                await item.future
        assert torch.equal((await later.future).tensor, later.x)


async def test_close_fails_queued_work_and_refuses_later_submits():
    compute = Compute()
    compute.gate.clear()
    executor = Executor(compute, StageLimits(max_batch=1), 1, "test")
    task = asyncio.create_task(executor.run())
    head, queued = work(mb=0), work(mb=1)
    executor.submit(head)
    await entered(compute)
    executor.submit(queued)
    error = RuntimeError("the stage is stopping")
    executor.close(error)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    compute.gate.set()  # the thread finishes its batch; its answer is not delivered
    for item in (head, queued):
        with pytest.raises(RuntimeError, match="stopping"):
            await item.future
    with pytest.raises(RuntimeError, match="stopping"):
        executor.submit(work(mb=2))
    assert executor.depth == 0


async def test_join_waits_for_the_batch_under_way_then_no_thread_of_the_pool_is_left():
    compute = Compute()
    compute.gate.clear()
    executor = Executor(compute, StageLimits(max_batch=1), 2, "joined")
    task = asyncio.create_task(executor.run())
    executor.submit(work(mb=0))
    await entered(compute)
    executor.close(RuntimeError("the stage is stopping"))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    joining = asyncio.create_task(executor.join())
    done, _ = await asyncio.wait([joining], timeout=0.2)
    assert not done  # a join that did not wait would be done by now; the batch still holds its thread
    compute.gate.set()
    await asyncio.wait_for(joining, 5)
    assert not [t for t in threading.enumerate() if t.name.startswith("joined")]


async def test_samples_per_s_is_measured_from_compute():
    compute = Compute()
    async with running(compute) as executor:
        item = work(mb=0, rows=4)
        executor.submit(item)
        await item.future
        assert executor.samples_per_s > 0
