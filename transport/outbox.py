"""What a connection's writer sends next, and how many payload bytes may wait to be sent.

Control frames (ping, pong, cancel) go first. Then the outbox serves the call with the fewest
payload bytes left to send, one frame (at most one chunk) at a time, oldest call first on ties.
So a small reply queued behind another call's 100 MB tensor waits for at most one chunk of it, and
of several bulk transfers the one nearest completion finishes first, so its receiver can start
working on it, instead of all of them crawling to the finish together as round-robin would make
them (shortest-remaining-first minimises the mean completion time). A big transfer only ever waits
for smaller ones queued alongside it. A call's frames never reorder among themselves: the wire
needs a chunked message's chunks in order, and a stream's end after its items.

The budget bounds payload bytes queued on a connection. A sender reserves before it encodes and
the writer gives bytes back as frames leave, so a peer that stops reading makes callers wait
instead of making us buffer their tensors without end.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from dataclasses import dataclass

from .wire import Piece


def payload_bytes(frame: list[Piece]) -> int:
    """Payload carried by one encoded frame: everything after its head (see wire.encode_frame)."""
    return sum(memoryview(p).nbytes for p in frame[1:])


@dataclass(slots=True)
class Outgoing:
    key: int | None  # the call it belongs to, None for control frames
    frame: list[Piece]
    payload: int


@dataclass(slots=True)
class _Queue:
    frames: deque[Outgoing]
    order: int  # arrival, for ties
    remaining: int = 0  # payload bytes still queued
    partial: bool = False  # some of its frames were written, some still wait


@dataclass(frozen=True, slots=True)
class Dropped:
    """What `Outbox.drop` took back from a call."""

    payload: int  # bytes of payload that will not be sent (give them back to the budget)
    partial: bool  # a message of this call is cut short on the wire: abandon it with a frame
    untouched: bool  # the call had frames queued and none was sent: the peer never heard of it


class Outbox:
    def __init__(self) -> None:
        self._control: deque[Outgoing] = deque()
        self._calls: dict[int, _Queue] = {}
        # (remaining, order, key); stale once the key's remaining changed or it left the outbox
        self._heap: list[tuple[int, int, int]] = []
        self._arrivals = itertools.count()
        self._wakeup: asyncio.Future[None] | None = None
        self.queued_payload = 0

    def put_control(self, frame: list[Piece]) -> None:
        self._control.append(Outgoing(None, frame, 0))
        self._wake()

    def put(self, key: int, frames: list[list[Piece]]) -> None:
        queue = self._calls.get(key)
        if queue is None:
            queue = self._calls[key] = _Queue(deque(), next(self._arrivals))
        for frame in frames:
            size = payload_bytes(frame)
            queue.frames.append(Outgoing(key, frame, size))
            queue.remaining += size
            self.queued_payload += size
        heapq.heappush(self._heap, (queue.remaining, queue.order, key))
        self._wake()

    def drop(self, key: int) -> Dropped:
        """Forget a call's unsent frames."""
        queue = self._calls.pop(key, None)
        if queue is None:
            return Dropped(0, False, False)
        if not self._calls:
            self._heap.clear()
        self.queued_payload -= queue.remaining
        return Dropped(queue.remaining, queue.partial, not queue.partial)

    def __bool__(self) -> bool:
        return bool(self._control or self._calls)

    async def get(self) -> Outgoing:
        while not self:
            self._wakeup = asyncio.get_running_loop().create_future()
            try:
                await self._wakeup
            finally:
                self._wakeup = None
        return self.pop()

    def pop(self) -> Outgoing:
        if self._control:
            return self._control.popleft()
        while True:
            remaining, _, key = self._heap[0]
            queue = self._calls.get(key)
            if queue is not None and queue.remaining == remaining:
                break
            heapq.heappop(self._heap)  # stale
        item = queue.frames.popleft()
        queue.remaining -= item.payload
        self.queued_payload -= item.payload
        if queue.frames:
            queue.partial = True
            heapq.heapreplace(self._heap, (queue.remaining, queue.order, key))
        else:
            del self._calls[key]
            heapq.heappop(self._heap)
            if not self._calls:
                self._heap.clear()
        return item

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)


class Budget:
    """Bytes that may be reserved at once; waiters are served first come, first served.

    A single reservation larger than the capacity is granted when nothing else is held, so one
    oversized message slows the connection down instead of deadlocking it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._error: BaseException | None = None

    async def acquire(self, n: int) -> None:
        if self._error is not None:
            raise self._error
        if not self._waiters and self._fits(n):
            self.used += n
            return
        waiter = asyncio.get_running_loop().create_future()
        entry = (n, waiter)
        self._waiters.append(entry)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release(n)  # granted just as we were cancelled: give it back
            elif entry in self._waiters:
                self._waiters.remove(entry)
                self._grant()
            raise

    def release(self, n: int) -> None:
        self.used -= n
        self._grant()

    def fail(self, error: BaseException) -> None:
        """Wake every waiter with `error` (the connection died); later acquires raise it too."""
        self._error = error
        while self._waiters:
            _, waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)

    def _fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.capacity

    def _grant(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            n, waiter = self._waiters.popleft()
            if not waiter.done():
                self.used += n
                waiter.set_result(None)
