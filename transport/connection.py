"""One RPC connection over a stream socket (TCP or Unix): a thin asyncio shell around the sans-IO
frame decoder and hello handshake.

Bytes arrive in `data_received`, go through `FrameDecoder`, and each whole frame is dispatched at
once: a reply resolves its caller's future, a request starts a handler task, a cancel cancels one.
One writer task drains the `Outbox` (control frames first, then calls round-robin, one chunk each)
and waits whenever the transport's buffer is full, so the kernel's `TCP_NOTSENT_LOWAT` and our
write-buffer limit keep bulk data queued where a small frame can still overtake it.

Calls go one way: the initiator (the side that dialled) sends requests and the acceptor serves
them with its `Router`; two peers that call each other hold one connection per direction. Anything
a peer does wrong is a ProtocolError that aborts this one connection; every outstanding call then
fails with ConnectionLost.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import sockopts
from .config import RpcConfig
from .errors import (
    ConnectionLost,
    DeadlineExceeded,
    HandshakeError,
    LocalProtocolError,
    MalformedFrame,
    ProtocolError,
    RemoteError,
    RpcError,
)
from .gate import HelloGate, source_of
from .handshake import MAX_HELLO_BYTES, Handshake
from .limits import LENGTH_ENTRY_BYTES, PRELUDE_BYTES, KiB, Limits
from .message import Message, RemoteInfo, Request, Router
from .outbox import Budget, Outbox, payload_bytes
from .ratelimit import RateLimiter
from .seal import Opener, Sealer
from .tasks import TaskSet
from .wire import ID, PRELUDE, VERSION, Frame, FrameDecoder, Kind, Piece, encode_frame, encode_message

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Admit = Callable[[RemoteInfo], "str | None"]
#: A Unix socket's admission by the kernel's SO_PEERCRED (pid, uid, gid) alone, run when the
#: connection is accepted: a refused client never holds a hello slot nor a connection slot.
AdmitLocal = Callable[["tuple[int, int, int] | None"], "str | None"]

MIN_PEER_CHUNK_BYTES = 16 * KiB
"""A peer asking for smaller chunks would make us spend a frame header and a loop turn per few
bytes of a 100 MB tensor; we refuse its hello instead."""
UNDELIVERED_OVERHEAD_BYTES = 256
"""Counted per queued stream item on top of its payload, so empty items cannot pile up for free."""

HELLO_LIMITS = Limits(
    max_header_bytes=2 * MAX_HELLO_BYTES,
    max_buffers_per_frame=0,
    max_buffer_bytes=0,
    max_message_bytes=0,
    max_chunk_bytes=1,
    max_frame_bytes=PRELUDE_BYTES + 2 * MAX_HELLO_BYTES + 1,
    max_inflight_bytes=0,
    max_str_len=MAX_HELLO_BYTES,
    max_bin_len=MAX_HELLO_BYTES,
    max_array_len=16,
    max_map_len=16,
    max_tensor_elements=0,
    max_decompressed_bytes=0,
)
"""What an unproven peer may make us parse: hello frames only, no payload buffers, a few KiB. The
full limits apply from the welcome on, so a stranger cannot make us reserve a 512 MiB message."""
HANDSHAKE_REASON_CHARS = 200
"""A refusal's reason is for the peer's logs; it is cut to this length (it must fit any header)."""
CLOSE_POLL_S = 0.01
"""How often a closing connection looks whether its queue has drained (closing is rare)."""

# Error codes a caller may see in RemoteError.code besides the handler's own.
CODE_INTERNAL = "internal"
CODE_UNKNOWN_METHOD = "unknown_method"
CODE_DEADLINE = "deadline_exceeded"
CODE_OVERLOADED = "overloaded"
CODE_GOING_AWAY = "going_away"
CODE_CANCELLED = "cancelled"
CODE_BAD_REPLY = "bad_reply"
CODE_RATE_LIMITED = "rate_limited"


class _Call:
    """A call we made, waiting for its answer frames (one for unary, many for a stream)."""

    __slots__ = ("stream", "sent", "frames", "waiter", "error", "done")

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.sent = False
        self.frames: deque[Frame] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None
        self.done = False  # the final frame (RESPONSE, STREAM_END or ERROR) arrived

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


class Connection(asyncio.Protocol):
    """Use `await Connection.open(...)` (client) or let `RpcServer` create it (server side)."""

    def __init__(
        self,
        config: RpcConfig,
        *,
        initiator: bool,
        router: Router | None = None,
        admit: Admit | None = None,
        on_closed: Callable[["Connection"], None] | None = None,
        gate: HelloGate | None = None,
        limiter: RateLimiter | None = None,
        admit_local: AdmitLocal | None = None,
    ) -> None:
        self._config = config
        self._admit_local = admit_local
        self._gate = gate
        self._gate_source: str | None = None  # set while we hold a slot of the gate
        self._limiter = limiter
        self._rate_key: object = None
        self._initiator = initiator
        self._router = router
        self._admit = admit
        self._on_closed = on_closed
        self._loop = asyncio.get_running_loop()
        self._decoder = FrameDecoder(HELLO_LIMITS)
        self._send_limits: Limits = config.limits
        self._handshake = Handshake(
            initiator=initiator,
            version=VERSION,
            identity=config.identity,
            swarm_key=config.swarm_key,
            limits=config.limits.as_dict(),
            app=config.app,
            encrypt=config.encrypt,
            encrypt_setting=config.encrypt_setting,
        )
        self._keys: tuple[bytes, bytes] | None = None  # (send, receive) once an encrypted hello is proven
        self._opener: Opener | None = None  # set from the welcome on when encrypting
        # How we write a frame: the transport's writelines, or a Sealer's once the hello is done.
        self._writelines: Callable[[list[Piece]], None] = lambda frame: None
        self._hello_left = 0  # encrypting, in the hello: bytes left of the hello frame being read
        self._hello_prelude = bytearray()
        self._hello_received = False
        self._ready: asyncio.Future[RemoteInfo] = self._loop.create_future()
        self._closed: asyncio.Future[None] = self._loop.create_future()
        self._transport: asyncio.Transport | None = None
        self._address: Any = None
        self._peercred: tuple[int, int, int] | None = None
        self._tasks = TaskSet("connection")
        self._outbox = Outbox()
        self._budget = Budget(config.limits.max_inflight_bytes)
        self._writable = asyncio.Event()
        self._writable.set()
        self._calls: dict[int, _Call] = {}
        self._handlers: dict[int, asyncio.Task] = {}
        self._ids = itertools.count(1)
        self._call_slots = asyncio.Semaphore(config.max_pending_calls)
        self._error: BaseException | None = None
        self._going_away = False
        self._last_rx = self._last_tx = self._loop.time()
        self._undelivered = 0
        self._reading_paused = False
        self._handshake_timer: asyncio.TimerHandle | None = None
        self.remote: RemoteInfo | None = None

    # ------------------------------------------------------------------------------- opening

    @classmethod
    async def open(cls, address: Any, config: RpcConfig, on_closed=None) -> "Connection":
        """Dial `address` (("host", port) or "unix:/path"), complete the hello, return the ready
        connection. Raises ConnectionLost when the dial fails, HandshakeError when the hello does."""
        loop = asyncio.get_running_loop()
        factory = lambda: cls(config, initiator=True, on_closed=on_closed)  # noqa: E731
        try:
            async with asyncio.timeout(config.connect_timeout_s):
                if isinstance(address, str) and address.startswith("unix:"):
                    _, conn = await loop.create_unix_connection(factory, address[len("unix:"):])
                else:
                    host, port = address
                    _, conn = await loop.create_connection(factory, host, port)
        except (OSError, TimeoutError) as exc:
            raise ConnectionLost(f"cannot connect to {address}: {exc or type(exc).__name__}") from exc
        try:
            await conn.wait_ready()
        except BaseException:
            conn.abort(ConnectionLost("gave up during the hello"))
            raise
        return conn

    async def wait_ready(self) -> RemoteInfo:
        return await asyncio.shield(self._ready)

    @property
    def is_open(self) -> bool:
        return self._error is None and not self._going_away

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """The transport's extra info ("socket", "peername", ...), for diagnostics and tests."""
        return self._transport.get_extra_info(name, default) if self._transport is not None else default

    @property
    def buffered_bytes(self) -> int:
        """Payload reserved by senders and not yet written, plus what the event-loop transport
        holds: all the memory this connection pins for sending, whatever the peer does."""
        held = self._transport.get_write_buffer_size() if self._transport is not None else 0
        return self._budget.used + held

    # ------------------------------------------------------------------- asyncio.Protocol hooks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport
        sock = transport.get_extra_info("socket")
        if sockopts.is_tcp(sock):
            sockopts.apply_tcp_options(sock, self._config.socket)
        elif sock is not None:
            self._peercred = sockopts.peercred(sock)
        self._address = transport.get_extra_info("peername")
        if self._admit_local is not None and (reason := self._local_refusal()) is not None:
            self._refuse(HandshakeError(f"admission refused: {reason}", "admission"))
            return
        if self._gate is not None:
            source = source_of(self._address, self._peercred)
            reason = self._gate.enter(source)
            if reason is not None:
                log.info("dropping connection from %s at once: %s", self._address, reason)
                self._shutdown(HandshakeError(f"too many unproven connections: {reason}", "unproven_limit"))
                transport.abort()
                return
            self._gate_source = source
        transport.set_write_buffer_limits(high=self._config.write_buffer_bytes)
        self._writelines = self._socket_writelines()
        self._handshake_timer = self._loop.call_later(self._config.handshake_timeout_s, self._hello_overdue)
        self._send_control(encode_frame(Kind.HELLO, {"hello": self._handshake.hello_bytes()}))
        self._tasks.spawn(self._write_loop(), "writer")

    def _local_refusal(self) -> str | None:
        assert self._admit_local is not None
        try:
            return self._admit_local(self._peercred)
        except Exception:
            log.exception("local admission hook failed for %s", self._address)
            return "the admission check failed"

    def _hello_overdue(self) -> None:
        """The handshake deadline: logged with the address, since a slow-loris has no proven id."""
        error = HandshakeError(f"no hello within {self._config.handshake_timeout_s} s", "deadline")
        log.info("hello with %s failed: %s", self._address, error)
        self._refuse(error)

    def _socket_writelines(self) -> Callable[[list[Piece]], None]:
        assert self._transport is not None
        traffic = self._config.traffic
        return self._transport.writelines if traffic is None else traffic.counting(self._transport.writelines)

    def data_received(self, data: bytes) -> None:
        self._last_rx = self._loop.time()
        if self._config.traffic is not None:
            self._config.traffic.received_bytes += len(data)
        try:
            if self._opener is not None:
                self._feed(self._opener.open(data))
            elif self._config.encrypt:
                self._feed_hello(data)
            else:
                self._feed(data)
        except HandshakeError as exc:
            log.info("hello with %s failed: %s", self._address, exc)
            self._refuse(exc)
        except ProtocolError as exc:
            log.warning("closing connection from %s: %s", self._address, exc)
            self.abort(exc)
        except Exception as exc:  # a bug of ours: drop this connection rather than leave it wedged
            log.exception("closing connection from %s after an internal error", self._address)
            self.abort(ConnectionLost(f"internal error: {type(exc).__name__}: {exc}"))

    def _feed(self, data: bytes | memoryview) -> None:
        self._decoder.feed(data)
        while (frame := self._decoder.next_frame()) is not None:
            if self._error is not None:
                return
            if self._ready.done():
                self._dispatch(frame)
            else:
                self._on_handshake_frame(frame)

    def _feed_hello(self, data: bytes) -> None:
        """Encrypting: hand the hello decoder one hello frame at a time, so that the bytes after
        the last one (sealed records the peer sent right after its welcome) reach the Opener
        instead of being parsed as plain frames. A hello frame has no payload, so its prelude
        says where it ends; the decoder still checks that prelude before we wait for more."""
        view = memoryview(data)
        while view and self._opener is None and self._error is None:
            if self._hello_left == 0:
                piece = view[: PRELUDE_BYTES - len(self._hello_prelude)]
                self._hello_prelude += piece
                if len(self._hello_prelude) == PRELUDE_BYTES:
                    *_, header_len, count = PRELUDE.unpack(self._hello_prelude)
                    self._hello_left = header_len + LENGTH_ENTRY_BYTES * count
                    self._hello_prelude.clear()
            else:
                piece = view[: self._hello_left]
                self._hello_left -= len(piece)
            view = view[len(piece):]
            self._feed(piece)
        if view and self._opener is not None:
            self._feed(self._opener.open(view))

    def eof_received(self) -> bool:
        self.abort(ConnectionLost("the peer closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._shutdown(ConnectionLost(f"connection lost: {exc}") if exc else ConnectionLost("connection closed"))
        if not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # ------------------------------------------------------------------------------ handshake

    def _on_handshake_frame(self, frame: Frame) -> None:
        if frame.kind is not Kind.HELLO:
            raise HandshakeError(f"peer sent {frame.kind.name} before the hello finished")
        header = frame.header
        if "hello" in header and not self._hello_received:
            self._send_control(encode_frame(Kind.HELLO, {"proof": self._receive_hello(header["hello"])}))
        elif "proof" in header and self._hello_received and self.remote is None:
            self._receive_proof(header["proof"])
        elif "welcome" in header and self._initiator and self.remote is not None:
            self._become_ready()
        elif "refused" in header:
            self.abort(HandshakeError(f"the peer refused the hello: {header['refused']}", "refused_by_peer"))
        else:
            raise HandshakeError(f"unexpected hello message {sorted(header)}")

    def _receive_hello(self, raw: object) -> bytes:
        if not isinstance(raw, bytes):
            raise HandshakeError("hello body is not bytes")
        proof = self._handshake.receive_hello(raw)
        self._hello_received = True
        return proof

    def _receive_proof(self, raw: object) -> None:
        if not isinstance(raw, bytes):
            raise HandshakeError("proof body is not bytes")
        peer = self._handshake.receive_proof(raw)
        if peer.send_key is not None and peer.recv_key is not None:
            self._keys = (peer.send_key, peer.recv_key)
        try:
            theirs = Limits.from_dict(peer.hello.limits)
        except MalformedFrame as exc:
            raise HandshakeError(str(exc)) from None
        if theirs.max_chunk_bytes < MIN_PEER_CHUNK_BYTES:
            raise HandshakeError(f"peer wants {theirs.max_chunk_bytes}-byte chunks, below {MIN_PEER_CHUNK_BYTES}",
                                 "incompatible")
        self._send_limits = self._config.limits.meet(theirs)
        self._budget.capacity = self._send_limits.max_inflight_bytes
        self.remote = RemoteInfo(
            peer_id=peer.peer_id,
            public_key=peer.public_key,
            app=peer.hello.app,
            address=self._address,
            peercred=self._peercred,
        )
        if self._initiator:
            return  # wait for the server's welcome
        try:
            reason = self._admit(self.remote) if self._admit is not None else None
        except Exception:
            log.exception("admission hook failed for %s", self._address)
            reason = "the admission check failed"
        if reason is not None:
            raise HandshakeError(f"admission refused: {reason}", "admission")
        self._send_control(encode_frame(Kind.HELLO, {"welcome": True}))
        self._become_ready()

    def _become_ready(self) -> None:
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        self._leave_gate()
        # Nobody sends anything but hellos before the welcome, so the strict decoder holds nothing
        # more from an honest peer; a frame still waiting in it was sent out of turn.
        if self._decoder.next_frame() is not None:
            raise HandshakeError("peer sent frames before the hello finished")
        self._decoder = FrameDecoder(self._config.limits)
        if self._keys is not None:
            # Every hello frame was written at once (the outbox is empty during the hello, as its few
            # KiB never fill the write buffer), so from here on each frame is sealed, in order.
            send_key, recv_key = self._keys
            assert self._transport is not None and not self._outbox
            self._writelines = Sealer(send_key, self._socket_writelines()).writelines
            self._opener = Opener(recv_key, self._config.limits.max_frame_bytes)
        assert self.remote is not None
        self._rate_key = self.remote.peer_id or ("source", source_of(self._address))
        self._ready.set_result(self.remote)
        self._tasks.spawn(self._heartbeat(), "heartbeat")

    # ------------------------------------------------------------------------------- dispatch

    def _dispatch(self, frame: Frame) -> None:
        kind, header = frame.kind, frame.header
        if kind is Kind.PING:
            self._send_control(encode_frame(Kind.PONG, {}))
        elif kind is Kind.PONG:
            pass
        elif kind is Kind.GOAWAY:
            self._going_away = True
        elif self._initiator and kind in (Kind.RESPONSE, Kind.STREAM_ITEM, Kind.STREAM_END, Kind.ERROR):
            self._on_answer(_frame_id(header), frame)
        elif not self._initiator and kind is Kind.REQUEST:
            self._on_request(_frame_id(header), frame)
        elif not self._initiator and kind is Kind.CANCEL:
            task = self._handlers.get(_frame_id(header))
            if task is not None:
                task.cancel("the caller cancelled")
        else:
            raise MalformedFrame(f"{kind.name} is not something the {self._role} side receives")

    @property
    def _role(self) -> str:
        return "calling" if self._initiator else "serving"

    def _on_answer(self, rid: int, frame: Frame) -> None:
        call = self._calls.get(rid)
        if call is None or call.done:
            return  # the call was given up on; its late answer is dropped
        if frame.kind is not Kind.ERROR and call.stream != (frame.kind in (Kind.STREAM_ITEM, Kind.STREAM_END)):
            raise MalformedFrame(f"{frame.kind.name} does not answer a {'stream' if call.stream else 'unary'} call")
        if frame.kind is Kind.STREAM_ITEM:
            self._account_undelivered(_frame_bytes(frame))
        else:
            call.done = True
        call.push(frame)

    def _on_request(self, rid: int, frame: Frame) -> None:
        if rid in self._handlers:
            raise MalformedFrame(f"request id {rid} is already running")
        method, timeout = frame.header.get("m"), frame.header.get("t")
        if not isinstance(method, str):
            raise MalformedFrame("request has no method name")
        if timeout is not None and not (
            type(timeout) in (int, float) and math.isfinite(timeout) and timeout >= 0
        ):
            raise MalformedFrame(f"request timeout {timeout!r} is not a finite number of seconds")
        if self._going_away:
            self._send_error(rid, CODE_GOING_AWAY, "the server is shutting down")
        elif self._limiter is not None and not self._limiter.allow(self._rate_key):
            if self._config.traffic is not None:
                self._config.traffic.rate_limited_calls += 1
            self._send_error(rid, CODE_RATE_LIMITED, f"over {self._config.rate_limit_per_s} calls/s")
        elif len(self._handlers) >= self._config.max_concurrent_handlers:
            self._send_error(rid, CODE_OVERLOADED, f"{len(self._handlers)} calls already running")
        else:
            task = self._handlers[rid] = self._tasks.spawn(self._serve(rid, frame), f"request {rid}")
            # Not a `finally` in _serve: a task cancelled before its first step never runs its body.
            task.add_done_callback(lambda _, rid=rid: self._handlers.pop(rid, None))

    # --------------------------------------------------------------------------- server side

    async def _serve(self, rid: int, frame: Frame) -> None:
        header = frame.header
        method, timeout = header.get("m"), header.get("t")
        deadline = None if timeout is None else self._loop.time() + float(timeout)
        scope = asyncio.timeout_at(deadline)
        try:
            async with scope:
                await self._run_handler(rid, method, header, frame.buffers, deadline)
        except TimeoutError:
            if not scope.expired():
                raise
            self._send_error(rid, CODE_DEADLINE, f"{method} ran past its deadline")
        except RpcError as exc:
            self._send_error(rid, exc.code, exc.message)
        except ProtocolError as exc:  # the request's tensors do not decode: the peer's fault
            log.warning("closing connection from %s: %s", self._address, exc)
            self.abort(exc)
        except asyncio.CancelledError:
            dropped = self._outbox.drop(rid)
            self._budget.release(dropped.payload)
            if dropped.partial:  # abandon a reply that is partly on the wire
                self._send_error(rid, CODE_CANCELLED, "cancelled")
            raise
        except Exception as exc:
            log.exception("handler of %s failed", method)
            self._send_error(rid, CODE_INTERNAL, f"{type(exc).__name__}: {exc}")

    async def _run_handler(self, rid: int, method: str, header: dict, buffers: list, deadline) -> None:
        entry = self._router.lookup(method) if self._router is not None else None
        if entry is None:
            raise RpcError(CODE_UNKNOWN_METHOD, f"no method {method!r}")
        kind, handler = entry
        meta, tensors = await self._decode(header, buffers)
        assert self.remote is not None
        request = Request(method, meta, tensors, deadline, self.remote)
        if kind == "unary":
            reply = await handler(request)
            await self._send_message(Kind.RESPONSE, rid, _check_reply(method, reply), {})
            return
        items = handler(request)
        try:
            async for item in items:
                await self._send_message(Kind.STREAM_ITEM, rid, _check_reply(method, item), {})
        finally:
            await items.aclose()
        self._send_frames(rid, [encode_frame(Kind.STREAM_END, {ID: rid})])

    def _send_error(self, rid: int, code: str, message: str) -> None:
        if self._error is None:
            # A UTF-8 character is at most 4 bytes: this keeps the message under the peer's str limit.
            text = str(message)[: self._send_limits.max_str_len // 4]
            header = {ID: rid, "code": str(code)[:64], "msg": text}
            self._send_frames(rid, [encode_frame(Kind.ERROR, header, limits=self._send_limits)])

    # --------------------------------------------------------------------------- client side

    async def call(self, method: str, message: Message = Message(), *, timeout: float) -> Message:
        """Send one request and wait for its one reply; DeadlineExceeded after `timeout` seconds."""
        scope = asyncio.timeout(timeout)
        try:
            async with scope, self._call_slots:
                rid, call = self._start_call(stream=False)
                try:
                    await self._send_request(rid, method, message, self._loop.time() + timeout)
                    return await self._answer_message(await call.next())
                finally:
                    self._end_call(rid)
        except TimeoutError:
            if scope.expired():
                raise DeadlineExceeded(f"{method} got no answer within {timeout} s") from None
            raise

    def stream(self, method: str, message: Message = Message(), *, timeout: float) -> "StreamCall":
        """A call answered by a stream of messages; iterate it, ideally inside `async with`."""
        return StreamCall(lambda: self, method, message, timeout)

    def _start_call(self, stream: bool) -> tuple[int, _Call]:
        self._check_open()
        rid = next(self._ids)
        call = self._calls[rid] = _Call(stream)
        return rid, call

    def _end_call(self, rid: int) -> None:
        """Forget a call; if it is unanswered, take back what is unsent and tell the server."""
        call = self._calls.pop(rid, None)
        if call is None:
            return
        while call.frames:  # items the consumer never took
            item = call.frames.popleft()
            if item.kind is Kind.STREAM_ITEM:
                self._account_undelivered(-_frame_bytes(item))
        dropped = self._outbox.drop(rid)
        self._budget.release(dropped.payload)
        if not call.done and self._error is None:
            self._decoder.discard(rid)
            if call.sent and not dropped.untouched:  # the server may be working on it
                self._send_control(encode_frame(Kind.CANCEL, {ID: rid}))

    async def _send_request(self, rid: int, method: str, message: Message, deadline: float) -> None:
        extra = {"m": method, "t": max(0.0, deadline - self._loop.time())}
        await self._send_message(Kind.REQUEST, rid, message, extra)
        self._calls[rid].sent = True  # queued or written: from here on, cancelling must tell the server

    async def _answer_message(self, frame: Frame) -> Message:
        if frame.kind is Kind.ERROR:
            code, msg = frame.header.get("code"), frame.header.get("msg")
            raise RemoteError(str(code), str(msg))
        try:
            meta, tensors = await self._decode(frame.header, frame.buffers)
        except ProtocolError as exc:  # the peer sent a reply that does not decode: drop it
            log.warning("closing connection to %s: %s", self._address, exc)
            self.abort(exc)
            raise
        return Message(meta, tensors)

    async def _next_stream_item(self, rid: int, call: _Call) -> Message | None:
        frame = await call.next()
        if frame.kind is Kind.STREAM_ITEM:
            self._account_undelivered(-_frame_bytes(frame))
        elif frame.kind is Kind.STREAM_END:
            return None
        return await self._answer_message(frame)

    def _check_open(self) -> None:
        if self._error is not None:
            raise ConnectionLost(f"connection to {self._address} is closed: {self._error}")
        if self._going_away:
            raise ConnectionLost(f"{self._address} is going away; open a new connection")
        if not self._ready.done():
            raise LocalProtocolError("call before the hello finished")

    # ----------------------------------------------------------------------- sending payloads

    async def _send_message(self, kind: Kind, rid: int, message: Message, extra: dict) -> None:
        """Encode `message` and queue its frames under call `rid`, after reserving its bytes."""
        tensors = list(message.tensors)
        if not tensors:  # control-sized: no budget, no codec, one frame
            self._check_alive()
            header = {ID: rid, **extra, "meta": message.meta, "x": []}
            self._send_frames(rid, [encode_frame(kind, header, (), self._send_limits)])
            return
        estimate = min(sum(_nbytes(t) for t in tensors), self._budget.capacity)
        await self._budget.acquire(estimate)
        held = estimate
        try:
            if estimate > self._config.offload_threshold_bytes:
                metas, buffers = await self._loop.run_in_executor(None, _encode_all, tensors, message.codec)
            else:
                metas, buffers = _encode_all(tensors, message.codec)
            header = {ID: rid, **extra, "meta": message.meta, "x": metas}
            frames = encode_message(kind, header, buffers, self._send_limits)
            actual = sum(memoryview(b).nbytes for b in buffers)
            if actual > held:
                await self._budget.acquire(actual - held)
            else:
                self._budget.release(held - actual)
            held = actual
            self._check_alive()
            self._send_frames(rid, frames)
        except BaseException:
            self._budget.release(held)
            raise

    async def _decode(self, header: dict, buffers: list) -> tuple[dict, list[torch.Tensor]]:
        meta, metas = header.get("meta"), header.get("x")
        if not isinstance(meta, dict) or not isinstance(metas, list):
            raise MalformedFrame("data frame lacks its meta map or tensor list")
        if not metas and not buffers:
            return meta, []
        size = sum(len(b) for b in buffers)
        if size > self._config.offload_threshold_bytes:
            tensors = await self._loop.run_in_executor(None, _decode_all, metas, buffers, self._config.limits)
        else:
            tensors = _decode_all(metas, buffers, self._config.limits)
        return meta, tensors

    def _check_alive(self) -> None:
        if self._error is not None:
            raise ConnectionLost(f"connection to {self._address} closed: {self._error}") from self._error

    # ------------------------------------------------------------------ writer, heartbeat, flow

    def _send_control(self, frame: list[Piece]) -> None:
        if not self._write_now(frame):
            self._outbox.put_control(frame)

    def _send_frames(self, key: int, frames: list[list[Piece]]) -> None:
        if len(frames) == 1 and self._write_now(frames[0]):
            self._budget.release(payload_bytes(frames[0]))
        else:
            self._outbox.put(key, frames)

    def _write_now(self, frame: list[Piece]) -> bool:
        """Write at once when nothing is queued and the socket takes data: a small call then
        costs no wake-up of the writer task (half the latency of a ping-pong on loopback)."""
        if self._outbox or not self._writable.is_set() or self._transport is None or self._error is not None:
            return False
        self._writelines(frame)
        self._last_tx = self._loop.time()
        return True

    async def _write_loop(self) -> None:
        while True:
            await self._writable.wait()
            item = await self._outbox.get()
            self._writelines(item.frame)
            self._last_tx = self._loop.time()
            if item.payload:
                self._budget.release(item.payload)

    async def _heartbeat(self) -> None:
        interval, limit = self._config.heartbeat_interval_s, self._config.heartbeat_timeout_s
        ping = encode_frame(Kind.PING, {})
        while True:
            await asyncio.sleep(min(interval, limit) / 2)
            now = self._loop.time()
            if self._reading_paused:
                self._last_rx = now  # silence is ours, not the peer's
            elif now - self._last_rx > limit:
                self.abort(ConnectionLost(f"nothing heard from {self._address} for {limit} s"))
                return
            if now - self._last_tx >= interval:
                self._send_control(ping)
                self._last_tx = now

    def _account_undelivered(self, delta: int) -> None:
        """Stop reading while stream items pile up unconsumed; TCP then slows the sender."""
        self._undelivered += delta + (UNDELIVERED_OVERHEAD_BYTES if delta > 0 else -UNDELIVERED_OVERHEAD_BYTES)
        over = self._undelivered > self._config.max_undelivered_bytes
        if over != self._reading_paused and self._transport is not None and self._error is None:
            self._reading_paused = over
            (self._transport.pause_reading if over else self._transport.resume_reading)()

    # -------------------------------------------------------------------------------- closing

    def abort(self, error: BaseException) -> None:
        """Drop the connection now: pending calls fail, handlers are cancelled, unsent data is lost."""
        self._shutdown(error)
        if self._transport is not None:
            self._transport.abort()

    async def close(self) -> None:
        """Close politely: tell the peer we are going away, let queued frames leave (bounded by
        `close_timeout_s`), then drop whatever is still running."""
        if self._error is None and self._transport is not None:
            self._going_away = True
            if self._ready.done() and not self._ready.exception():
                self._send_control(encode_frame(Kind.GOAWAY, {}))
            await self._drain(lambda: bool(self._outbox or self._handlers))
            flushed = not self._outbox and self._transport.get_write_buffer_size() == 0
            self._shutdown(ConnectionLost("closed locally"))
            # A peer that stopped reading would hold a graceful close open forever.
            (self._transport.close if flushed else self._transport.abort)()
        await self.wait_closed()

    async def wait_closed(self) -> None:
        await self._tasks.aclose()
        if self._transport is not None:
            await asyncio.shield(self._closed)

    def _refuse(self, error: HandshakeError) -> None:
        """End a failed hello with its reason, so the peer's operator sees why, then hang up."""
        if self._error is not None or self._transport is None:
            return
        reason = str(error)[:HANDSHAKE_REASON_CHARS]
        self._socket_writelines()(encode_frame(Kind.HELLO, {"refused": reason}))
        self._shutdown(error)
        self._transport.close()

    async def _drain(self, busy: Callable[[], bool]) -> None:
        """Wait while `busy()` (queued frames, running handlers), at most `close_timeout_s`."""
        try:
            async with asyncio.timeout(self._config.close_timeout_s):
                while busy():
                    await asyncio.sleep(CLOSE_POLL_S)
        except TimeoutError:
            pass

    def _shutdown(self, error: BaseException) -> None:
        if self._error is not None:
            return
        self._error = error
        if isinstance(error, HandshakeError) and self._config.traffic is not None:
            self._config.traffic.failed_hello(error.reason)
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        self._leave_gate()
        if not self._ready.done():
            self._ready.set_exception(error)
            self._ready.exception()  # retrieved here: the opener may already have given up
        lost = error if isinstance(error, ConnectionLost) else ConnectionLost(f"connection closed: {error}")
        if lost is not error:
            lost.__cause__ = error
        for call in self._calls.values():
            call.fail(lost)
        self._budget.fail(lost)
        self._tasks.cancel_all("connection closed")
        if self._on_closed is not None:
            self._on_closed(self)


    def _leave_gate(self) -> None:
        if self._gate is not None and self._gate_source is not None:
            self._gate.leave(self._gate_source)
            self._gate_source = None


class StreamCall:
    """The caller's end of a streamed answer. Iterating sends the request on first use; leaving
    early (`aclose`, `async with` exit, break then close) cancels the call on the server."""

    def __init__(self, get_conn, method: str, message: Message, timeout: float) -> None:
        self._get_conn = get_conn
        self._method, self._message, self._timeout = method, message, timeout
        self._conn: Connection | None = None
        self._rid: int | None = None
        self._call: _Call | None = None
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
        loop = asyncio.get_running_loop()
        if self._deadline is None:
            self._deadline = loop.time() + self._timeout
        scope = asyncio.timeout_at(self._deadline)
        try:
            async with scope:
                if self._conn is None:
                    conn = self._get_conn()
                    self._conn = await conn if asyncio.iscoroutine(conn) else conn
                    self._rid, self._call = self._conn._start_call(stream=True)
                    await self._conn._send_request(self._rid, self._method, self._message, self._deadline)
                assert self._rid is not None and self._call is not None
                item = await self._conn._next_stream_item(self._rid, self._call)
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


def _frame_id(header: dict) -> int:
    rid = header.get(ID)
    if type(rid) is not int or rid < 0:
        raise MalformedFrame(f"frame has no valid {ID!r}")
    return rid


def _frame_bytes(frame: Frame) -> int:
    return sum(len(b) for b in frame.buffers)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _check_reply(method: str, reply: object) -> Message:
    if not isinstance(reply, Message):
        raise RpcError(CODE_BAD_REPLY, f"handler of {method} returned {type(reply).__name__}, not Message")
    return reply


def _encode_all(tensors: list[torch.Tensor], codec: str) -> tuple[list[dict], list]:
    from .codecs import encode_tensor  # deferred: torch loads only once a tensor is sent

    metas, buffers = [], []
    for tensor in tensors:
        meta, bufs = encode_tensor(tensor, codec)
        metas.append(meta)
        buffers.extend(bufs)
    return metas, buffers


def _decode_all(metas: list, buffers: list, limits: Limits) -> list[torch.Tensor]:
    """Split the frame's buffers among its tensors (codecs.buffer_count says how many each takes)."""
    if len(metas) > len(buffers) + limits.max_buffers_per_frame:
        raise MalformedFrame("more tensors announced than the frame can carry")
    if metas:
        from .codecs import buffer_count, check_message_budget, decode_tensor  # deferred: torch loads only for tensors
        check_message_budget(metas, buffers, limits)
    tensors, start = [], 0
    for meta in metas:
        count = buffer_count(meta)
        if start + count > len(buffers):
            raise MalformedFrame("tensor list needs more buffers than the frame has")
        tensors.append(decode_tensor(meta, buffers[start : start + count], limits))
        start += count
    if start != len(buffers):
        raise MalformedFrame(f"frame has {len(buffers) - start} buffers no tensor claims")
    return tensors

