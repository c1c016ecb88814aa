"""The caller's side of a call in flight: a inbox its answer frames land in, and `StreamCall`,
the async iterator over a streamed answer. `RpcProtocol` decides which frames answer which call;
these only hand them to the task that waits."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

from .errors import DeadlineExceeded
from .message import Message
from .wire import Frame

if TYPE_CHECKING:
    from .connection import Connection


class Inbox:
    """Answer frames of one call (one for unary, many for a stream), or the error that ends it."""

    __slots__ = ("frames", "waiter", "error")

    def __init__(self) -> None:
        self.frames: deque[Frame] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None

    def push(self, frame: Frame) -> None:
        self.frames.append(frame)
        self._wake()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._wake()

    async def next(self) -> Frame:
        while not self.frames:
            if self.error is not None:
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.frames.popleft()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class StreamCall:
    """The caller's end of a streamed answer. Iterating sends the request on first use; leaving
    early (`aclose`, `async with` exit, break then close) cancels the call on the server."""

    def __init__(self, get_conn, method: str, message: Message, timeout: float) -> None:
        self._get_conn = get_conn
        self._method, self._message, self._timeout = method, message, timeout
        self._conn: Connection | None = None
        self._rid: int | None = None
        self._deadline: float | None = None
        self._finished = False

    async def __aenter__(self) -> "StreamCall":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __aiter__(self) -> "StreamCall":
        return self

    async def __anext__(self) -> Message:
        if self._finished:
            raise StopAsyncIteration
        if self._deadline is None:
            self._deadline = asyncio.get_running_loop().time() + self._timeout
        scope = asyncio.timeout_at(self._deadline)
        try:
            async with scope:
                if self._conn is None:
                    conn = self._get_conn()
                    self._conn = await conn if asyncio.iscoroutine(conn) else conn
                    self._rid = self._conn._start_call(stream=True)
                    await self._conn._send_request(self._rid, self._method, self._message, self._deadline)
                assert self._rid is not None
                item = await self._conn._next_stream_item(self._rid)
        except TimeoutError:
            await self.aclose()
            if scope.expired():
                raise DeadlineExceeded(f"stream {self._method} ran past {self._timeout} s") from None
            raise
        except BaseException:
            await self.aclose()
            raise
        if item is None:
            await self.aclose()
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        self._finished = True
        if self._conn is not None and self._rid is not None:
            self._conn._end_call(self._rid)
            self._rid = None
