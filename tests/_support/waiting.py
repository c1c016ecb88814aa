"""Waiting on a condition, the one way tests wait: poll a predicate until it holds or a deadline passes,
and fail naming what never happened. A fixed sleep either wastes time or, under load, is too short."""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.2,
             detail: Callable[[], str] | None = None) -> T:
    """Poll until `predicate()` returns something truthy and return it; fail naming `what`, and
    with `detail()` (what the test saw: a state, a journal) when given."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            message = f"timed out after {timeout:g} s waiting for {what}"
            raise AssertionError(message if detail is None else f"{message}\n{detail()}")
        time.sleep(interval)


async def until(predicate: Callable[[], T | Awaitable[T]], timeout: float, what: str,
                interval: float = 0.02, detail: Callable[[], str] | None = None) -> T:
    """`wait_for` inside an event loop: the predicate may be a plain or an async function."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() >= deadline:
            message = f"timed out after {timeout:g} s waiting for {what}"
            raise AssertionError(message if detail is None else f"{message}\n{detail()}")
        await asyncio.sleep(interval)
