"""The sealed record layer: what an encrypted connection (RpcConfig.encrypt) writes after the hello.

Each frame the connection writes becomes one record, `u32 length ‖ u64 counter ‖ ciphertext`, where
the ciphertext is ChaCha20-Poly1305 of the frame's bytes under the key of that direction, with the
counter as nonce and the 12-byte record head as associated data. The counter starts at 0 in each
direction and goes up by one per record, and the receiver accepts only the next one it expects,
so a record replayed, dropped, reordered or spliced in from another connection (other keys) fails,
as does any flipped bit: all are a SealError and the connection closes.

ChaCha20-Poly1305 rather than AES-GCM because it is constant-time and fast without AES hardware,
and we cannot choose the CPUs volunteers bring. The keys come from the hello (transport.handshake:
an X25519 exchange bound to the signed transcript), fresh for each connection.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from .errors import LimitExceeded, SealError

KEY_BYTES = 32
TAG_BYTES = 16
RECORD_HEAD = struct.Struct("!IQ")
"""Ciphertext length (tag included), then the record's counter."""
_NONCE_PREFIX = b"\x00\x00\x00\x00"  # a 96-bit nonce: 4 zero bytes and the 64-bit counter


def _nonce(counter: int) -> bytes:
    return _NONCE_PREFIX + counter.to_bytes(8, "big")


class Sealer:
    """Our direction: seals each frame into one record and hands it to `writelines`."""

    def __init__(self, key: bytes, writelines: Callable[[Sequence[bytes]], None]) -> None:
        self._aead = ChaCha20Poly1305(key)
        self._writelines = writelines
        self._counter = 0

    def seal(self, pieces: Sequence[bytes | memoryview]) -> tuple[bytes, bytes]:
        """The record's head and ciphertext (kept apart: joining them would copy a whole chunk)."""
        plaintext = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        head = RECORD_HEAD.pack(len(plaintext) + TAG_BYTES, self._counter)
        sealed = self._aead.encrypt(_nonce(self._counter), plaintext, head)
        self._counter += 1
        return head, sealed

    def writelines(self, pieces: Sequence[bytes | memoryview]) -> None:
        """Drop-in for `transport.writelines` once the connection is sealed."""
        self._writelines(self.seal(pieces))


class Opener:
    """The peer's direction: bytes as read from the socket in, the plaintext of every complete
    record out. A record longer than `max_record_bytes` of plaintext is refused from its head,
    before its body is buffered."""

    def __init__(self, key: bytes, max_record_bytes: int) -> None:
        self._aead = ChaCha20Poly1305(key)
        self._max = max_record_bytes + TAG_BYTES
        self._buffer = bytearray()
        self._counter = 0

    def open(self, data: bytes | bytearray | memoryview) -> bytes:
        buffer = self._buffer
        buffer += data
        out = []
        while len(buffer) >= RECORD_HEAD.size:
            length, counter = RECORD_HEAD.unpack_from(buffer)
            if length > self._max:
                raise LimitExceeded("sealed record", length, self._max)
            if length < TAG_BYTES:
                raise SealError(f"sealed record of {length} bytes cannot hold its {TAG_BYTES}-byte tag")
            if counter != self._counter:
                raise SealError(f"sealed record {counter} arrived where {self._counter} was due: "
                                "replayed, dropped or reordered")
            end = RECORD_HEAD.size + length
            if len(buffer) < end:
                break
            with memoryview(buffer) as view:  # released before the buffer is resized below
                try:
                    out.append(
                        self._aead.decrypt(_nonce(counter), view[RECORD_HEAD.size:end], view[:RECORD_HEAD.size])
                    )
                except InvalidTag:
                    raise SealError(f"sealed record {counter} fails authentication: altered on the way") from None
            del buffer[:end]
            self._counter += 1
        return out[0] if len(out) == 1 else b"".join(out)
