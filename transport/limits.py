"""Every length a peer can announce, bounded by one named setting checked before allocation.

A peer is untrusted until proven otherwise and a frame prelude costs it 16 bytes, so each number it
sends (header size, buffer count, buffer size, msgpack container sizes, tensor element counts,
decompressed sizes) is compared with a field here before a single byte is reserved for it. The
defaults fit SWARM traffic: activations and gradients of a few hundred MB at most, small headers.
Both sides put their limits in the hello, and a sender keeps to the receiver's (see `meet`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from transport.errors import MalformedFrame

KiB = 1024
MiB = 1024 * KiB

PRELUDE_BYTES = 16
"""Fixed size of a frame prelude (see transport.wire); needed here to check limits add up."""

LENGTH_ENTRY_BYTES = 8
"""Each payload buffer's length is one big-endian u64 in the frame's length table."""

LZ4_MAX_RATIO = 32
"""Raw bytes per lz4 byte a sender keeps to and a receiver accepts by default: a 4 MB message then
decodes to at most 128 MB of payload (256 MB once fp16 is widened), not to GBs."""


@dataclass(frozen=True, slots=True)
class Limits:
    # A header is parsed in one piece and msgpack can amplify ~50x into Python objects, so it stays
    # small; bulk data belongs in buffers. 64 KiB holds the metadata of hundreds of tensors.
    max_header_bytes: int = 64 * KiB
    # One tensor is one or two buffers (int8 adds its scales); a stage's parameter shard is a few
    # hundred tensors. The length table costs 8 bytes per buffer, so 1024 is an 8 KiB table.
    max_buffers_per_frame: int = 1024
    # Largest single payload buffer of a message: a 256 MB activation with room to spare.
    max_buffer_bytes: int = 512 * MiB
    # Largest sum of payload buffers of one message (inline or chunked).
    max_message_bytes: int = 512 * MiB
    # Payloads above this are split into CHUNK frames so a small control frame waits at most one
    # chunk: 1 MiB is ~42 ms at 200 Mb/s and keeps per-frame overhead (~30 bytes, one msgpack
    # parse) under 0.01% of the bytes.
    max_chunk_bytes: int = 1 * MiB
    # Largest frame on the wire (prelude + length table + header + inline payload): one chunk plus a
    # full header and length table fits, nothing bigger is ever buffered in one piece.
    max_frame_bytes: int = 2 * MiB
    # Per connection and direction: bytes of chunked messages announced but not yet complete. The
    # receiver refuses past it; a sender keeps its opened-but-not-fully-written chunked messages under
    # the peer's value; the RPC also uses it to bound queued payloads (backpressure, not buffering).
    max_inflight_bytes: int = 512 * MiB
    # msgpack container and scalar sizes inside a header (msgpack.Unpacker's max_*_len): strings are
    # method names and error messages; bins are keys, signatures and small DHT values.
    max_str_len: int = 16 * KiB
    max_bin_len: int = 64 * KiB
    max_array_len: int = 16 * KiB
    max_map_len: int = 4 * KiB
    # We define no msgpack extension types; any ext in a header is refused.
    max_ext_len: int = 0
    # A decoded tensor may hold at most this many elements: 2^28 fp32 is 1 GiB.
    max_tensor_elements: int = 2**28
    # Dimensions of a decoded tensor's shape: transformers use 4 or 5; bounds the shape list.
    max_tensor_dims: int = 32
    # lz4 never inflates a payload past this (and never past what the metadata announces): a
    # compressed block can claim a 255x expansion, so the bound is on the output, not the input.
    max_decompressed_bytes: int = 1024 * MiB
    # Sum of the decoded sizes every tensor of one message announces, checked before the first one
    # is decoded (codecs.check_message_budget): the per-tensor bounds above times 1024 tensors
    # would let 4 MB of lz4 bombs claim GBs. An honest message is at most max_message_bytes on the
    # wire and fp16 decodes to fp32, so twice that is the most honest traffic needs.
    max_decoded_message_bytes: int = 1024 * MiB
    # An lz4 payload may announce at most this many raw bytes per compressed byte. lz4 itself
    # reaches ~255x on runs of zeros, which is what bombs are made of; activations and gradients
    # that compress this well are nearly all zeros, and encode_tensor sends those uncompressed.
    max_lz4_ratio: int = LZ4_MAX_RATIO

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Limits.{field.name} must be a non-negative int, got {value!r}")
        frame_needed = (
            PRELUDE_BYTES
            + LENGTH_ENTRY_BYTES * self.max_buffers_per_frame
            + self.max_header_bytes
            + self.max_chunk_bytes
        )
        if self.max_frame_bytes < frame_needed:
            raise ValueError(
                f"max_frame_bytes={self.max_frame_bytes} cannot hold a chunk with a full header and "
                f"length table ({frame_needed} bytes)"
            )
        if self.max_chunk_bytes < 1:
            raise ValueError("max_chunk_bytes must be at least 1")

    def as_dict(self) -> dict[str, int]:
        """The limits as a msgpack-able dict, for the hello."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> Limits:
        """Limits a peer announced; unknown names are ignored (a newer peer), missing ones default.

        The values came off the wire, so a bad one is the peer's fault: MalformedFrame.
        """
        if not isinstance(values, dict):
            raise MalformedFrame(f"limits must be a map, got {type(values).__name__}")
        names = {field.name for field in dataclasses.fields(cls)}
        try:
            return cls(**{key: value for key, value in values.items() if key in names})
        except ValueError as exc:
            raise MalformedFrame(f"peer announced unusable limits: {exc}") from None

    def meet(self, other: Limits) -> Limits:
        """The strictest of both: what a sender should keep to when talking to a peer with `other`."""
        return Limits(
            **{
                field.name: min(getattr(self, field.name), getattr(other, field.name))
                for field in dataclasses.fields(self)
            }
        )
