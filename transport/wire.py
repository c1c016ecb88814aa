"""Frames as bytes, with no I/O: the RPC feeds what it reads and writes what we return (as h11 does).

A frame is a 16-byte prelude, a table of payload lengths, a msgpack header and the payloads. Every
length is compared with `Limits` the moment it is read, before anything is allocated for it, so a
peer costs us at most what our limits allow. Payloads larger than a chunk travel as CHUNK frames
after an opener that announces their sizes; the decoder reassembles them into buffers preallocated
only after that check, so the RPC above sees whole messages and a small control frame is never
stuck behind a 100 MB tensor. The byte-by-byte description is docs/protocol.md.
"""

from __future__ import annotations

import enum
import struct
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgpack
import numpy

from transport.errors import (
    BadMagic,
    LimitExceeded,
    LocalProtocolError,
    MalformedFrame,
    ProtocolError,
    UnsupportedVersion,
)
from transport.limits import LENGTH_ENTRY_BYTES, PRELUDE_BYTES, Limits

MAGIC = b"SWRM"
VERSION = 1
PRELUDE = struct.Struct("!4sBBHII")  # magic, version, kind, flags, header length, buffer count
assert PRELUDE.size == PRELUDE_BYTES

ID = "id"
"""Header key of the message id; chunking routes CHUNK frames to their opener by it."""

FLAG_CHUNKED = 0x0001
"""On a data frame: the length table announces the message's buffers, which follow as CHUNK frames."""
_KNOWN_FLAGS = FLAG_CHUNKED


class Kind(enum.IntEnum):
    """What a frame is; the RPC gives each its meaning, the wire only its shape."""

    HELLO = 1  # first frame each way: versions, limits, identity proof
    REQUEST = 2  # a call: method, id, deadline, tensor metadata
    RESPONSE = 3  # the answer to a unary call
    STREAM_ITEM = 4  # one item of a streamed answer
    STREAM_END = 5  # a stream finished normally
    ERROR = 6  # a call failed: code and message
    CANCEL = 7  # the caller gave up on a call
    PING = 8  # heartbeat
    PONG = 9  # heartbeat answer
    CHUNK = 10  # a slice of a chunked message's buffer
    GOAWAY = 11  # the sender starts no new calls on this connection


_KINDS = {kind.value: kind for kind in Kind}
DATA_KINDS = frozenset({Kind.REQUEST, Kind.RESPONSE, Kind.STREAM_ITEM})
"""Only these carry payload buffers (inline or chunked)."""

Piece = bytes | memoryview


@dataclass(slots=True)
class Frame:
    """A whole frame, or a whole chunked message; `buffers` are writable and owned by the frame."""

    kind: Kind
    header: dict
    buffers: list[memoryview] = field(default_factory=list)


def _allocate(size: int) -> memoryview:
    """Writable bytes for a payload whose size was already checked against the limits.

    numpy asks the kernel for huge pages on large blocks and skips the zero-fill, so a 64 MB payload
    lands ~6x faster than in a bytearray. Every byte is written before the frame is handed out.
    """
    return memoryview(numpy.empty(size, dtype=numpy.uint8))


# --------------------------------------------------------------------------------------- encoding


def _pack_header(header: dict, limits: Limits) -> bytes:
    if not isinstance(header, dict):
        raise LocalProtocolError(f"a header is a dict, got {type(header).__name__}")
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"header is not msgpack-able: {exc}") from None
    if len(packed) > limits.max_header_bytes:
        raise LocalProtocolError(f"header is {len(packed)} bytes, limit {limits.max_header_bytes}")
    return packed


