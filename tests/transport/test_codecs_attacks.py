"""decode_tensor against lying metadata: every lie is a CodecError or LimitExceeded, before allocation."""

from __future__ import annotations

import os
import subprocess
import sys

import lz4.block
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.codecs import decode_tensor, encode_tensor
from transport.errors import CodecError, LimitExceeded, LocalProtocolError, ProtocolError
from transport.limits import Limits

torch.set_num_threads(1)


def _good(codec: str = "none", tensor=None):
    tensor = torch.arange(64, dtype=torch.float32) if tensor is None else tensor
    meta, buffers = encode_tensor(tensor, codec)
    return meta, [bytearray(b) for b in buffers]


def test_unknown_dtype_is_refused():
    meta, buffers = _good()
    for dtype in ("float128", "object", "qint8", 5, None):
        with pytest.raises(CodecError):
            decode_tensor({**meta, "dtype": dtype}, buffers)


def test_unknown_codec_is_refused():
    meta, buffers = _good()
    with pytest.raises(CodecError):
        decode_tensor({**meta, "codec": "pickle"}, buffers)


@pytest.mark.parametrize("shape", [[64, -1], [8, 8.0], "64", [True, 64], None, [[64]]])
def test_malformed_shape_is_refused(shape):
    meta, buffers = _good()
    with pytest.raises(CodecError):
        decode_tensor({**meta, "shape": shape}, buffers)


def test_shape_that_does_not_match_the_bytes_is_refused():
    meta, buffers = _good()
    for shape in ([65], [63], [8, 9], []):
        with pytest.raises(CodecError):
            decode_tensor({**meta, "shape": shape}, buffers)


#: Run in a process of its own: tracemalloc counts every thread's allocations, and threads that
#: earlier tests of a session leave behind (executors finishing their work) allocate tens of MB.
HUGE_NUMEL = """
import tracemalloc
import torch
from transport.codecs import decode_tensor, encode_tensor
from transport.errors import LimitExceeded
meta, buffers = encode_tensor(torch.arange(64, dtype=torch.float32), "none")
buffers = [bytearray(b) for b in buffers]
tracemalloc.start()
try:
    decode_tensor({**meta, "shape": [2**20, 2**20]}, buffers)
except LimitExceeded as exc:
    print(tracemalloc.get_traced_memory()[1], exc.what)
"""


