"""The RPC rules of one connection, with no I/O: bytes in, events out, frames to write back.

`RpcProtocol` is what makes a byte stream an RPC connection: the hello sequence (hello, proof,
welcome or refusal; `handshake.Handshake` checks what each carries), which frame kinds each role
may receive, call ids and their reuse, whether an answer fits the call it names (unary or stream),
late answers to abandoned calls, CANCEL and GOAWAY. It never touches a socket, a task or a clock:
`receive_data(bytes)` returns the events the bytes make, in order, ending with `Broken` when the
peer broke a rule (the connection must end; frames owed before it, like our proof, still go), and the methods a caller uses (`start_call`,
`end_call`, `request_done`) say which frames are owed to the peer. `connection.Connection` is the
asyncio shell around it: it writes, schedules, encodes tensors, runs handlers and keeps time.

Calls go one way: the initiator (the side that dialled) sends requests and the acceptor serves them.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ConnectionLost, HandshakeError, LocalProtocolError, MalformedFrame, ProtocolError
from .handshake import MAX_HELLO_BYTES, Handshake
from .limits import LENGTH_ENTRY_BYTES, PRELUDE_BYTES, KiB, Limits
from .message import RemoteInfo
from .seal import Opener
from .wire import ID, PRELUDE, Frame, FrameDecoder, Kind, Piece, encode_frame

log = logging.getLogger(__name__)

Admit = Callable[[RemoteInfo], "str | None"]

MIN_PEER_CHUNK_BYTES = 16 * KiB
"""A peer asking for smaller chunks would make us spend a frame header and a loop turn per few
bytes of a 100 MB tensor; we refuse its hello instead."""

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

ANSWER_KINDS = (Kind.RESPONSE, Kind.STREAM_ITEM, Kind.STREAM_END, Kind.ERROR)
STREAM_KINDS = (Kind.STREAM_ITEM, Kind.STREAM_END)
PONG = encode_frame(Kind.PONG, {})


# ----------------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Send:
    """A control frame (a hello message, a PONG) to write ahead of anything queued."""

    frame: list[Piece]


@dataclass(frozen=True, slots=True)
class Ready:
    """The hello finished: calls may flow. `keys` are (send, receive) when the link is encrypted
    from here on; every frame written after this event must be sealed with the send key."""

    remote: RemoteInfo
    keys: tuple[bytes, bytes] | None


@dataclass(frozen=True, slots=True)
class PeerRefused:
    """The peer refused our hello and said why; it hangs up."""

    reason: str


@dataclass(frozen=True, slots=True)
class Answer:
    """A frame answering our call `rid`: RESPONSE, STREAM_ITEM, STREAM_END or ERROR."""

    rid: int
    frame: Frame


@dataclass(frozen=True, slots=True)
class Incoming:
    """A request to serve; `timeout` is the caller's seconds left, or None. Until `request_done`,
    the id is taken: the same id again is a protocol error."""

    rid: int
    method: str
    timeout: float | None
    frame: Frame


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The caller gave up on request `rid`, which is still being served."""

    rid: int


@dataclass(frozen=True, slots=True)
class GoingAway:
    """The peer starts no new calls on this connection, and takes none."""


@dataclass(frozen=True, slots=True)
class Broken:
    """The peer broke a rule (a `HandshakeError` during the hello, else a `ProtocolError`): the
    connection must end. Always the last event; nothing after it is read."""

    error: ProtocolError


Event = Send | Ready | PeerRefused | Answer | Incoming | Cancelled | GoingAway | Broken


# ----------------------------------------------------------------------------------- the core


@dataclass(slots=True)
class _CallState:
    stream: bool
    sent: bool = False  # the request is queued or written: giving up must tell the server
    done: bool = False  # the final frame (RESPONSE, STREAM_END or ERROR) arrived


