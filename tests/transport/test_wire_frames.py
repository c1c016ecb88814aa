"""Frames on bytes: round-trips, chunked messages and their interleaving, and every length a peer can lie about."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.errors import (
    BadMagic,
    LimitExceeded,
    LocalProtocolError,
    MalformedFrame,
    ProtocolError,
    UnsupportedVersion,
)
from transport.limits import MiB, Limits
from transport.wire import (
    FLAG_CHUNKED,
    MAGIC,
    PRELUDE,
    VERSION,
    FrameDecoder,
    Kind,
    encode_frame,
    encode_message,
)

SMALL = Limits(max_chunk_bytes=1000, max_frame_bytes=80_000, max_buffer_bytes=50_000,
               max_message_bytes=60_000, max_inflight_bytes=100_000)  # fmt: skip


def _joined(pieces) -> bytes:
    return b"".join(bytes(p) for p in pieces)


def _stream(frames) -> bytes:
    return b"".join(_joined(f) for f in frames)


def _raw_frame(kind=Kind.REQUEST, header=b"\x80", lengths=(), flags=0, magic=MAGIC, version=VERSION):
    """A frame built by hand, so it can say anything."""
    prelude = PRELUDE.pack(magic, version, kind, flags, len(header), len(lengths))
    return prelude + struct.pack(f"!{len(lengths)}Q", *lengths) + header


def _decode_all(data: bytes, limits=Limits(), step=None):
    decoder = FrameDecoder(limits)
    step = step or max(1, len(data))
    for i in range(0, len(data), step):
        decoder.feed(data[i : i + step])
    frames = []
    while (frame := decoder.next_frame()) is not None:
        frames.append(frame)
    return frames, decoder


def test_frame_round_trips_kind_header_and_buffers():
    header = {"id": 7, "method": "stage.forward", "deadline": 12.5, "meta": {"k": [1, b"x", None]}}
    buffers = [b"abc", bytearray(b""), memoryview(b"\x00\x01" * 100)]
    (frame,), _ = _decode_all(_joined(encode_frame(Kind.REQUEST, header, buffers)))
    assert frame.kind is Kind.REQUEST
    assert frame.header == header
    assert [bytes(b) for b in frame.buffers] == [b"abc", b"", b"\x00\x01" * 100]


@pytest.mark.parametrize("step", [1, 3, 16, 17, 4096])
def test_decoder_is_indifferent_to_how_bytes_are_split(step):
    frames = [
        encode_frame(Kind.PING, {"t": 1}),
        encode_frame(Kind.RESPONSE, {"id": 1}, [os.urandom(300), b"z"]),
        encode_frame(Kind.STREAM_END, {"id": 1}),
    ]
    decoded, _ = _decode_all(_stream(frames), step=step)
    assert [f.kind for f in decoded] == [Kind.PING, Kind.RESPONSE, Kind.STREAM_END]
    assert bytes(decoded[1].buffers[1]) == b"z"


def test_payloads_are_returned_as_views_not_copies():
    payload = bytearray(os.urandom(500))
    pieces = encode_frame(Kind.REQUEST, {"id": 1}, [payload])
    assert isinstance(pieces[1], memoryview) and pieces[1].obj is payload


def test_decoded_buffers_are_writable():
    (frame,), _ = _decode_all(_joined(encode_frame(Kind.RESPONSE, {"id": 1}, [b"abcd"])))
    assert not frame.buffers[0].readonly
    frame.buffers[0][0] = ord("z")
    assert bytes(frame.buffers[0]) == b"zbcd"


def test_large_message_is_chunked_and_reassembled():
    data = os.urandom(5500)
    frames = encode_message(Kind.REQUEST, {"id": 9, "method": "m"}, [b"head", data, b""], SMALL)
    assert len(frames) == 1 + 1 + 6  # opener, one chunk for b"head", six for 5500 bytes of 1000
    assert all(sum(len(p) for p in f[1:]) <= SMALL.max_chunk_bytes for f in frames[1:])
    (message,), decoder = _decode_all(_stream(frames), SMALL, step=777)
    assert message.kind is Kind.REQUEST and message.header == {"id": 9, "method": "m"}
    assert [bytes(b) for b in message.buffers] == [b"head", data, b""]
    assert decoder.assembling_bytes == 0


def test_small_message_stays_one_frame():
    frames = encode_message(Kind.RESPONSE, {"id": 1}, [b"x" * 1000], SMALL)
    assert len(frames) == 1


def test_control_frames_interleave_with_chunks_of_two_messages():
    """Chunks of two messages and a PING interleave; each message comes out whole when its last
    chunk arrives, the PING as soon as it is read."""
    a = encode_message(Kind.REQUEST, {"id": 1}, [os.urandom(3000)], SMALL)
    b = encode_message(Kind.RESPONSE, {"id": 2}, [os.urandom(2000)], SMALL)
    ping = encode_frame(Kind.PING, {"n": 1})
    order = [a[0], b[0], a[1], ping, b[1], a[2], b[2], a[3]]
    decoder = FrameDecoder(SMALL)
    seen = []
    for frame in order:
        decoder.feed(_joined(frame))
        while (out := decoder.next_frame()) is not None:
            seen.append((out.kind, out.header.get("id")))
    assert seen == [(Kind.PING, None), (Kind.RESPONSE, 2), (Kind.REQUEST, 1)]


def test_another_frame_with_an_open_id_abandons_the_message():
    frames = encode_message(Kind.REQUEST, {"id": 4}, [os.urandom(3000)], SMALL)
    cancel = encode_frame(Kind.CANCEL, {"id": 4})
    decoder = FrameDecoder(SMALL)
    decoder.feed(_stream(frames[:2]))
    assert decoder.assembling_bytes == 3000
    decoder.feed(_joined(cancel))
    assert decoder.next_frame().kind is Kind.CANCEL
    assert decoder.assembling_bytes == 0
    with pytest.raises(MalformedFrame):
        decoder.feed(_joined(frames[2]))  # its chunks are now a protocol error


def test_discarded_message_is_read_off_and_dropped():
    frames = encode_message(Kind.RESPONSE, {"id": 5}, [os.urandom(2500)], SMALL)
    decoder = FrameDecoder(SMALL)
    decoder.feed(_stream(frames[:2]))
    decoder.discard(5)
    assert decoder.assembling_bytes == 0
    decoder.feed(_stream(frames[2:]) + _joined(encode_frame(Kind.PONG, {})))
    assert decoder.next_frame().kind is Kind.PONG
    assert decoder.next_frame() is None


def test_encode_refuses_what_the_receiver_would_refuse():
    with pytest.raises(LocalProtocolError):
        encode_frame(Kind.PING, {}, [b"x"])  # control frames carry no payload
    with pytest.raises(LocalProtocolError):
        encode_frame(Kind.REQUEST, {"id": 1}, [b"x" * 2000], Limits(max_chunk_bytes=100, max_frame_bytes=1000,
                     max_header_bytes=100, max_buffers_per_frame=10))  # fmt: skip
    with pytest.raises(LocalProtocolError):
        encode_message(Kind.REQUEST, {"method": "no id"}, [b"x" * 5000], SMALL)
    with pytest.raises(LocalProtocolError):
        encode_message(Kind.REQUEST, {"id": 1}, [b"x" * 55_000], SMALL)  # past max_buffer_bytes
    with pytest.raises(LocalProtocolError):
        encode_frame(Kind.REQUEST, {"f": object()})


def test_limits_that_cannot_hold_a_chunk_are_refused():
    with pytest.raises(ValueError):
        Limits(max_chunk_bytes=4 * MiB)
    with pytest.raises(MalformedFrame):
        Limits.from_dict({"max_frame_bytes": "big"})


def test_meet_takes_the_strictest_of_both_sides():
    met = Limits().meet(Limits(max_chunk_bytes=1000, max_header_bytes=128 * 1024, max_frame_bytes=4 * MiB))
    assert met.max_chunk_bytes == 1000 and met.max_header_bytes == Limits().max_header_bytes


# ----------------------------------------------------------------------------- attacks, one per limit


def test_bad_magic_is_refused():
    with pytest.raises(BadMagic):
        _decode_all(_raw_frame(magic=b"HTTP"))


def test_unknown_version_is_refused():
    with pytest.raises(UnsupportedVersion):
        _decode_all(_raw_frame(version=VERSION + 1))


def test_unknown_kind_and_flags_are_refused():
    with pytest.raises(MalformedFrame):
        _decode_all(_raw_frame(kind=200))
    with pytest.raises(MalformedFrame):
        _decode_all(_raw_frame(flags=0x8000))
    with pytest.raises(MalformedFrame):
        _decode_all(_raw_frame(kind=Kind.PING, flags=FLAG_CHUNKED, lengths=(5,)))


def test_announced_header_past_limit_is_refused_from_the_prelude():
    prelude = PRELUDE.pack(MAGIC, VERSION, Kind.REQUEST, 0, 2**32 - 1, 0)
    decoder = FrameDecoder()
    with pytest.raises(LimitExceeded) as info:
        decoder.feed(prelude)
    assert info.value.what == "header length"


def test_announced_buffer_count_past_limit_is_refused_from_the_prelude():
    prelude = PRELUDE.pack(MAGIC, VERSION, Kind.REQUEST, 0, 1, 2**32 - 1)
    with pytest.raises(LimitExceeded) as info:
        FrameDecoder().feed(prelude)
    assert info.value.what == "buffer count"


#: Measured in a process of its own: tracemalloc counts every thread's allocations, and threads that
#: earlier tests of a session leave behind allocated 35-280 MB during this call in full fast runs.
BUFFER_PEAK = """
import struct, tracemalloc
from transport.errors import LimitExceeded
from transport.wire import MAGIC, PRELUDE, VERSION, FrameDecoder, Kind
head = PRELUDE.pack(MAGIC, VERSION, Kind.REQUEST, 0, 1, 1) + struct.pack("!Q", 2**40)
decoder = FrameDecoder()
tracemalloc.start()
try:
    decoder.feed(head)