@pytest.mark.slow
def test_huge_numel_is_refused_before_allocation():
    """A shape of 2^20 x 2^20 float32 (4 TB) with a 256-byte payload: refused, nothing allocated."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", HUGE_NUMEL], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    peak, what = done.stdout.split(" ", 1)
    assert what.strip() == "tensor elements" and int(peak) < 1 << 20, done.stdout


def test_too_many_dimensions_are_refused():
    meta, buffers = _good()
    with pytest.raises(LimitExceeded):
        decode_tensor({**meta, "shape": [1] * 33 + [64]}, buffers)


def test_zero_dimension_does_not_hide_a_huge_one():
    meta, buffers = _good()
    with pytest.raises(LimitExceeded):
        decode_tensor({**meta, "shape": [0, 2**62]}, [bytearray()])


def test_extra_or_missing_metadata_keys_are_refused():
    meta, buffers = _good()
    with pytest.raises(CodecError):
        decode_tensor({**meta, "raw": 256}, buffers)
    with pytest.raises(CodecError):
        decode_tensor({"dtype": "float32", "codec": "none"}, buffers)


def test_wrong_number_of_buffers_is_refused():
    meta, buffers = _good()
    with pytest.raises(CodecError):
        decode_tensor(meta, buffers * 2)
    with pytest.raises(CodecError):
        decode_tensor(meta, [])


def test_non_buffer_payload_is_refused():
    meta, _ = _good()
    with pytest.raises(CodecError):
        decode_tensor(meta, [12345])


def test_bool_payload_with_other_bytes_is_refused():
    meta, _ = _good("none", torch.ones(8, dtype=torch.bool))
    with pytest.raises(CodecError):
        decode_tensor(meta, [bytearray(b"\x01\x00\x02\x00\x01\x01\x00\x00")])


def _sparse():
    """Compresses well, within the lz4 ratio senders keep to (all zeros would go raw)."""
    values = torch.zeros(4096, dtype=torch.float32)
    values[::16] = torch.arange(256, dtype=torch.float32)
    return values


def test_lz4_payload_that_inflates_to_more_than_announced_is_refused():
    meta, _ = _good("lz4", _sparse())
    bigger = lz4.block.compress(_sparse().numpy().tobytes() + b"more", store_size=False)
    with pytest.raises(CodecError):
        decode_tensor(meta, [bytearray(bigger)])


def test_lz4_payload_that_inflates_to_less_than_announced_is_refused():
    meta, _ = _good("lz4", _sparse())
    smaller = lz4.block.compress(_sparse().numpy().tobytes()[:-4], store_size=False)
    with pytest.raises(CodecError):
        decode_tensor(meta, [bytearray(smaller)])


def test_lz4_raw_size_that_disagrees_with_shape_is_refused():
    meta, buffers = _good("lz4", _sparse())
    with pytest.raises(CodecError):
        decode_tensor({**meta, "raw": meta["raw"] * 2}, buffers)
    with pytest.raises(CodecError):
        decode_tensor({**meta, "raw": str(meta["raw"])}, buffers)


def test_lz4_decompression_past_limit_is_refused_before_inflating():
    meta, buffers = _good("lz4", _sparse())
    with pytest.raises(LimitExceeded) as info:
        decode_tensor(meta, buffers, Limits(max_decompressed_bytes=1000))
    assert info.value.what == "decompressed bytes"


def test_lz4_payload_longer_than_any_compression_of_it_is_refused():
    meta, _ = _good("lz4", _sparse())
    with pytest.raises(CodecError):
        decode_tensor(meta, [bytearray(meta["raw"] * 2)])


def test_corrupt_lz4_payload_is_refused():
    meta, buffers = _good("lz4", _sparse())
    with pytest.raises(CodecError):
        decode_tensor(meta, [bytearray(b"\xff" * len(buffers[0]))])


def test_fp16_claimed_for_an_integer_dtype_is_refused():
    meta, buffers = _good("fp16")
    with pytest.raises(CodecError):
        decode_tensor({**meta, "dtype": "int16"}, buffers)


def test_int8_with_wrong_scale_count_or_block_is_refused():
    meta, (codes, scales) = _good("int8", torch.randn(200))
    with pytest.raises(CodecError):
        decode_tensor(meta, [codes, scales[:-4]])
    for block in (0, -1, 2**40, 1.5, None):
        with pytest.raises(CodecError):
            decode_tensor({**meta, "block": block}, [codes, scales])


def test_int8_with_non_finite_scales_is_refused():
    meta, (codes, scales) = _good("int8", torch.randn(200))
    bad = bytearray(scales)
    bad[0:4] = torch.tensor([float("nan")]).numpy().tobytes()
    with pytest.raises(CodecError):
        decode_tensor(meta, [codes, bad])


def test_int8_claimed_for_an_integer_dtype_is_refused():
    meta, buffers = _good("int8", torch.randn(64))
    with pytest.raises(CodecError):
        decode_tensor({**meta, "dtype": "int64"}, buffers)


def test_encode_refuses_unknown_codecs_and_dtypes():
    with pytest.raises(LocalProtocolError):
        encode_tensor(torch.ones(3), "zstd")
    with pytest.raises(LocalProtocolError):
        encode_tensor(torch.ones(3), "int8", int8_block=0)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    st.dictionaries(
        st.sampled_from(["dtype", "shape", "codec", "raw", "block", "x"]),
        st.one_of(
            st.sampled_from(["float32", "float16", "int8", "bool", "none", "fp16", "lz4", "fp16+lz4", "int8"]),
            st.integers(-(2**70), 2**70),
            st.lists(st.integers(-4, 2**40), max_size=5),
            st.none(),
            st.floats(),
        ),
    ),
    st.lists(st.binary(max_size=300), max_size=3),
)
def test_random_metadata_gives_only_protocol_errors(meta, buffers):
    try:
        out = decode_tensor(meta, [bytearray(b) for b in buffers], Limits(max_tensor_elements=10_000))
    except ProtocolError:
        return
    assert out.numel() <= 10_000