class RpcProtocol:
    """One connection's RPC state. `address` and `peercred` (set by the shell once the socket
    exists) go into the peer's `RemoteInfo`; `admit` is the acceptor's admission rule."""

    def __init__(self, handshake: Handshake, limits: Limits, *, initiator: bool, encrypt: bool,
                 admit: Admit | None = None) -> None:
        self.handshake, self.limits, self.initiator = handshake, limits, initiator
        self.send_limits = limits  # what the peer accepts, once its hello said so
        self.address: Any = None
        self.peercred: tuple[int, int, int] | None = None
        self.remote: RemoteInfo | None = None
        self.ready = False
        self.going_away = False  # either side said GOAWAY: no new calls
        self.closed: BaseException | None = None
        self._admit = admit
        self._encrypt = encrypt
        self._decoder = FrameDecoder(HELLO_LIMITS)
        self._keys: tuple[bytes, bytes] | None = None
        self._opener: Opener | None = None
        self._hello_received = False
        self._stopped = False  # the peer refused us or broke a rule: read nothing more
        self._hello_left = 0  # encrypting, in the hello: bytes left of the hello frame being read
        self._hello_prelude = bytearray()
        self._ids = itertools.count(1)
        self._calls: dict[int, _CallState] = {}
        self._serving: set[int] = set()

    @property
    def role(self) -> str:
        return "calling" if self.initiator else "serving"

    # ------------------------------------------------------------------------------ frames out

    def hello_frame(self) -> list[Piece]:
        """The first frame each side writes."""
        return encode_frame(Kind.HELLO, {"hello": self.handshake.hello_bytes()})

    @staticmethod
    def refusal_frame(error: HandshakeError) -> list[Piece]:
        """The last frame of a failed hello: its reason, for the peer's operator."""
        return encode_frame(Kind.HELLO, {"refused": str(error)[:HANDSHAKE_REASON_CHARS]})

    def error_frame(self, rid: int, code: str, message: str) -> list[Piece]:
        # A UTF-8 character is at most 4 bytes: this keeps the message under the peer's str limit.
        header = {ID: rid, "code": str(code)[:64], "msg": str(message)[: self.send_limits.max_str_len // 4]}
        return encode_frame(Kind.ERROR, header, limits=self.send_limits)

    def goaway_frame(self) -> list[Piece] | None:
        """GOAWAY if the hello finished (a peer mid-hello just sees the close); we take no new calls."""
        self.going_away = True
        return encode_frame(Kind.GOAWAY, {}) if self.ready else None

    # ---------------------------------------------------------------------------- bytes in

    def receive_data(self, data: bytes | memoryview) -> list[Event]:
        """Events from the peer's bytes, in order; a broken rule ends them with `Broken`."""
        events: list[Event] = []
        if not self._reading:
            return events
        try:
            if self._opener is not None:
                self._feed(self._opener.open(data), events)
            elif self._encrypt:
                self._feed_hello(data, events)
            else:
                self._feed(data, events)
        except ProtocolError as exc:  # HandshakeError included
            self._stopped = True
            events.append(Broken(exc))
        return events

    @property
    def _reading(self) -> bool:
        return self.closed is None and not self._stopped

    def _feed(self, data: bytes | memoryview, events: list[Event]) -> None:
        self._decoder.feed(data)
        while self._reading and (frame := self._decoder.next_frame()) is not None:
            if self.ready:
                self._dispatch(frame, events)
            else:
                self._on_hello_frame(frame, events)

    def _feed_hello(self, data: bytes | memoryview, events: list[Event]) -> None:
        """Encrypting: hand the hello decoder one hello frame at a time, so that the bytes after
        the last one (sealed records the peer sent right after its welcome) reach the Opener
        instead of being parsed as plain frames. A hello frame has no payload, so its prelude
        says where it ends; the decoder still checks that prelude before we wait for more."""
        view = memoryview(data)
        while view and self._opener is None and self._reading:
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
            self._feed(piece, events)
        if view and self._opener is not None:
            self._feed(self._opener.open(view), events)

    # --------------------------------------------------------------------------------- hello

    def _on_hello_frame(self, frame: Frame, events: list[Event]) -> None:
        if frame.kind is not Kind.HELLO:
            raise HandshakeError(f"peer sent {frame.kind.name} before the hello finished")
        header = frame.header
        if "hello" in header and not self._hello_received:
            proof = self.handshake.receive_hello(_bytes(header["hello"], "hello"))
            self._hello_received = True
            events.append(Send(encode_frame(Kind.HELLO, {"proof": proof})))
        elif "proof" in header and self._hello_received and self.remote is None:
            self._receive_proof(_bytes(header["proof"], "proof"), events)
        elif "welcome" in header and self.initiator and self.remote is not None:
            self._become_ready(events)
        elif "refused" in header:
            self._stopped = True  # the peer hangs up: nothing after this frame is read
            events.append(PeerRefused(str(header["refused"])))
        else:
            raise HandshakeError(f"unexpected hello message {sorted(header)}")

    def _receive_proof(self, raw: bytes, events: list[Event]) -> None:
        peer = self.handshake.receive_proof(raw)
        if peer.send_key is not None and peer.recv_key is not None:
            self._keys = (peer.send_key, peer.recv_key)
        try:
            theirs = Limits.from_dict(peer.hello.limits)
        except MalformedFrame as exc:
            raise HandshakeError(str(exc)) from None
        if theirs.max_chunk_bytes < MIN_PEER_CHUNK_BYTES:
            raise HandshakeError(f"peer wants {theirs.max_chunk_bytes}-byte chunks, below {MIN_PEER_CHUNK_BYTES}",
                                 "incompatible")
        self.send_limits = self.limits.meet(theirs)
        self.remote = RemoteInfo(peer_id=peer.peer_id, public_key=peer.public_key, app=peer.hello.app,
                                 address=self.address, peercred=self.peercred)
        if self.initiator:
            return  # wait for the server's welcome
        reason = self._admission(self.remote)
        if reason is not None:
            raise HandshakeError(f"admission refused: {reason}", "admission")
        events.append(Send(encode_frame(Kind.HELLO, {"welcome": True})))
        self._become_ready(events)

    def _admission(self, remote: RemoteInfo) -> str | None:
        try:
            return self._admit(remote) if self._admit is not None else None
        except Exception:
            log.exception("admission hook failed for %s", self.address)
            return "the admission check failed"

    def _become_ready(self, events: list[Event]) -> None:
        # Nobody sends anything but hellos before the welcome, so the strict decoder holds nothing
        # more from an honest peer; a frame still waiting in it was sent out of turn.
        if self._decoder.next_frame() is not None:
            raise HandshakeError("peer sent frames before the hello finished")
        self._decoder = FrameDecoder(self.limits)
        if self._keys is not None:
            self._opener = Opener(self._keys[1], self.limits.max_frame_bytes)
        assert self.remote is not None
        self.ready = True
        events.append(Ready(self.remote, self._keys))

    # ------------------------------------------------------------------------------ dispatch

    def _dispatch(self, frame: Frame, events: list[Event]) -> None:
        kind = frame.kind
        if kind is Kind.PING:
            events.append(Send(PONG))
        elif kind is Kind.PONG:
            pass
        elif kind is Kind.GOAWAY:
            self.going_away = True
            events.append(GoingAway())
        elif self.initiator and kind in ANSWER_KINDS:
            self._on_answer(_frame_id(frame.header), frame, events)
        elif not self.initiator and kind is Kind.REQUEST:
            self._on_request(_frame_id(frame.header), frame, events)
        elif not self.initiator and kind is Kind.CANCEL:
            rid = _frame_id(frame.header)
            if rid in self._serving:
                events.append(Cancelled(rid))
        else:
            raise MalformedFrame(f"{kind.name} is not something the {self.role} side receives")

    def _on_answer(self, rid: int, frame: Frame, events: list[Event]) -> None:
        call = self._calls.get(rid)
        if call is None or call.done:
            return  # the call was given up on; its late answer is dropped
        if frame.kind is not Kind.ERROR and call.stream != (frame.kind in STREAM_KINDS):
            raise MalformedFrame(f"{frame.kind.name} does not answer a {'stream' if call.stream else 'unary'} call")
        if frame.kind is not Kind.STREAM_ITEM:
            call.done = True
        events.append(Answer(rid, frame))

    def _on_request(self, rid: int, frame: Frame, events: list[Event]) -> None:
        if rid in self._serving:
            raise MalformedFrame(f"request id {rid} is already running")
        method, timeout = frame.header.get("m"), frame.header.get("t")
        if not isinstance(method, str):
            raise MalformedFrame("request has no method name")
        if timeout is not None and not (type(timeout) in (int, float) and math.isfinite(timeout) and timeout >= 0):
            raise MalformedFrame(f"request timeout {timeout!r} is not a finite number of seconds")
        self._serving.add(rid)
        events.append(Incoming(rid, method, None if timeout is None else float(timeout), frame))

    # ------------------------------------------------------------------------ calls we make

    def check_open(self) -> None:
        """Raise what a new call on this connection would meet."""
        if self.closed is not None:
            raise ConnectionLost(f"connection to {self.address} is closed: {self.closed}")
        if self.going_away:
            raise ConnectionLost(f"{self.address} is going away; open a new connection")
        if not self.ready:
            raise LocalProtocolError("call before the hello finished")

    def start_call(self, stream: bool) -> int:
        """A fresh id for a call (ids are never reused on a connection)."""
        if not self.initiator:
            raise LocalProtocolError("only the side that dialled makes calls")
        self.check_open()
        rid = next(self._ids)
        self._calls[rid] = _CallState(stream)
        return rid

    def call_sent(self, rid: int) -> None:
        """The request of `rid` is queued or written: from here on, giving up tells the server."""
        self._calls[rid].sent = True

    def end_call(self, rid: int, untouched: bool) -> list[Piece] | None:
        """Forget call `rid`; returns the CANCEL owed to the server when it may be working on it
        (the request left, or began to, and no final answer came). `untouched`: none of the
        request's bytes were written. A late answer to a forgotten call is dropped."""
        call = self._calls.pop(rid, None)
        if call is None or call.done or self.closed is not None:
            return None
        self._decoder.discard(rid)
        return encode_frame(Kind.CANCEL, {ID: rid}) if call.sent and not untouched else None

    # -------------------------------------------------------------------- requests we serve

    @property
    def serving(self) -> int:
        """How many requests are being served."""
        return len(self._serving)

    def request_done(self, rid: int) -> None:
        """Request `rid` was answered, refused or cancelled: its id is free again."""
        self._serving.discard(rid)

    def close(self, error: BaseException) -> bool:
        """The connection ends with `error`; False when it had already ended."""
        if self.closed is not None:
            return False
        self.closed = error
        return True


def _bytes(raw: object, what: str) -> bytes:
    if not isinstance(raw, bytes):
        raise HandshakeError(f"{what} body is not bytes")
    return raw


def _frame_id(header: dict) -> int:
    rid = header.get(ID)
    if type(rid) is not int or rid < 0:
        raise MalformedFrame(f"frame has no valid {ID!r}")
    return rid