except LimitExceeded as exc:
    print(tracemalloc.get_traced_memory()[1], exc.got, exc.what)
"""


@pytest.mark.slow
def test_announced_buffer_past_limit_is_refused_before_allocation():
    """A prelude and length table announcing a 2^40-byte buffer: refused with no payload sent,
    and the decoder allocated next to nothing."""
    done = subprocess.run([sys.executable, "-c", BUFFER_PEAK], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0 and done.stdout, done.stderr
    peak, got, what = done.stdout.strip().split(" ", 2)
    assert what == "buffer length" and int(got) == 2**40
    assert int(peak) < 64 * 1024


def test_inline_frame_past_frame_limit_is_refused_before_allocation():
    limits = Limits(max_buffer_bytes=10 * MiB)
    head = PRELUDE.pack(MAGIC, VERSION, Kind.REQUEST, 0, 1, 2) + struct.pack("!2Q", 2 * MiB, 2 * MiB)
    with pytest.raises(LimitExceeded) as info:
        FrameDecoder(limits).feed(head)
    assert info.value.what == "frame length"


def test_chunked_message_past_message_limit_is_refused():
    head = _raw_frame(flags=FLAG_CHUNKED, lengths=(SMALL.max_buffer_bytes, SMALL.max_buffer_bytes))
    with pytest.raises(LimitExceeded) as info:
        FrameDecoder(SMALL).feed(head)
    assert info.value.what == "message length"


def test_open_chunked_messages_past_inflight_limit_are_refused():
    """Two openers of 50 kB each fit 100 kB in flight; the third is refused before allocation."""
    decoder = FrameDecoder(SMALL)
    for msg_id in (1, 2):
        decoder.feed(_joined(encode_message(Kind.REQUEST, {"id": msg_id}, [b"x" * 50_000], SMALL)[0]))
    opener = encode_message(Kind.REQUEST, {"id": 3}, [b"x" * 1001], SMALL)[0]
    with pytest.raises(LimitExceeded) as info:
        decoder.feed(_joined(opener))
    assert info.value.what == "bytes of open chunked messages"


def test_chunk_larger_than_chunk_limit_is_refused():
    with pytest.raises(LimitExceeded):
        FrameDecoder(SMALL).feed(_raw_frame(kind=Kind.CHUNK, lengths=(SMALL.max_chunk_bytes + 1,)))


def test_chunk_for_no_open_message_is_refused():
    header = msgpack.packb({"id": 1, "b": 0, "o": 0})
    with pytest.raises(MalformedFrame):
        FrameDecoder(SMALL).feed(_raw_frame(kind=Kind.CHUNK, header=header, lengths=(10,)))


@pytest.mark.parametrize("where", [{"b": 0, "o": 1000}, {"b": 1, "o": 0}, {"b": 0, "o": "0"}, {"b": None}])
def test_chunk_out_of_order_is_refused(where):
    frames = encode_message(Kind.REQUEST, {"id": 1}, [b"x" * 3000], SMALL)
    header = msgpack.packb({"id": 1, **where})
    decoder = FrameDecoder(SMALL)
    decoder.feed(_joined(frames[0]))
    with pytest.raises(MalformedFrame):
        decoder.feed(_raw_frame(kind=Kind.CHUNK, header=header, lengths=(1000,)))


def test_chunk_running_past_its_buffer_is_refused():
    frames = encode_message(Kind.REQUEST, {"id": 1}, [b"x" * 1500], SMALL)
    header = msgpack.packb({"id": 1, "b": 0, "o": 0})
    decoder = FrameDecoder(Limits(max_chunk_bytes=2000, max_frame_bytes=80_000))
    decoder.feed(_joined(frames[0]))
    with pytest.raises(MalformedFrame):
        decoder.feed(_raw_frame(kind=Kind.CHUNK, header=header, lengths=(2000,)))


@pytest.mark.parametrize(
    ("limit", "value"),
    [
        ("max_str_len", "s" * 200),
        ("max_bin_len", b"b" * 200),
        ("max_array_len", list(range(200))),
        ("max_map_len", {str(i): i for i in range(200)}),
    ],
)
def test_msgpack_sizes_in_header_past_limit_are_refused(limit, value):
    limits = Limits(**{limit: 100})
    with pytest.raises(MalformedFrame):
        _decode_all(_joined(encode_frame(Kind.REQUEST, {"v": value})), limits)


@pytest.mark.parametrize(
    "header",
    [
        b"\xc1",  # never-used msgpack byte
        msgpack.packb([1, 2]),  # not a map
        msgpack.packb({"a": 1}) + b"\x00",  # trailing bytes
        msgpack.packb({1: 2}),  # non-string key
        msgpack.packb({"x": msgpack.ExtType(1, b"abcd")}),  # extension types are not ours
        b"\xa3\xff\xfe\xfd",  # str that is not UTF-8
        b"\x81\xa1",  # truncated
    ],
)
def test_malformed_headers_are_refused(header):
    with pytest.raises(MalformedFrame):
        _decode_all(_raw_frame(header=header))


def test_decoder_stays_failed_after_an_error():
    decoder = FrameDecoder()
    with pytest.raises(BadMagic):
        decoder.feed(b"GET / HTTP/1.1\r\n")
    with pytest.raises(BadMagic):
        decoder.feed(_joined(encode_frame(Kind.PING, {})))
    with pytest.raises(BadMagic):
        decoder.next_frame()


def test_every_refusal_is_a_protocol_error():
    assert issubclass(LimitExceeded, ProtocolError) and issubclass(MalformedFrame, ProtocolError)


_leaves = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
                    st.text(max_size=20), st.binary(max_size=20))  # fmt: skip
_values = st.recursive(_leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)  # fmt: skip


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    st.sampled_from([Kind.REQUEST, Kind.RESPONSE, Kind.STREAM_ITEM]),
    st.dictionaries(st.text(max_size=8), _values, max_size=6),
    st.lists(st.binary(max_size=2500), max_size=5),
    st.integers(1, 5000),
)
def test_any_message_round_trips_whatever_the_split(kind, header, buffers, step):
    header = {**header, "id": 11}
    frames = encode_message(kind, header, buffers, SMALL)
    (message,), decoder = _decode_all(_stream(frames), SMALL, step=step)
    assert message.kind is kind and message.header == header
    assert [bytes(b) for b in message.buffers] == buffers
    assert decoder.assembling_bytes == 0


def test_oversized_header_is_refused_when_encoding():
    with pytest.raises(LocalProtocolError):
        encode_frame(Kind.PING, {"pad": "x" * 10_000}, limits=Limits(max_header_bytes=1024))
