"""One RPC connection over a stream socket (TCP or Unix): the asyncio shell around `RpcProtocol`.

The rules (hello sequence, frame kinds per role, ids, which answer fits which call, cancel and
goaway) live in `transport.protocol` and are tested on bytes alone; this shell feeds it the socket's
bytes, hands its events on (answers to `transport.calls`, our calls in flight; requests to
`transport.dispatch`, which runs their handlers in this connection's tasks), and owns what needs a
loop: the writer, the tasks, tensor encoding (offloaded to a thread past a size), the heartbeat,
flow control and closing.

What it writes goes through its `Sender` (control frames first, then calls one chunk at a time,
payload bytes reserved against the in-flight budget); the writer waits whenever the transport's
buffer is full, so the kernel's `TCP_NOTSENT_LOWAT` and our write-buffer limit keep bulk data queued
where a small frame can still overtake it. Anything a peer does wrong aborts this one connection;
every outstanding call then fails with ConnectionLost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import transport.payload as payload
import transport.sockopts as sockopts
from .calls import Calls, StreamCall
from .config import RpcConfig
from .dispatch import Dispatch
from .errors import ConnectionLost, HandshakeError, MalformedFrame, ProtocolError
from .gate import HelloGate, source_of
from .handshake import Handshake
from .message import Message, RemoteInfo, Router
from .protocol import (
    HELLO_LIMITS,
    Admit,
    Answer,
    Broken,
    Cancelled,
    GoingAway,
    Incoming,
    PeerRefused,
    Ready,
    RpcProtocol,
    Send,
)
from .ratelimit import RateLimiter
from .seal import Sealer
from .sender import Sender
from .tasks import TaskSet
from .wire import VERSION, Kind, Piece, encode_frame

if TYPE_CHECKING:
    import torch

__all__ = ["Admit", "AdmitLocal", "Connection", "HELLO_LIMITS", "StreamCall"]

log = logging.getLogger(__name__)

#: A Unix socket's admission by the kernel's SO_PEERCRED (pid, uid, gid) alone, run when the
#: connection is accepted: a refused client never holds a hello slot nor a connection slot.
AdmitLocal = Callable[["tuple[int, int, int] | None"], "str | None"]

UNDELIVERED_OVERHEAD_BYTES = 256
"""Counted per queued stream item on top of its payload, so empty items cannot pile up for free."""
CLOSE_POLL_S = 0.01
"""How often a closing connection looks whether its queue has drained (closing is rare)."""


class Connection(asyncio.Protocol):
    """Use `await Connection.open(...)` (client) or let `RpcServer` create it (server side)."""

    def __init__(self, config: RpcConfig, *, initiator: bool, router: Router | None = None,
                 admit: Admit | None = None, on_closed: Callable[["Connection"], None] | None = None,
                 gate: HelloGate | None = None, limiter: RateLimiter | None = None,
                 admit_local: AdmitLocal | None = None) -> None:
        self._config, self._on_closed = config, on_closed
        self._gate, self._admit_local = gate, admit_local
        self._gate_source: str | None = None  # set while we hold a slot of the gate
        self._loop = asyncio.get_running_loop()
        handshake = Handshake(initiator=initiator, version=VERSION, identity=config.identity,
                              swarm_key=config.swarm_key, limits=config.limits.as_dict(), app=config.app,
                              encrypt=config.encrypt, encrypt_setting=config.encrypt_setting)
        self._proto = RpcProtocol(handshake, config.limits, initiator=initiator, encrypt=config.encrypt, admit=admit)
        self._ready: asyncio.Future[RemoteInfo] = self._loop.create_future()
        self._closed: asyncio.Future[None] = self._loop.create_future()
        self._transport: asyncio.Transport | None = None
        self._tasks = TaskSet("connection", on_failure=self._task_failed)
        self._sender = Sender(config.limits.max_inflight_bytes, config.offload_threshold_bytes)
        self._calls = Calls(self)  # ours, as the caller
        self._dispatch = Dispatch(self, router, limiter)  # the peer's, as the server
        self._last_rx = self._loop.time()
        self._undelivered = 0
        self._reading_paused = False
        self._handshake_timer: asyncio.TimerHandle | None = None
        self.remote: RemoteInfo | None = None

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
        return self._proto.closed is None and not self._proto.going_away

    @property
    def _address(self) -> Any:
        return self._proto.address

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """The transport's extra info ("socket", "peername", ...), for diagnostics and tests."""
        return self._transport.get_extra_info(name, default) if self._transport is not None else default

    @property
    def buffered_bytes(self) -> int:
        """Payload reserved by senders and not yet written, plus what the event-loop transport
        holds: all the memory this connection pins for sending, whatever the peer does."""
        held = self._transport.get_write_buffer_size() if self._transport is not None else 0
        return self._sender.budget.used + held

    # ------------------------------------------------------------------- asyncio.Protocol hooks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport
        sock = transport.get_extra_info("socket")
        if sockopts.is_tcp(sock):
            sockopts.apply_tcp_options(sock, self._config.socket)
        elif sock is not None:
            self._proto.peercred = sockopts.peercred(sock)
        self._proto.address = transport.get_extra_info("peername")
        if self._admit_local is not None and (reason := self._local_refusal()) is not None:
            self._refuse(HandshakeError(f"admission refused: {reason}", "admission"), linger=True)
            return
        if self._gate is not None:
            source = source_of(self._address, self._proto.peercred)
            reason = self._gate.enter(source)
            if reason is not None:
                log.info("dropping connection from %s at once: %s", self._address, reason)
                self._shutdown(HandshakeError(f"too many unproven connections: {reason}", "unproven_limit"))
                transport.abort()
                return
            self._gate_source = source
        transport.set_write_buffer_limits(high=self._config.write_buffer_bytes)
        self._sender.attach(self._socket_writelines())
        self._handshake_timer = self._loop.call_later(self._config.handshake_timeout_s, self._hello_overdue)
        self._sender.control(self._proto.hello_frame())
        self._tasks.spawn(self._sender.run(), "writer")

    def _local_refusal(self) -> str | None:
        assert self._admit_local is not None
        try:
            return self._admit_local(self._proto.peercred)
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
            for event in self._proto.receive_data(data):
                if self._proto.closed is not None:
                    return
                self._on_event(event)
        except Exception as exc:  # a bug of ours: drop this connection rather than leave it wedged
            log.exception("closing connection from %s after an internal error", self._address)
            self.abort(ConnectionLost(f"internal error: {type(exc).__name__}: {exc}"))

    def _on_event(self, event: object) -> None:
        if isinstance(event, Answer):
            self._calls.answer(event.rid, event.frame)
        elif isinstance(event, Send):
            self._sender.control(event.frame)
        elif isinstance(event, Incoming):
            self._dispatch.request(event)
        elif isinstance(event, Cancelled):
            self._dispatch.cancelled(event.rid)
        elif isinstance(event, Ready):
            self._become_ready(event)
        elif isinstance(event, PeerRefused):
            self.abort(HandshakeError(f"the peer refused the hello: {event.reason}", "refused_by_peer"))
        elif isinstance(event, Broken):
            self._broken(event.error)
        else:
            assert isinstance(event, GoingAway)

    def _broken(self, error: ProtocolError) -> None:
        if isinstance(error, HandshakeError):
            log.info("hello with %s failed: %s", self._address, error)
            self._refuse(error)
        else:
            log.warning("closing connection from %s: %s", self._address, error)
            self.abort(error)

    def eof_received(self) -> bool:
        self.abort(ConnectionLost("the peer closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._shutdown(ConnectionLost(f"connection lost: {exc}") if exc else ConnectionLost("connection closed"))
        if not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        self._sender.pause()

    def resume_writing(self) -> None:
        self._sender.resume()

    def _become_ready(self, ready: Ready) -> None:
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        self._leave_gate()
        if ready.keys is not None:
            # Every hello frame was written at once (the outbox is empty during the hello, as its few
            # KiB never fill the write buffer), so from here on each frame is sealed, in order.
            assert self._transport is not None and not self._sender.outbox
            self._sender.attach(Sealer(ready.keys[0], self._socket_writelines()).writelines)
        self._sender.budget.capacity = self._proto.send_limits.max_inflight_bytes
        self.remote = ready.remote
        self._dispatch.rate_key = self.remote.peer_id or ("source", source_of(self._address))
        self._ready.set_result(self.remote)
        self._tasks.spawn(self._heartbeat(), "heartbeat")

    # --------------------------------------------------------------------------- client side

    async def call(self, method: str, message: Message = Message(), *, timeout: float) -> Message:
        """Send one request and wait for its one reply; DeadlineExceeded after `timeout` seconds."""
        return await self._calls.call(method, message, timeout)

    def stream(self, method: str, message: Message = Message(), *, timeout: float) -> StreamCall:
        """A call answered by a stream of messages; iterate it, ideally inside `async with`."""
        return StreamCall(lambda: self, method, message, timeout)

    # ----------------------------------------------------------------------- sending payloads

    async def _send_message(self, kind: Kind, rid: int, message: Message, extra: dict) -> None:
        await self._sender.message(kind, rid, message, extra, self._proto.send_limits, self._check_alive)

    async def _decode(self, header: dict, buffers: list) -> tuple[dict, list[torch.Tensor]]:
        meta, metas = header.get("meta"), header.get("x")
        if not isinstance(meta, dict) or not isinstance(metas, list):
            raise MalformedFrame("data frame lacks its meta map or tensor list")
        if not metas and not buffers:
            return meta, []
        size, threshold = sum(len(b) for b in buffers), self._config.offload_threshold_bytes
        return meta, await payload.offload(size, threshold, payload.decode_all, metas, buffers, self._config.limits)

    def _check_alive(self) -> None:
        if self._proto.closed is not None:
            raise ConnectionLost(f"connection to {self._address} closed: {self._proto.closed}") from self._proto.closed

    # ------------------------------------------------------------------ writer, heartbeat, flow

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
            if now - self._sender.last_tx >= interval:
                self._sender.control(ping)
                self._sender.last_tx = now

    def _account_undelivered(self, delta: int) -> None:
        """Stop reading while stream items pile up unconsumed; TCP then slows the sender."""
        self._undelivered += delta + (UNDELIVERED_OVERHEAD_BYTES if delta > 0 else -UNDELIVERED_OVERHEAD_BYTES)
        over = self._undelivered > self._config.max_undelivered_bytes
        if over != self._reading_paused and self._transport is not None and self._proto.closed is None:
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
        if self._proto.closed is None and self._transport is not None:
            goaway = self._proto.goaway_frame()
            if goaway is not None:
                self._sender.control(goaway)
            await self._drain(lambda: bool(self._sender.outbox or self._dispatch.running))
            flushed = not self._sender.outbox and self._transport.get_write_buffer_size() == 0
            self._shutdown(ConnectionLost("closed locally"))
            # A peer that stopped reading would hold a graceful close open forever.
            (self._transport.close if flushed else self._transport.abort)()
        await self.wait_closed()

    async def wait_closed(self) -> None:
        await self._tasks.aclose()
        if self._transport is not None:
            await asyncio.shield(self._closed)

    def _refuse(self, error: HandshakeError, linger: bool = False) -> None:
        """End a failed hello with its reason, so the peer's operator sees why, then hang up.

        `linger`: refused at accept, before the peer's hello was read, which may still be on its
        way. A socket closed under it makes the peer's write fail (EPIPE; a reset on TCP) and its
        event loop drop the connection with our reason unread. So only our side is shut, and what
        arrives is discarded until the peer hangs up or `refusal_linger_s` passes."""
        transport = self._transport
        if self._proto.closed is not None or transport is None:
            return
        self._socket_writelines()(self._proto.refusal_frame(error))
        self._shutdown(error)
        if linger and transport.can_write_eof():
            transport.write_eof()
            self._loop.call_later(self._config.refusal_linger_s, transport.abort)
        else:
            transport.close()

    async def _drain(self, busy: Callable[[], bool]) -> None:
        """Wait while `busy()` (queued frames, running handlers), at most `close_timeout_s`."""
        try:
            async with asyncio.timeout(self._config.close_timeout_s):
                while busy():
                    await asyncio.sleep(CLOSE_POLL_S)
        except TimeoutError:
            pass

    def _shutdown(self, error: BaseException) -> None:
        if not self._proto.close(error):
            return
        self._sender.attach(None)
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
        self._calls.fail_all(lost)
        self._sender.budget.fail(lost)
        self._tasks.cancel_all("connection closed")
        if self._on_closed is not None:
            self._on_closed(self)

    def _task_failed(self, name: str, exc: BaseException) -> None:
        """The writer, the heartbeat or a handler died of a bug: the connection cannot go on."""
        self.abort(ConnectionLost(f"internal error in {name}: {type(exc).__name__}: {exc}"))

    def _leave_gate(self) -> None:
        if self._gate is not None and self._gate_source is not None:
            self._gate.leave(self._gate_source)
            self._gate_source = None
