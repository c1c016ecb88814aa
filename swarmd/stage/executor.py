"""One bounded queue per served stage, drained by a few workers that batch compatible microbatches.

The queue is the stage's only buffer: `submit` refuses at once when it is full (the server answers
`busy` and the trainer reroutes), so the memory pinned by queued tensors is bounded by the queue
size whatever the number of trainers. A worker takes the oldest item and up to `max_batch - 1`
more with the same `Work.key` (kind, step, shapes), runs them as one compute call in a thread pool
(never on the event loop) and answers each item's future separately.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from swarmd.errors import SwarmdError
from swarmd.stage.compute import Answer, Work
from swarmd.stage.limits import StageLimits

RATE_EMA = 0.2  # weight of the newest batch in the samples/s estimate: a few batches to settle


class QueueFull(SwarmdError):
    """The stage's queue holds `queue_size` microbatches; the call is answered `busy`."""


class Executor:
    def __init__(self, compute: Callable[[list[Work]], list[Answer]], limits: StageLimits,
                 workers: int, name: str) -> None:
        self._compute = compute
        self._limits = limits
        self._workers = workers
        self._queue: deque[Work] = deque()
        self._ready = asyncio.Event()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._in_compute = 0
        self._closed: Exception | None = None
        self.samples_per_s = 0.0  # measured on compute alone: what this peer can do when fed

    @property
    def depth(self) -> int:
        """Microbatches queued or being computed."""
        return len(self._queue) + self._in_compute

    def submit(self, work: Work) -> None:
        if self._closed is not None:
            raise self._closed
        if len(self._queue) >= self._limits.queue_size:
            raise QueueFull(f"{len(self._queue)} microbatches already queued (queue_size)")
        self._queue.append(work)
        self._ready.set()

    async def run(self) -> None:
        """The workers; cancel this to stop them. Queued items are failed by `close`."""
        async with asyncio.TaskGroup() as group:
            for i in range(self._workers):
                group.create_task(self._worker(), name=f"stage worker {i}")

    def close(self, error: Exception) -> None:
        """Fail whatever is still queued (and, once the workers are cancelled, what they hold)
        with `error`, and let the pool's threads end after their batch (`join` waits for that)."""
        self._closed = error
        while self._queue:
            work = self._queue.popleft()
            if not work.future.done():
                work.future.set_exception(error)
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def join(self) -> None:
        """After `close`: until every compute thread has ended (a batch under way finishes first;
        compute cannot be interrupted). The caller bounds the wait (the daemon's drain deadline)."""
        await join_threads(self._pool)

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            samples = sum(w.x.shape[0] for w in batch)
            self._in_compute += len(batch)
            began = time.perf_counter()
            try:
                answers = await loop.run_in_executor(self._pool, self._compute, batch)
            except asyncio.CancelledError:
                # Stopping: the callers get the closing error (a cancelled future would leave their
                # handlers without an answer until the deadline).
                for w in batch:
                    if not w.future.done():
                        w.future.set_exception(self._closed or RuntimeError("the stage executor stopped"))
                raise
            except Exception as exc:
                for w in batch:
                    if not w.future.done():
                        w.future.set_exception(exc)
                continue
            finally:
                self._in_compute -= len(batch)
            self._measure(samples, time.perf_counter() - began)
            for w, answer in zip(batch, answers):
                if not w.future.done():
                    w.future.set_result(answer)

    async def _next_batch(self) -> list[Work]:
        while True:
            while not self._queue:
                self._ready.clear()
                await self._ready.wait()
            head = self._queue.popleft()
            if _given_up(head):  # its caller left while it waited
                continue
            batch = [head]
            key = head.key
            for work in list(self._queue):
                if len(batch) >= self._limits.max_batch:
                    break
                if work.key == key and not _given_up(work):
                    self._queue.remove(work)
                    batch.append(work)
            for work in batch:
                work.started = True
            return batch

    def _measure(self, samples: int, seconds: float) -> None:
        rate = samples / max(seconds, 1e-9)
        self.samples_per_s = rate if self.samples_per_s == 0.0 else (1 - RATE_EMA) * self.samples_per_s + RATE_EMA * rate


def _given_up(work: Work) -> bool:
    """Was the work's caller gone before compute began? Its future is then settled here (cancelled),
    which is what releases its claim (the service's settle callback), whoever was waiting."""
    past = work.deadline is not None and asyncio.get_running_loop().time() >= work.deadline
    if (work.abandoned or past) and not work.future.done():
        work.future.cancel()
    return work.future.done()


async def join_threads(pool: ThreadPoolExecutor) -> None:
    """Shut `pool` down and wait, off the event loop, until its threads have ended. Cancelling the
    wait leaves the threads to end on their own (the pool is shut down either way)."""
    pool.shutdown(wait=False, cancel_futures=True)
    await asyncio.to_thread(pool.shutdown, wait=True)
