"""Time as an injectable object, so a thousand-node simulation can run on virtual time.

Two readings matter: a monotonic one for timeouts and schedules, and a wall-clock one for absolute
record expirations that other machines must understand. Code that takes a `Clock` never calls
`time.time()` itself, which is what lets tests drive it from a virtual clock.

`VirtualEventLoop` is an asyncio loop whose time is a `VirtualClock`: whenever nothing is ready to
run, it jumps straight to the next timer instead of sleeping. `asyncio.sleep`, `asyncio.timeout` and
`wait_for` then cost no real time, and runs are deterministic because asyncio's ready queue is FIFO.
It serves no real file descriptors: it is for in-memory networks only.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

#: Wall time the virtual clock starts at: a fixed, realistic epoch second keeps runs reproducible.
VIRTUAL_EPOCH = 1_800_000_000.0


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...


class RealClock:
    """The machine's clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


class VirtualClock:
    """A clock that only moves when told to (by a test or by `VirtualEventLoop`)."""

    def __init__(self, epoch: float = VIRTUAL_EPOCH) -> None:
        self.now = 0.0
        self.epoch = epoch

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.epoch + self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not run backwards")
        self.now += seconds


class _JumpingSelector(selectors.BaseSelector):
    """Pretends to wait for I/O by advancing the clock; no descriptor ever becomes ready."""

    def __init__(self, clock: VirtualClock) -> None:
        self._clock = clock
        self._keys: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, fileobj if isinstance(fileobj, int) else fileobj.fileno(), events, data)
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj)

    def select(self, timeout: float | None = None) -> list:
        if timeout is None:
            raise RuntimeError("virtual loop deadlocked: nothing is scheduled and nothing is ready")
        if timeout > 0:
            self._clock.advance(timeout)
        return []

    def get_map(self) -> dict:
        return dict(self._keys)

    def close(self) -> None:
        self._keys.clear()


class VirtualEventLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: VirtualClock) -> None:
        self._virtual_clock = clock
        super().__init__(selector=_JumpingSelector(clock))

    def time(self) -> float:
        return self._virtual_clock.now


def run_virtual(main: Coroutine[Any, Any, T], clock: VirtualClock | None = None) -> T:
    """Run `main` to completion on virtual time (from synchronous code, e.g. a plain test)."""
    loop = VirtualEventLoop(clock or VirtualClock())
    try:
        return loop.run_until_complete(main)
    finally:
        leftover = asyncio.all_tasks(loop)  # only when `main` failed half-way: cancel as asyncio.run does
        for task in leftover:
            task.cancel()
        if leftover:
            loop.run_until_complete(asyncio.wait(leftover))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
