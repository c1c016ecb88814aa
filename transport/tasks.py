"""A supervised set of tasks: every task the transport starts has an owner that cancels it.

A connection spawns a task per incoming request and cannot use one `async with TaskGroup()` scope
(its lifetime is driven by protocol callbacks, not by one coroutine), so it owns a TaskSet instead:
tasks remove themselves when done, `aclose()` cancels whatever is left and waits for it, and a task
that fails with anything but a TransportError (a bug, or a loop that must not end) is logged with
its traceback and handed to the owner's `on_failure(name, exc)`, which decides: abort the
connection, stop the part, show it in a status. Without `on_failure` the log is all there is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from .errors import TransportError

log = logging.getLogger(__name__)


OnFailure = Callable[[str, BaseException], None]


class TaskSet:
    def __init__(self, owner: str, on_failure: OnFailure | None = None) -> None:
        self._owner = owner
        self._on_failure = on_failure
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self._owner} is closed; cannot start {name}")
        task = asyncio.get_running_loop().create_task(coro, name=f"{self._owner}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._reap)
        return task

    def cancel_all(self, msg: str) -> None:
        """Stop accepting tasks and cancel the running ones (from a callback: no await needed)."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel(msg)

    async def aclose(self, msg: str = "owner closed") -> None:
        """Cancel every task and wait for them; called from one of the set's own tasks, that task
        is cancelled too (it belongs to the set) and does not wait for itself."""
        self.cancel_all(msg)
        current = asyncio.current_task()
        pending = [t for t in self._tasks if t is not current]
        if pending:
            await asyncio.wait(pending)

    def __len__(self) -> int:
        return len(self._tasks)

    def _reap(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        # Transport errors (a dial that failed, a peer that vanished) are expected and reach whoever
        # awaited the task; anything else is a bug and must not vanish silently.
        if isinstance(exc, TransportError):
            log.debug("%s: task %s failed", self._owner, task.get_name(), exc_info=exc)
            return
        log.error("%s: task %s failed", self._owner, task.get_name(), exc_info=exc)
        if self._on_failure is not None:
            self._on_failure(task.get_name(), exc)
