"""Tensor codecs: exact round-trips where promised, bounded error where not, and lz4 deciding well."""

from __future__ import annotations

import weakref

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from transport.codecs import CODECS, DTYPES, FP16_MAX, buffer_count, decode_tensor, encode_tensor
from transport.limits import Limits
from transport.wire import FrameDecoder, Kind, encode_message

torch.set_num_threads(1)

SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (4, 3, 2, 65)]
QUANTIZED = {"fp16", "fp16+lz4", "int8"}


def _sample(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 3).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**62)), min(info.max, 2**62)
    return torch.randint(low, high, shape, generator=gen, dtype=torch.int64).to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality, NaN included: compare the bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return torch.equal(as_bytes(a), as_bytes(b))


def _round_trip(tensor: torch.Tensor, codec: str, **options) -> tuple[dict, torch.Tensor]:
    meta, buffers = encode_tensor(tensor, codec, **options)
    assert len(buffers) == buffer_count(meta)
    return meta, decode_tensor(meta, [bytearray(b) for b in buffers], Limits())


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=str)
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_codec_dtype_and_shape_round_trips(dtype, codec, shape):
    tensor = _sample(dtype, shape)
    meta, out = _round_trip(tensor, codec)
    assert out.dtype == dtype and out.shape == tensor.shape
    lossy = meta["codec"] in QUANTIZED
    assert lossy == (codec in QUANTIZED and meta["codec"] != "lz4" and meta["codec"] != "none")
    if not lossy:
        assert _same_bits(out, tensor)
    elif tensor.numel():
        assert torch.allclose(out.double(), tensor.double(), rtol=2e-2, atol=0.1)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64])
@pytest.mark.parametrize("codec", ["fp16", "int8", "fp16+lz4"])
def test_integer_bool_and_complex_tensors_are_never_quantized(dtype, codec):
    tensor = _sample(dtype, (64, 64))
    meta, out = _round_trip(tensor, codec)
    assert meta["codec"] in {"none", "lz4"}
    assert _same_bits(out, tensor)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_not_cast_to_fp16(dtype):
    """fp16 would not shrink a 2-byte dtype (and bf16 -> fp16 loses range), so it is sent as is."""
    tensor = _sample(dtype, (100,))
    meta, out = _round_trip(tensor, "fp16")
    assert meta["codec"] == "none" and _same_bits(out, tensor)


@pytest.mark.parametrize("codec", CODECS)
def test_non_contiguous_tensors_round_trip(codec):
    base = _sample(torch.float32, (8, 12), seed=3)
    for tensor in (base.t(), base[:, ::3], base[2:5, 1:7], base.unsqueeze(0).expand(3, 8, 12), base[2:5]):
        assert not tensor.is_contiguous() or tensor.storage_offset()
        _, out = _round_trip(tensor, codec)
        assert out.is_contiguous() and out.shape == tensor.shape
        tolerance = 0 if codec in {"none", "lz4"} else 0.05
        assert torch.allclose(out, tensor, atol=tolerance, rtol=0)


def test_conjugate_and_negative_views_round_trip_exactly():
    tensor = _sample(torch.complex64, (5, 3)).conj()
    _, out = _round_trip(tensor, "none")
    assert torch.equal(out, tensor)


def test_encode_shares_memory_with_a_contiguous_tensor():
    tensor = torch.arange(1000, dtype=torch.float32)
    _, (view,) = encode_tensor(tensor, "none")
    tensor[0] = 42.0
    assert torch.frombuffer(view, dtype=torch.float32)[0] == 42.0


def test_decoded_tensor_is_writable_and_keeps_its_memory():
    """The `none` result aliases the received buffer: that buffer must live exactly as long as the
    tensor (watched through a weak reference to the numpy array the decoder would allocate)."""
    meta, (payload,) = encode_tensor(torch.arange(10, dtype=torch.int64), "none")
    received = numpy.frombuffer(bytes(payload), dtype=numpy.uint8).copy()
    alive = weakref.ref(received)
    out = decode_tensor(meta, [memoryview(received)])
    del received, payload
    assert alive() is not None
    out += 1
    assert out.tolist() == list(range(1, 11))
    del out  # no reference cycle holds it: freed here, without a collection (a full one costs ~1 s on a big heap)
    assert alive() is None


