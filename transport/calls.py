"""The caller's side of a connection: its calls in flight and what answers them.

`Calls` starts each call (an id from `RpcProtocol`, an `Inbox` its answer frames land in), sends
its request, waits for the answer or the next stream item and ends it (taking back what is unsent
and telling the server when it is unanswered). `StreamCall` is the async iterator over a streamed
answer. `RpcProtocol` decides which frames answer which call; these only hand them to the task
that waits. Split from `Connection` so the socket shell keeps to the socket.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING

import transport.payload as payload
from .errors import DeadlineExceeded, ProtocolError, RemoteError
from .message import Message
from .wire import Frame, Kind

if TYPE_CHECKING:
    from .connection import Connection

log = logging.getLogger(__name__)


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


class Calls:
    """The calls in flight on `conn`, by request id; at most `max_pending_calls` unary calls wait
    for a slot at once."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._inboxes: dict[int, Inbox] = {}
        self._slots = asyncio.Semaphore(conn._config.max_pending_calls)

    def __len__(self) -> int:
        return len(self._inboxes)

    async def call(self, method: str, message: Message, timeout: float) -> Message:
        """Send one request and wait for its one reply; DeadlineExceeded after `timeout` seconds."""
        scope = asyncio.timeout(timeout)
        try:
            async with scope, self._slots:
                rid = self.start(stream=False)
                try:
                    await self.send_request(rid, method, message, self._conn._loop.time() + timeout)
                    return await self.answer_message(await self.next_frame(rid))
                finally:
                    self.end(rid)
        except TimeoutError:
            if scope.expired():
                raise DeadlineExceeded(f"{method} got no answer within {timeout} s") from None
            raise

    def start(self, stream: bool) -> int:
        rid = self._conn._proto.start_call(stream)
        self._inboxes[rid] = Inbox()
        return rid

    def answer(self, rid: int, frame: Frame) -> None:
        """An answer frame the protocol matched to call `rid`."""
        if frame.kind is Kind.STREAM_ITEM:
            self._conn._account_undelivered(payload.frame_bytes(frame))
        self._inboxes[rid].push(frame)

    def end(self, rid: int) -> None:
        """Forget a call; if it is unanswered, take back what is unsent and tell the server."""
        inbox = self._inboxes.pop(rid, None)
        if inbox is None:
            return
        conn = self._conn
        for item in inbox.frames:  # items the consumer never took
            if item.kind is Kind.STREAM_ITEM:
                conn._account_undelivered(-payload.frame_bytes(item))
        cancel = conn._proto.end_call(rid, untouched=conn._sender.drop(rid).untouched)
        if cancel is not None:
            conn._sender.control(cancel)

    def fail_all(self, error: BaseException) -> None:
        """The connection is gone: every waiting call fails with `error`."""
        for inbox in self._inboxes.values():
            inbox.fail(error)

    async def send_request(self, rid: int, method: str, message: Message, deadline: float) -> None:
        conn = self._conn
        extra = {"m": method, "t": max(0.0, deadline - conn._loop.time())}
        await conn._send_message(Kind.REQUEST, rid, message, extra)
        conn._proto.call_sent(rid)

    async def next_frame(self, rid: int) -> Frame:
        """Call `rid`'s next answer frame, once it arrives; the connection's error once it is gone."""
        return await self._inboxes[rid].next()

    async def answer_message(self, frame: Frame) -> Message:
        if frame.kind is Kind.ERROR:
            raise RemoteError(str(frame.header.get("code")), str(frame.header.get("msg")))
        try:
            meta, tensors = await self._conn._decode(frame.header, frame.buffers)
        except ProtocolError as exc:  # the peer sent a reply that does not decode: drop it
            log.warning("closing connection to %s: %s", self._conn._address, exc)
            self._conn.abort(exc)
            raise
        return Message(meta, tensors)

    async def next_stream_item(self, rid: int) -> Message | None:
        frame = await self.next_frame(rid)
        if frame.kind is Kind.STREAM_ITEM:
            self._conn._account_undelivered(-payload.frame_bytes(frame))
        elif frame.kind is Kind.STREAM_END:
            return None
        return await self.answer_message(frame)


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
                    self._rid = self._conn._calls.start(stream=True)
                    await self._conn._calls.send_request(self._rid, self._method, self._message, self._deadline)
                assert self._rid is not None
                item = await self._conn._calls.next_stream_item(self._rid)
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
            self._conn._calls.end(self._rid)
            self._rid = None
