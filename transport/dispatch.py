"""The server side of one connection: requests admitted, their handlers run, their answers sent.

A request the protocol accepted (`protocol.Incoming`) is refused at once with a typed error when
the server is going away, the caller is over its rate, or too many handlers run; otherwise its
handler runs in a task the connection owns, bounded by the deadline the caller sent, and its
reply, stream items or error go out through the connection's `Sender`. A handler's failure is the
caller's answer (`RpcError` as its code, anything else as `internal`); a request whose tensors do
not decode is the peer's fault and drops the connection. Split from `Connection` so the socket
shell keeps to the socket.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import transport.payload as payload
from .errors import ProtocolError, RpcError
from .message import Request, Router
from .protocol import Incoming
from .ratelimit import RateLimiter
from .wire import ID, Frame, Kind, encode_frame

if TYPE_CHECKING:
    from .connection import Connection

log = logging.getLogger(__name__)

# Error codes a caller may see in RemoteError.code besides the handler's own.
CODE_INTERNAL = "internal"
CODE_UNKNOWN_METHOD = "unknown_method"
CODE_DEADLINE = "deadline_exceeded"
CODE_OVERLOADED = "overloaded"
CODE_GOING_AWAY = "going_away"
CODE_CANCELLED = "cancelled"
CODE_RATE_LIMITED = "rate_limited"


class Dispatch:
    """Incoming requests of `conn`, each run by `router`'s handler; `running` maps request ids to
    the handler tasks (the connection waits for them when it closes)."""

    def __init__(self, conn: Connection, router: Router | None, limiter: RateLimiter | None) -> None:
        self._conn, self._router, self._limiter = conn, router, limiter
        self._config = conn._config
        self.running: dict[int, asyncio.Task] = {}
        self.rate_key: object = None  # whom the rate limit counts: the proven peer id, else the source

    def request(self, request: Incoming) -> None:
        rid, conn = request.rid, self._conn
        if conn._proto.going_away:
            self._refuse(rid, CODE_GOING_AWAY, "the server is shutting down")
        elif self._limiter is not None and not self._limiter.allow(self.rate_key):
            if self._config.traffic is not None:
                self._config.traffic.rate_limited_calls += 1
            self._refuse(rid, CODE_RATE_LIMITED, f"over {self._config.rate_limit_per_s} calls/s")
        elif len(self.running) >= self._config.max_concurrent_handlers:
            self._refuse(rid, CODE_OVERLOADED, f"{len(self.running)} calls already running")
        else:
            task = self.running[rid] = conn._tasks.spawn(self._serve(request), f"request {rid}")
            # Not a `finally` in _serve: a task cancelled before its first step never runs its body.
            task.add_done_callback(lambda _, rid=rid: self._done(rid))

    def cancelled(self, rid: int) -> None:
        """The caller gave the call up: stop its handler (none runs for a request refused at once)."""
        task = self.running.get(rid)
        if task is not None:
            task.cancel("the caller cancelled")

    def _refuse(self, rid: int, code: str, message: str) -> None:
        self._conn._proto.request_done(rid)
        self._send_error(rid, code, message)

    def _done(self, rid: int) -> None:
        self.running.pop(rid, None)
        self._conn._proto.request_done(rid)

    async def _serve(self, request: Incoming) -> None:
        rid, method, conn = request.rid, request.method, self._conn
        deadline = None if request.timeout is None else conn._loop.time() + request.timeout
        scope = asyncio.timeout_at(deadline)
        try:
            async with scope:
                await self._run_handler(rid, method, request.frame, deadline)
        except TimeoutError:
            if not scope.expired():
                raise
            self._send_error(rid, CODE_DEADLINE, f"{method} ran past its deadline")
        except RpcError as exc:
            self._send_error(rid, exc.code, exc.message)
        except ProtocolError as exc:  # the request's tensors do not decode: the peer's fault
            log.warning("closing connection from %s: %s", conn._address, exc)
            conn.abort(exc)
        except asyncio.CancelledError:
            if conn._sender.drop(rid).partial:  # abandon a reply that is partly on the wire
                self._send_error(rid, CODE_CANCELLED, "cancelled")
            raise
        except Exception as exc:
            log.exception("handler of %s failed", method)
            self._send_error(rid, CODE_INTERNAL, f"{type(exc).__name__}: {exc}")

    async def _run_handler(self, rid: int, method: str, frame: Frame, deadline: float | None) -> None:
        conn = self._conn
        entry = self._router.lookup(method) if self._router is not None else None
        if entry is None:
            raise RpcError(CODE_UNKNOWN_METHOD, f"no method {method!r}")
        kind, handler = entry
        meta, tensors = await conn._decode(frame.header, frame.buffers)
        assert conn.remote is not None
        request = Request(method, meta, tensors, deadline, conn.remote)
        if kind == "unary":
            reply = await handler(request)
            await conn._send_message(Kind.RESPONSE, rid, payload.check_reply(method, reply), {})
            return
        items = handler(request)
        try:
            async for item in items:
                await conn._send_message(Kind.STREAM_ITEM, rid, payload.check_reply(method, item), {})
        finally:
            await items.aclose()
        conn._sender.frames(rid, [encode_frame(Kind.STREAM_END, {ID: rid})])

    def _send_error(self, rid: int, code: str, message: str) -> None:
        proto = self._conn._proto
        if proto.closed is None:
            self._conn._sender.frames(rid, [proto.error_frame(rid, code, message)])