def test_read_only_buffers_are_copied_so_the_result_is_writable():
    meta, buffers = encode_tensor(torch.ones(4), "none")
    out = decode_tensor(meta, [bytes(b) for b in buffers])
    out.mul_(2)
    assert out.tolist() == [2.0] * 4


def test_fp16_clamps_large_values_instead_of_making_inf():
    tensor = torch.tensor([1e6, -1e6, 7e4, 65504.0, float("inf"), -float("inf"), 1.0])
    meta, out = _round_trip(tensor, "fp16")
    assert meta["codec"] == "fp16"
    assert out.tolist() == [FP16_MAX, -FP16_MAX, FP16_MAX, FP16_MAX, FP16_MAX, -FP16_MAX, 1.0]


def test_fp16_keeps_nan_as_nan():
    _, out = _round_trip(torch.tensor([float("nan"), 2.0]), "fp16")
    assert out[0].isnan() and out[1] == 2.0


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.floats(-FP16_MAX, FP16_MAX, width=32), min_size=1, max_size=300))
def test_fp16_relative_error_is_within_half_precision(values):
    tensor = torch.tensor(values, dtype=torch.float32)
    _, out = _round_trip(tensor, "fp16")
    # fp16 keeps 11 significant bits (relative error <= 2^-11) down to 2^-14; below, absolute 2^-25.
    assert torch.all((out - tensor).abs() <= tensor.abs() * 2**-11 + 2**-24)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.lists(st.floats(-(2.0**100), 2.0**100, width=32), min_size=1, max_size=700),
    st.sampled_from([1, 7, 64, 2048]),
)
def test_int8_error_is_within_half_a_step_of_its_block(values, block):
    tensor = torch.tensor(values, dtype=torch.float32)
    meta, out = _round_trip(tensor, "int8", int8_block=block)
    assert meta["block"] == block
    padded = torch.nn.functional.pad(tensor, (0, -len(values) % block)).view(-1, block)
    absmax = padded.abs().amax(dim=1).repeat_interleave(block)[: len(values)]
    # round-to-nearest: half a step of absmax/127, plus fp32 rounding in the scale arithmetic
    assert torch.all((out - tensor).abs() <= absmax / 254 * (1 + 1e-5) + 1e-30)


def test_int8_block_outlier_only_spoils_its_own_block():
    tensor = torch.full((256,), 0.01)
    tensor[3] = 1000.0
    _, out = _round_trip(tensor, "int8", int8_block=64)
    assert torch.allclose(out[64:], tensor[64:], rtol=0.01)
    assert out[4] == 0.0  # swamped by the outlier in the first block


def test_int8_survives_non_finite_values():
    tensor = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0] + [0.5] * 60)
    meta, out = _round_trip(tensor, "int8", int8_block=4)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[4:], tensor[4:], rtol=0.01)


def test_int8_quantizes_on_the_tensor_dtype_and_returns_it():
    tensor = _sample(torch.bfloat16, (3, 100))
    meta, out = _round_trip(tensor, "int8")
    assert meta["codec"] == "int8" and out.dtype == torch.bfloat16


def test_lz4_compresses_sparse_activations():
    gen = torch.Generator().manual_seed(1)
    sparse = torch.relu(torch.randn(1 << 18, generator=gen)) * (torch.rand(1 << 18, generator=gen) < 0.1)
    meta, buffers = encode_tensor(sparse, "fp16+lz4")
    assert meta["codec"] == "fp16+lz4" and meta["raw"] == sparse.numel() * 2
    assert buffers[0].nbytes < 0.5 * meta["raw"]
    out = decode_tensor(meta, [bytearray(b) for b in buffers])
    assert torch.equal(out, sparse.half().float())


def test_lz4_declines_gaussian_data():
    gen = torch.Generator().manual_seed(2)
    dense = torch.randn(1 << 18, generator=gen)
    for codec, expected in (("fp16+lz4", "fp16"), ("lz4", "none")):
        meta, buffers = encode_tensor(dense, codec)
        assert meta["codec"] == expected and "raw" not in meta
        assert buffers[0].nbytes == dense.numel() * (2 if expected == "fp16" else 4)


