"""The frame decoder fed random and mutated bytes: typed refusals only, no crash, no hang, no big allocation."""

from __future__ import annotations

import gc
import os
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transport.errors import ProtocolError
from transport.limits import Limits
from transport.wire import FrameDecoder, Kind, encode_frame, encode_message

# Small limits, so "no allocation past a limit" is measurable: a few hundred kB at most.
LIMITS = Limits(max_header_bytes=2048, max_buffers_per_frame=16, max_buffer_bytes=20_000,
                max_message_bytes=30_000, max_chunk_bytes=4096, max_frame_bytes=8192,
                max_inflight_bytes=60_000, max_str_len=512, max_bin_len=512,
                max_array_len=64, max_map_len=64)  # fmt: skip
ALLOCATION_CEILING = 4 * (LIMITS.max_inflight_bytes + LIMITS.max_frame_bytes)

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def _valid_stream() -> bytes:
    frames = [
        encode_frame(Kind.HELLO, {"version": 1, "app": {"addr": "10.0.0.1:4000"}}),
        encode_frame(Kind.REQUEST, {"id": 1, "method": "m", "tensors": [{"dtype": "float32"}]}, [os.urandom(100)]),
        *encode_message(Kind.RESPONSE, {"id": 2}, [os.urandom(9000), b"ab"], LIMITS),
        encode_frame(Kind.PING, {}),
    ]
    return b"".join(bytes(p) for frame in frames for p in frame)


VALID = _valid_stream()


def _feed_checked(data: bytes, step: int) -> None:
    """Feed in pieces; the only exception allowed is a ProtocolError, and memory stays bounded."""
    decoder = FrameDecoder(LIMITS)
    # No collection inside the measured feed: finalizers of earlier tests' objects would allocate
    # there and be counted as the decoder's. Disabling is enough; a collection per example cost
    # ~0.1 s on the heap of a full run (150 examples a test, minutes in all).
    gc.disable()
    # A tracer someone else left on would make start() a no-op and its old peak ours.
    assert not tracemalloc.is_tracing(), "tracemalloc already tracing: an earlier test left it on"
    tracemalloc.start()
    try:
        for i in range(0, len(data), step):
            try:
                decoder.feed(data[i : i + step])
                while decoder.next_frame() is not None:
                    pass
            except ProtocolError:
                break
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        gc.enable()
    assert peak < ALLOCATION_CEILING


@FUZZ
@given(st.binary(max_size=4096), st.integers(1, 64))
def test_random_bytes_give_only_protocol_errors(data, step):
    _feed_checked(data, step)


@FUZZ
@given(st.binary(min_size=0, max_size=400), st.integers(1, 64))
def test_random_bytes_after_a_valid_prelude_give_only_protocol_errors(tail, step):
    _feed_checked(VALID[:16] + tail, step)


@pytest.mark.slow
@FUZZ
@given(
    st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8),
    st.integers(1, 2048),
)
def test_mutated_frames_give_only_protocol_errors(mutations, step):
    data = bytearray(VALID)
    for position, value in mutations:
        data[position] = value
    _feed_checked(bytes(data), step)


@pytest.mark.slow
@FUZZ
@given(st.integers(0, len(VALID)), st.binary(max_size=64), st.integers(1, 2048))
def test_spliced_frames_give_only_protocol_errors(cut, insert, step):
    _feed_checked(VALID[:cut] + insert + VALID[cut:], step)


def test_valid_stream_decodes_cleanly():
    decoder = FrameDecoder(LIMITS)
    decoder.feed(VALID)
    kinds = []
    while (frame := decoder.next_frame()) is not None:
        kinds.append(frame.kind)
    assert kinds == [Kind.HELLO, Kind.REQUEST, Kind.RESPONSE, Kind.PING]
