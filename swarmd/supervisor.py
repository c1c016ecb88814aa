"""Long-lived loops restarted, not lost: one owner that hears every failure of the daemon's loops.

Why: a stage sync, a trainer, a gossip round or the joining loop runs for the daemon's life, and a
bug or a value nobody foresaw used to end such a task for good (one malformed DHT record stopped
the stage sync and the gossip on every daemon, and nothing said so but a line in the log). Under a
`Supervisor` an unexpected error is logged with its traceback, recorded in `Faults` (which
`swarmctl status` shows: task, restarts, last error) and the task restarted after a backoff that
doubles from `Backoff.initial_s` up to `Backoff.max_s`, so a task failing at once on every start
costs a log line per `max_s`, not a busy loop. A task that ran `max_s` without failing starts its
backoff afresh. Restarts are not capped: a daemon that stopped trying would stop the swarm's
training as surely as the bug did; the operator sees the count grow in `swarmctl status`.

Errors a task's owner expects to end it (`final`) are not restarted: they reach the caller of
`run`, as before. Cancellation always propagates.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from transport.tasks import TaskSet

log = logging.getLogger(__name__)

#: Tasks whose faults are shown; the least recently failed are forgotten first (task names carry
#: job ids, so a long-lived daemon would otherwise keep every ended job's entry).
MAX_FAULTS_SHOWN = 64
#: Characters of an error message kept for `status`; the log has it whole, with its traceback.
MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class Backoff:
    initial_s: float = 0.5  # a transient fault (a race at start-up) is retried almost at once
    max_s: float = 30.0  # a fault on every start costs one restart (and one traceback) per 30 s
    factor: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s or self.factor < 1:
            raise ValueError("Backoff needs 0 < initial_s <= max_s and factor >= 1")

    def delay(self, failures_in_a_row: int) -> float:
        return min(self.max_s, self.initial_s * self.factor ** max(0, failures_in_a_row - 1))


@dataclass
class Fault:
    task: str
    restarts: int
    last_error: str
    at: float  # wall-clock time of the last failure
    retry_at: float | None  # wall-clock time of the next start; None once it runs again

    def as_dict(self, now: float) -> dict[str, Any]:
        return {"task": self.task, "restarts": self.restarts, "last_error": self.last_error,
                "last_error_s_ago": round(now - self.at, 1),
                "retry_in_s": None if self.retry_at is None else round(max(0.0, self.retry_at - now), 1)}


def _describe(exc: BaseException) -> str:
    """One line for people: a task group's failure by its first error, the others counted."""
    if isinstance(exc, BaseExceptionGroup):
        leaves = exc.exceptions
        first = _describe(leaves[0])
        return first if len(leaves) == 1 else f"{first} (and {len(leaves) - 1} more)"
    return f"{type(exc).__name__}: {exc}"


class Faults:
    """The daemon's board of supervised failures, read by `swarmctl status` (`supervision`)."""

    def __init__(self, max_shown: int = MAX_FAULTS_SHOWN) -> None:
        self.max_shown = max_shown
        self._by_task: collections.OrderedDict[str, Fault] = collections.OrderedDict()
        self.total = 0  # failures ever, forgotten tasks included

    def failed(self, task: str, exc: BaseException, retry_in_s: float) -> Fault:
        now = time.time()
        error = _describe(exc)[:MAX_ERROR_CHARS]
        fault = self._by_task.pop(task, None) or Fault(task, 0, "", now, None)
        fault.restarts += 1
        fault.last_error, fault.at, fault.retry_at = error, now, now + retry_in_s
        self._by_task[task] = fault
        self.total += 1
        while len(self._by_task) > self.max_shown:
            self._by_task.popitem(last=False)
        return fault

    def restarted(self, task: str) -> None:
        fault = self._by_task.get(task)
        if fault is not None:
            fault.retry_at = None

    def get(self, task: str) -> Fault | None:
        return self._by_task.get(task)

    def status(self) -> dict[str, Any]:
        now = time.time()
        return {"failures_total": self.total, "tasks": [f.as_dict(now) for f in reversed(self._by_task.values())]}


class Supervisor:
    """Runs loops for `owner`, restarting them on unexpected errors; `faults` is the shared board."""

    def __init__(self, owner: str, faults: Faults | None = None, backoff: Backoff = Backoff()) -> None:
        self.owner, self.backoff = owner, backoff
        self.faults = faults if faults is not None else Faults()
        self._tasks = TaskSet(owner)

    async def run(self, name: str, start: Callable[[], Awaitable[Any]], *,
                  final: tuple[type[BaseException], ...] = ()) -> Any:
        """Await `start()` until it returns (its value is returned) or raises one of `final`;
        any other error is logged, recorded and `start()` called again after the backoff."""
        task = f"{self.owner}: {name}"
        in_a_row = 0
        while True:
            began = time.monotonic()
            try:
                return await start()
            except asyncio.CancelledError:
                raise
            except final:
                raise
            except Exception as exc:  # noqa: BLE001 - the point: any bug is survived and shown
                in_a_row = 1 if time.monotonic() - began >= self.backoff.max_s else in_a_row + 1
                delay = self.backoff.delay(in_a_row)
                self.record(name, exc, delay)
            await asyncio.sleep(delay)
            self.recovered(name)
            log.info("%s restarting", task)

    def record(self, name: str, exc: BaseException, retry_in_s: float) -> None:
        """A failure of `name` that its caller survives and retries on its own (one job's start in a
        loop that serves every job, one announcement's value): logged with its traceback and put in
        `faults`, like a restarted task's, so `swarmctl status` shows what only a log line told of."""
        task = f"{self.owner}: {name}"
        fault = self.faults.failed(task, exc, retry_in_s)
        log.error("%s failed (%d times; again in %.1f s):\n%s", task, fault.restarts, retry_in_s,
                  "".join(traceback.format_exception(exc)).rstrip())

    def recovered(self, name: str) -> None:
        """`name` runs again (status stops counting down to its retry); its failures stay counted."""
        self.faults.restarted(f"{self.owner}: {name}")

    def spawn(self, name: str, start: Callable[[], Awaitable[Any]], *,
              final: tuple[type[BaseException], ...] = ()) -> asyncio.Task:
        """`run` in a task this supervisor owns (cancelled by `aclose`)."""
        return self._tasks.spawn(self.run(name, start, final=final), name)

    async def aclose(self, msg: str = "owner closed") -> None:
        await self._tasks.aclose(msg)