def test_lz4_threshold_is_configurable():
    """Small int32s compress to ~36% (a 64% gain): taken at a 10% minimum gain, declined at 90%."""
    gen = torch.Generator().manual_seed(3)
    ints = torch.randint(0, 16, (1 << 16,), generator=gen, dtype=torch.int32)
    assert encode_tensor(ints, "lz4", lz4_min_gain=0.1)[0]["codec"] == "lz4"
    assert encode_tensor(ints, "lz4", lz4_min_gain=0.9)[0]["codec"] == "none"


def test_lz4_sample_decides_before_compressing_the_whole():
    """8 slices of 512 bytes at a 32 KiB stride are the sample of a 256 KiB payload with a 4 KiB
    sample. Random slices in zeros: the sample declines although the whole would compress. Zero
    slices in random bytes: the sample accepts, and the whole, missing the gain, is sent raw."""
    gen = torch.Generator().manual_seed(4)
    size, stride, piece = 1 << 18, (1 << 18) // 8, 512
    in_sample = torch.zeros(size, dtype=torch.bool)
    for i in range(8):
        in_sample[i * stride : i * stride + piece] = True
    noise = torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8)
    sampled_noise = torch.where(in_sample, noise, 0).to(torch.uint8)
    assert encode_tensor(sampled_noise, "lz4", lz4_sample_bytes=4096)[0]["codec"] == "none"
    assert encode_tensor(sampled_noise, "lz4", lz4_sample_bytes=size, lz4_max_ratio=255)[0]["codec"] == "lz4"
    sampled_zeros = torch.where(in_sample, 0, noise).to(torch.uint8)
    assert encode_tensor(sampled_zeros, "lz4", lz4_sample_bytes=4096)[0]["codec"] == "none"


def test_tensors_survive_the_wire_chunked():
    """Encode, frame as a chunked message, decode frames, decode tensors: the whole path on bytes."""
    limits = Limits(max_chunk_bytes=4096, max_frame_bytes=80_000)
    tensors = [_sample(torch.float32, (64, 33), seed=5), _sample(torch.int64, (10,)), torch.zeros(3, 0)]
    metas, buffers = [], []
    for tensor in tensors:
        meta, bufs = encode_tensor(tensor, "none")
        metas.append(meta)
        buffers.extend(bufs)
    frames = encode_message(Kind.REQUEST, {"id": 3, "tensors": metas}, buffers, limits)
    decoder = FrameDecoder(limits)
    for frame in frames:
        decoder.feed(b"".join(bytes(p) for p in frame))
    message = decoder.next_frame()
    out, at = [], 0
    for meta in message.header["tensors"]:
        count = buffer_count(meta)
        out.append(decode_tensor(meta, message.buffers[at : at + count], limits))
        at += count
    assert all(_same_bits(a, b) for a, b in zip(out, tensors, strict=True))


class _OpLog(TorchDispatchMode):
    """Records each aten op with its tensor arguments' (device, dtype) and its target device/dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list, object, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [(a.device.type, a.dtype) for a in args if isinstance(a, torch.Tensor)]
        self.ops.append((str(func), tensors, kwargs.get("device"), kwargs.get("dtype")))
        return func(*args, **kwargs)


@pytest.mark.parametrize("codec", ["fp16", "fp16+lz4"])
def test_fp16_casts_on_the_device_before_copying_to_the_host(codec):
    """Stands in for a GPU with the meta device (no GPU here; the ops are the ones CUDA would run):
    1. encode a meta-device fp32 tensor, logging every aten op;
    2. the cast to fp16 and the clamp run on the device;
    3. the one copy to the host moves fp16 (half the bytes), never fp32.
    The copy out of a meta tensor then fails, which ends the experiment."""
    tensor = torch.randn(1000, device="meta")
    with _OpLog() as log, pytest.raises(NotImplementedError):
        encode_tensor(tensor, codec)
    copies = [op for op in log.ops if op[0] == "aten._to_copy.default"]
    assert copies[0][1] == [("meta", torch.float32)] and copies[0][3] == torch.float16
    assert ("aten.clamp_.default", [("meta", torch.float16)], None, None) in log.ops
    to_host = [op for op in copies if op[2] is not None and torch.device(op[2]).type == "cpu"]
    assert to_host and all(op[1] == [("meta", torch.float16)] for op in to_host)