def _as_bytes_view(buffer: Piece) -> memoryview:
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise LocalProtocolError("payload buffers must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _head(kind: Kind, flags: int, packed: bytes, lengths: Sequence[int]) -> bytes:
    prelude = PRELUDE.pack(MAGIC, VERSION, kind, flags, len(packed), len(lengths))
    return b"".join((prelude, struct.pack(f"!{len(lengths)}Q", *lengths), packed))


def _payload_views(kind: Kind, buffers: Sequence[Piece], limits: Limits) -> list[memoryview]:
    """The buffers as flat byte views, after the checks the receiver would make on them."""
    views = [_as_bytes_view(b) for b in buffers]
    if views and kind not in DATA_KINDS:
        raise LocalProtocolError(f"{kind.name} frames carry no payload buffers")
    if len(views) > limits.max_buffers_per_frame:
        raise LocalProtocolError(f"{len(views)} buffers, limit {limits.max_buffers_per_frame}")
    biggest = max((v.nbytes for v in views), default=0)
    if biggest > limits.max_buffer_bytes:
        raise LocalProtocolError(f"a buffer is {biggest} bytes, limit {limits.max_buffer_bytes}")
    return views


def encode_frame(
    kind: Kind, header: dict, buffers: Sequence[Piece] = (), limits: Limits = Limits()
) -> list[Piece]:
    """One frame as pieces for `writelines`; payloads are returned as views, never copied.

    `limits` are the receiver's (see `Limits.meet`); breaking them is our bug: LocalProtocolError.
    """
    kind = Kind(kind)
    views = _payload_views(kind, buffers, limits)
    lengths = [v.nbytes for v in views]
    head = _head(kind, 0, _pack_header(header, limits), lengths)
    if len(head) + sum(lengths) > limits.max_frame_bytes:
        raise LocalProtocolError(
            f"frame is {len(head) + sum(lengths)} bytes, limit {limits.max_frame_bytes}; "
            "use encode_message to chunk it"
        )
    return [head, *(v for v in views if v.nbytes)]


def encode_message(
    kind: Kind, header: dict, buffers: Sequence[Piece] = (), limits: Limits = Limits()
) -> list[list[Piece]]:
    """A message as frames, each a list of pieces; write them in order, others may go in between.

    Payloads up to `limits.max_chunk_bytes` in total travel inline in one frame. Larger ones get an
    opener (FLAG_CHUNKED, the length table, no payload) and then CHUNK frames of at most
    `max_chunk_bytes`, each a view into the caller's buffers. The header must then carry an int
    `id` unique among this direction's open chunked messages; until the last chunk is written, any
    other frame with that id abandons the message.
    """
    kind = Kind(kind)
    views = _payload_views(kind, buffers, limits)
    total = sum(v.nbytes for v in views)
    if total <= limits.max_chunk_bytes:
        return [encode_frame(kind, header, views, limits)]
    msg_id = header.get(ID) if isinstance(header, dict) else None
    if not _is_id(msg_id):
        raise LocalProtocolError(f"a chunked message needs a non-negative int header[{ID!r}]")
    if total > min(limits.max_message_bytes, limits.max_inflight_bytes):
        raise LocalProtocolError(
            f"message is {total} bytes, limits {limits.max_message_bytes} per message and "
            f"{limits.max_inflight_bytes} in flight"
        )
    frames = [[_head(kind, FLAG_CHUNKED, _pack_header(header, limits), [v.nbytes for v in views])]]
    step = limits.max_chunk_bytes
    for index, view in enumerate(views):
        for offset in range(0, view.nbytes, step):
            piece = view[offset : offset + step]
            chunk_header = msgpack.packb({ID: msg_id, "b": index, "o": offset})
            frames.append([_head(Kind.CHUNK, 0, chunk_header, [piece.nbytes]), piece])
    return frames


# --------------------------------------------------------------------------------------- decoding


@dataclass(slots=True)
class _Assembly:
    """A chunked message being filled, chunk by chunk, in order."""

    kind: Kind
    header: dict
    buffers: list[memoryview] | None  # None once discarded: remaining chunks are skipped
    lengths: list[int]
    total: int
    index: int = 0  # buffer the next chunk must belong to
    offset: int = 0  # and where in it it must start

    def skip_empty(self) -> None:
        while self.index < len(self.lengths) and self.offset == self.lengths[self.index]:
            self.index, self.offset = self.index + 1, 0

    @property
    def complete(self) -> bool:
        return self.index == len(self.lengths)


class FrameDecoder:
    """Bytes in (`feed`), whole frames out (`next_frame`); chunked messages come out reassembled.

    Each announced length is checked the moment its bytes arrive. After a ProtocolError the stream
    cannot be resynchronised: every later call raises the same error and the connection must close.
    """

    def __init__(self, limits: Limits = Limits()) -> None:
        self._limits = limits
        self._ready: deque[Frame] = deque()
        self._open: dict[int, _Assembly] = {}
        self._open_bytes = 0
        self._error: ProtocolError | None = None
        # current frame
        self._small = bytearray()  # a prelude, length table or header split across feeds
        self._need = PRELUDE_BYTES
        self._phase: Callable[[memoryview | bytearray], None] = self._on_prelude
        self._in_payload = False
        self._kind = Kind.PING
        self._flags = 0
        self._header_len = 0
        self._lengths: list[int] = []
        self._header: dict = {}
        self._targets: list[memoryview | int] = []  # where payload bytes go; an int means skip that many
        self._buffers: list[memoryview] = []
        self._target = 0
        self._filled = 0
        self._chunk: _Assembly | None = None

    @property
    def assembling_bytes(self) -> int:
        """Bytes of chunked messages announced to us and not complete yet."""
        return self._open_bytes

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Consume bytes as read from the socket; parses eagerly, so a bad length raises here."""
        if self._error is not None:
            raise self._error
        view = memoryview(data).cast("B")
        try:
            self._consume(view)
        except ProtocolError as exc:
            self._error = exc
            raise

    def next_frame(self) -> Frame | None:
        """The next complete frame or message, or None until more bytes are fed."""
        if self._error is not None:
            raise self._error
        return self._ready.popleft() if self._ready else None

    def discard(self, msg_id: int) -> None:
        """Stop keeping a chunked message we no longer want (its call was cancelled locally).

        Its remaining chunks are still read off the stream and dropped, so the stream stays in sync.
        """
        assembly = self._open.get(msg_id)
        if assembly is not None and assembly.buffers is not None:
            assembly.buffers = None
            self._open_bytes -= assembly.total

    # The state machine: `_need` bytes of prelude, length table or header are handed to `_phase`
    # (straight from the fed data when they are all there, else gathered in `_small`), which checks
    # them and says what comes next; payload bytes go straight into their preallocated targets.

    def _consume(self, view: memoryview) -> None:
        pos, end = 0, len(view)
        while pos < end:
            if self._in_payload:
                pos = self._fill_payload(view, pos, end)
                continue
            need = self._need
            if not self._small and end - pos >= need:
                pos += need
                self._phase(view[pos - need : pos])
                continue
            take = min(need - len(self._small), end - pos)
            self._small += view[pos : pos + take]
            pos += take
            if len(self._small) == need:
                self._phase(self._small)
                self._small.clear()

    def _on_prelude(self, raw: memoryview | bytearray) -> None:
        magic, version, kind, flags, header_len, count = PRELUDE.unpack(raw)
        if magic != MAGIC:
            raise BadMagic(f"frame starts with {bytes(magic)!r}, not {MAGIC!r}")
        if version != VERSION:
            raise UnsupportedVersion(f"wire version {version}, we speak {VERSION}")
        self._kind = _KINDS.get(kind)  # type: ignore[assignment]
        if self._kind is None:
            raise MalformedFrame(f"unknown frame kind {kind}")
        if flags & ~_KNOWN_FLAGS:
            raise MalformedFrame(f"unknown flags {flags:#06x}")
        if flags & FLAG_CHUNKED and self._kind not in DATA_KINDS:
            raise MalformedFrame(f"{self._kind.name} cannot be chunked")
        limits = self._limits
        if header_len > limits.max_header_bytes:
            raise LimitExceeded("header length", header_len, limits.max_header_bytes)
        if header_len == 0:
            raise MalformedFrame("empty header")
        if count > limits.max_buffers_per_frame:
            raise LimitExceeded("buffer count", count, limits.max_buffers_per_frame)
        if flags & FLAG_CHUNKED and count == 0:
            raise MalformedFrame("chunked message with no buffers")
        if self._kind is Kind.CHUNK and count != 1:
            raise MalformedFrame(f"a CHUNK frame has exactly one buffer, got {count}")
        if count and self._kind not in DATA_KINDS and self._kind is not Kind.CHUNK:
            raise MalformedFrame(f"{self._kind.name} frames carry no buffers, got {count}")
        head = PRELUDE_BYTES + LENGTH_ENTRY_BYTES * count + header_len
        if head > limits.max_frame_bytes:
            raise LimitExceeded("frame head", head, limits.max_frame_bytes)
        self._flags, self._header_len = flags, header_len
        if count:
            self._need, self._phase = LENGTH_ENTRY_BYTES * count, self._on_lengths
        else:
            self._lengths = []
            self._need, self._phase = header_len, self._on_header

    def _on_lengths(self, raw: memoryview | bytearray) -> None:
        count = len(raw) // LENGTH_ENTRY_BYTES
        lengths = list(struct.unpack(f"!{count}Q", raw))
        limits = self._limits
        biggest, total = max(lengths), sum(lengths)
        if biggest > limits.max_buffer_bytes:
            raise LimitExceeded("buffer length", biggest, limits.max_buffer_bytes)
        if self._kind is Kind.CHUNK:
            if biggest > limits.max_chunk_bytes:
                raise LimitExceeded("chunk length", biggest, limits.max_chunk_bytes)
            if biggest == 0:
                raise MalformedFrame("empty chunk")
        elif self._flags & FLAG_CHUNKED:
            if total > limits.max_message_bytes:
                raise LimitExceeded("message length", total, limits.max_message_bytes)
            if total == 0:
                raise MalformedFrame("chunked message with no payload")
        else:
            frame = PRELUDE_BYTES + LENGTH_ENTRY_BYTES * count + self._header_len + total
            if frame > limits.max_frame_bytes:
                raise LimitExceeded("frame length", frame, limits.max_frame_bytes)
        self._lengths = lengths
        self._need, self._phase = self._header_len, self._on_header

    def _on_header(self, raw: memoryview | bytearray) -> None:
        self._header = header = self._unpack_header(raw)
        msg_id = header.get(ID)
        if self._kind is Kind.CHUNK:
            self._start_chunk(msg_id)
            return
        if _is_id(msg_id) and msg_id in self._open:  # another frame with an open id abandons it
            self._abandon(msg_id)
        if self._flags & FLAG_CHUNKED:
            self._open_message(msg_id)
        elif not self._lengths:
            self._finish(Frame(self._kind, header))
        else:
            self._buffers = [_allocate(n) for n in self._lengths]
            self._start_payload([b for b in self._buffers if b.nbytes])

    def _unpack_header(self, raw: memoryview | bytearray) -> dict:
        limits = self._limits
        try:
            header = msgpack.unpackb(
                raw,
                raw=False,
                strict_map_key=True,
                max_str_len=limits.max_str_len,
                max_bin_len=limits.max_bin_len,
                max_array_len=limits.max_array_len,
                max_map_len=limits.max_map_len,
                max_ext_len=limits.max_ext_len,
                ext_hook=_refuse_ext,
            )
        except (ValueError, UnicodeDecodeError, msgpack.UnpackException) as exc:
            # ExtraData (trailing bytes) and truncation are ValueErrors too
            raise MalformedFrame(f"bad msgpack header: {exc}") from None
        if not isinstance(header, dict):
            raise MalformedFrame(f"header must be a map, got {type(header).__name__}")
        return header

    def _open_message(self, msg_id: object) -> None:
        if not _is_id(msg_id):
            raise MalformedFrame(f"a chunked message needs a non-negative int {ID!r}")
        total = sum(self._lengths)
        if self._open_bytes + total > self._limits.max_inflight_bytes:
            raise LimitExceeded(
                "bytes of open chunked messages", self._open_bytes + total, self._limits.max_inflight_bytes
            )
        assembly = _Assembly(
            self._kind, self._header, [_allocate(n) for n in self._lengths], self._lengths, total
        )
        assembly.skip_empty()
        self._open[msg_id] = assembly
        self._open_bytes += total
        self._finish(None)

    def _start_chunk(self, msg_id: object) -> None:
        assembly = self._open.get(msg_id) if _is_id(msg_id) else None
        if assembly is None:
            raise MalformedFrame(f"CHUNK for {msg_id!r}, which is not an open chunked message")
        index, offset, length = self._header.get("b"), self._header.get("o"), self._lengths[0]
        if (type(index), type(offset)) != (int, int) or (index, offset) != (assembly.index, assembly.offset):
            raise MalformedFrame(
                f"CHUNK of message {msg_id} at buffer {index!r} offset {offset!r}; "
                f"expected buffer {assembly.index} offset {assembly.offset}"
            )
        if offset + length > assembly.lengths[index]:
            raise MalformedFrame(f"CHUNK runs past the end of buffer {index} of message {msg_id}")
        self._chunk = assembly
        if assembly.buffers is None:
            self._start_payload([length])
        else:
            self._start_payload([assembly.buffers[index][offset : offset + length]])

    def _start_payload(self, targets: list[memoryview | int]) -> None:
        self._targets, self._target, self._filled = targets, 0, 0
        if targets:
            self._in_payload = True
        else:
            self._on_payload()

    def _fill_payload(self, view: memoryview, pos: int, end: int) -> int:
        while self._target < len(self._targets) and pos < end:
            target = self._targets[self._target]
            size = target if isinstance(target, int) else target.nbytes
            take = min(size - self._filled, end - pos)
            if not isinstance(target, int):
                target[self._filled : self._filled + take] = view[pos : pos + take]
            pos += take
            self._filled += take
            if self._filled == size:
                self._target, self._filled = self._target + 1, 0
        if self._target == len(self._targets):
            self._on_payload()
        return pos

    def _on_payload(self) -> None:
        chunk, self._chunk = self._chunk, None
        buffers, self._buffers, self._targets = self._buffers, [], []
        if chunk is None:
            self._finish(Frame(self._kind, self._header, buffers))
            return
        chunk.offset += self._lengths[0]
        chunk.skip_empty()
        if chunk.complete:
            msg_id = self._header[ID]
            del self._open[msg_id]
            if chunk.buffers is not None:
                self._open_bytes -= chunk.total
                self._ready.append(Frame(chunk.kind, chunk.header, chunk.buffers))
        self._finish(None)

    def _abandon(self, msg_id: int) -> None:
        self.discard(msg_id)
        del self._open[msg_id]

    def _finish(self, frame: Frame | None) -> None:
        """The current frame is done: hand it out (if whole) and expect the next prelude."""
        if frame is not None:
            self._ready.append(frame)
        self._in_payload = False
        self._need, self._phase = PRELUDE_BYTES, self._on_prelude


def _is_id(value: object) -> bool:
    return type(value) is int and value >= 0


def _refuse_ext(code: int, data: bytes) -> None:
    raise ValueError(f"msgpack extension type {code} is not part of the protocol")
