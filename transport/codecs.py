"""Tensors as (metadata, buffers): small enough for a slow link, exact where it must be, never trusted.

Activations and gradients dominate SWARM traffic over links slower than 200 Mb/s, so the default
`fp16+lz4` halves fp32 payloads (clamped so large values stay finite) and compresses them only when a
sample shows it pays (Gaussian fp16 does not, sparse ReLU outputs do). `int8` is blockwise absmax
quantization, as the SWARM paper used for its largest runs. Integer, bool and complex tensors are
never quantized. Encoding hands out views of the tensor's memory, not copies. Decoding treats the
metadata as hostile: dtype from an allow-list, shape, element count and byte sizes are all checked
against `Limits` and each other before anything is allocated or decompressed.

Tensor bytes travel in the host's order, little-endian on every platform we run on.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import lz4.block
import numpy
import torch

from transport.errors import CodecError, LimitExceeded, LocalProtocolError
from transport.limits import LZ4_MAX_RATIO, KiB, Limits

if sys.byteorder != "little":  # the wire carries raw little-endian tensor bytes
    raise ImportError("transport.codecs supports little-endian hosts only")

from transport.codec_names import CODECS, DEFAULT_CODEC

LZ4_MIN_GAIN = 0.10
"""Compress only if it saves at least this fraction of the bytes: below it, lz4 costs more CPU on
both ends than the link time it saves on anything faster than ~20 Mb/s."""
LZ4_SAMPLE_BYTES = 64 * KiB
"""How much is test-compressed first (in 8 slices spread over the payload) to decide quickly."""
_LZ4_SAMPLE_SLICES = 8
_LZ4_MAX_INPUT = 0x7E000000  # LZ4_MAX_INPUT_SIZE: larger inputs go uncompressed
INT8_BLOCK = 64
"""Elements per absmax block: one outlier spoils only its 64 neighbours; the fp32 scale costs 6%."""

FP16_MAX = 65504.0
_CPU = torch.device("cpu")
_TINY_ABSMAX = 128 * torch.finfo(torch.float32).tiny
_INF_STANDIN = 2.0**126  # int8 stands this in for ±inf: 127 * (2^126 / 127) stays finite in fp32

_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
    "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
)  # fmt: skip
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _DTYPE_NAMES if hasattr(torch, name)
}
"""The dtypes a peer may announce; anything else is refused before allocation."""
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_TO_FP16 = frozenset({torch.float32, torch.float64})  # fp16 would not shrink the others
_TO_INT8 = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})


# ------------------------------------------------------------------------------------ encoding


def encode_tensor(
    tensor: torch.Tensor,
    codec: str = DEFAULT_CODEC,
    *,
    lz4_min_gain: float = LZ4_MIN_GAIN,
    lz4_sample_bytes: int = LZ4_SAMPLE_BYTES,
    lz4_max_ratio: int = LZ4_MAX_RATIO,
    int8_block: int = INT8_BLOCK,
) -> tuple[dict, list[memoryview]]:
    """Metadata (msgpack-able) and payload views; `meta["codec"]` is what was actually applied.

    A codec that cannot help a dtype falls back: fp16 and int8 leave non-float tensors as they are
    (`fp16+lz4` becomes `lz4`), and lz4 is dropped when it does not save `lz4_min_gain`, or when it
    shrinks the payload more than `lz4_max_ratio` times (receivers refuse that as a bomb). On CUDA the
    cast and quantization run on the GPU and only the smaller result is copied to the host.
    """
    if codec not in CODECS:
        raise LocalProtocolError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")
    dtype = tensor.dtype
    if dtype not in _NAMES:
        raise LocalProtocolError(f"dtype {dtype} cannot be sent")
    tensor = tensor.detach()
    meta: dict = {"dtype": _NAMES[dtype], "shape": list(tensor.shape)}
    if codec == "int8" and dtype in _TO_INT8:
        if not isinstance(int8_block, int) or int8_block < 1:
            raise LocalProtocolError(f"int8 block must be a positive int, got {int8_block!r}")
        codes, scales = _quantize_int8(tensor, int8_block)
        meta.update(codec="int8", block=int8_block)
        return meta, [_bytes_view(codes), _bytes_view(scales)]
    cast = codec.startswith("fp16") and dtype in _TO_FP16
    if cast:
        tensor = _cast(tensor, torch.float16).clamp_(-FP16_MAX, FP16_MAX)
    payload = _bytes_view(tensor)
    compressed = _maybe_lz4(payload, lz4_min_gain, lz4_sample_bytes, lz4_max_ratio) if codec.endswith("lz4") else None
    if compressed is None:
        meta["codec"] = "fp16" if cast else "none"
        return meta, [payload]
    meta.update(codec="fp16+lz4" if cast else "lz4", raw=payload.nbytes)
    return meta, [memoryview(compressed)]


def _empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device = _CPU) -> torch.Tensor:
    """Uninitialised memory; on CPU allocated by numpy, which asks for huge pages on large blocks and
    skips the zero-fill: for a 64 MB tensor that costs more than the fp32<->fp16 conversion itself."""
    count = math.prod(shape)
    if device.type != "cpu" or count == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    raw = numpy.empty(count * dtype.itemsize, dtype=numpy.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor.to(dtype)` on the tensor's own device (so a GPU shrinks it before the host copy)."""
    if tensor.dtype is dtype:
        return tensor
    if tensor.device.type != "cpu":
        return tensor.to(dtype)
    return _empty(tensor.shape, dtype).copy_(tensor)


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without copying them (a copy only if it is on a device or strided)."""
    flat = tensor.to("cpu").resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())  # the array keeps `flat` (and its storage) alive


def _maybe_lz4(payload: memoryview, min_gain: float, sample_bytes: int, max_ratio: int) -> bytes | None:
    size = payload.nbytes
    if size == 0 or size > _LZ4_MAX_INPUT:
        return None
    budget = size * (1.0 - min_gain)
    if size > sample_bytes:
        piece = max(1, sample_bytes // _LZ4_SAMPLE_SLICES)
        stride = size // _LZ4_SAMPLE_SLICES
        sample = b"".join(payload[i * stride : i * stride + piece] for i in range(_LZ4_SAMPLE_SLICES))
        if len(lz4.block.compress(sample, store_size=False)) > len(sample) * (1.0 - min_gain):
            return None
    compressed = lz4.block.compress(payload, store_size=False)
    # Past the ratio a receiver refuses the payload as a bomb; what compresses that well is nearly
    # all zeros, and goes raw.
    return compressed if len(compressed) <= budget and len(compressed) * max_ratio >= size else None


def _quantize_int8(tensor: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of `block` elements: codes = round(x / s) in [-127, 127], s = absmax / 127 (fp32)."""
    flat = _cast(tensor.reshape(-1), torch.float32)
    scales, codes = _quantize_blocks(flat, block)
    if not bool(torch.isfinite(scales).all()):  # rare: pay for a cleaned copy only then
        # NaN -> 0 and ±inf -> ±2^126, so one bad value cannot turn its whole block into NaN.
        cleaned = torch.nan_to_num(flat, nan=0.0, posinf=_INF_STANDIN, neginf=-_INF_STANDIN)
        scales, codes = _quantize_blocks(cleaned, block)
    return codes, scales


def _quantize_blocks(flat: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    count = flat.numel()
    full = count // block * block
    scales = _empty([-(-count // block)], torch.float32, flat.device)
    codes = _empty([count], torch.int8, flat.device)
    scaled = _empty([count], torch.float32, flat.device)
    for start, end, rows in ((0, full, full // block), (full, count, 1)):
        if end > start:
            values = flat[start:end].view(rows, -1)
            lo, hi = torch.aminmax(values, dim=1)
            absmax = torch.maximum(hi, -lo)  # (rows,)
            first = start // block
            torch.div(absmax, 127.0, out=scales[first : first + rows])
            # Below _TINY_ABSMAX, 127 / absmax would overflow: such blocks quantize to zero codes.
            inverse = torch.where(absmax > _TINY_ABSMAX, 127.0 / absmax, torch.zeros_like(absmax))
            rounded = torch.mul(values, inverse[:, None], out=scaled[start:end].view(rows, -1)).round_()
            codes[start:end].view(rows, -1).copy_(rounded)
    return scales, codes


# ------------------------------------------------------------------------------------ decoding


def buffer_count(meta: dict) -> int:
    """How many payload buffers a tensor with this metadata takes (int8 has its scales too)."""
    codec = meta.get("codec") if isinstance(meta, dict) else None
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}")
    return 2 if codec == "int8" else 1


def check_message_budget(metas: list, buffers: list, limits: Limits = Limits()) -> None:
    """Refuse a message whose tensors announce more than `max_decoded_message_bytes` in all, or an
    lz4 payload claiming more than `max_lz4_ratio` times its own size, before any is decoded.

    Each tensor is bounded on its own by decode_tensor; this is the bound on their sum, checked
    first because a message is decoded tensor by tensor and memory would be spent before the last
    one's lie showed. Only metadata and buffer lengths are read; decode_tensor re-checks the rest."""
    total, start = 0, 0
    for meta in metas:
        if not isinstance(meta, dict):
            raise CodecError(f"tensor metadata must be a map, got {type(meta).__name__}")
        dtype, _, numel = _check_meta(meta, limits)
        total += numel * dtype.itemsize
        if total > limits.max_decoded_message_bytes:
            raise LimitExceeded("decoded bytes of one message", total, limits.max_decoded_message_bytes)
        raw = meta.get("raw")
        if meta["codec"].endswith("lz4") and type(raw) is int and start < len(buffers):
            packed = _readable(buffers[start]).nbytes
            if raw > packed * limits.max_lz4_ratio:
                raise LimitExceeded(f"lz4 expansion of {packed} bytes", raw, packed * limits.max_lz4_ratio)
        start += buffer_count(meta)


def decode_tensor(meta: dict, buffers: list, limits: Limits = Limits()) -> torch.Tensor:
    """The tensor `meta` announces, built from `buffers`; CodecError or LimitExceeded if they lie.

    The result is a CPU tensor that owns (or keeps alive) its memory and is writable. Writable
    buffers (as FrameDecoder delivers) are used in place for `none`; read-only ones are copied.
    """
    if not isinstance(meta, dict):
        raise CodecError(f"tensor metadata must be a map, got {type(meta).__name__}")
    dtype, shape, numel = _check_meta(meta, limits)
    codec = meta["codec"]
    expected_keys = {"dtype", "shape", "codec"} | {
        "fp16+lz4": {"raw"}, "lz4": {"raw"}, "int8": {"block"}
    }.get(codec, set())  # fmt: skip
    if set(meta) != expected_keys:
        raise CodecError(f"{codec} metadata has keys {sorted(meta)}, expected {sorted(expected_keys)}")
    if not isinstance(buffers, (list, tuple)) or len(buffers) != buffer_count(meta):
        raise CodecError(f"{codec} takes {buffer_count(meta)} buffers")
    views = [_readable(b) for b in buffers]
    if codec == "int8":
        return _decode_int8(meta, views, dtype, shape, numel, limits)
    wire_dtype = dtype
    if codec.startswith("fp16"):
        if dtype not in _TO_FP16:
            raise CodecError(f"fp16 encoding of {meta['dtype']} is not something we send")
        wire_dtype = torch.float16
    wire_bytes = numel * wire_dtype.itemsize
    payload = views[0]
    if codec.endswith("lz4"):
        payload = _decompress(meta["raw"], wire_bytes, payload, limits)
    elif payload.nbytes != wire_bytes:
        raise CodecError(f"{shape} {meta['dtype']} needs {wire_bytes} bytes, got {payload.nbytes}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    payload = _writable(payload)
    if wire_dtype is torch.bool and int(torch.frombuffer(payload, dtype=torch.uint8).max()) > 1:
        raise CodecError("bool payload holds bytes other than 0 and 1")
    return _cast(torch.frombuffer(payload, dtype=wire_dtype).view(shape), dtype)


def _check_meta(meta: dict, limits: Limits) -> tuple[torch.dtype, list[int], int]:
    dtype = DTYPES.get(meta.get("dtype")) if isinstance(meta.get("dtype"), str) else None
    if dtype is None:
        raise CodecError(f"dtype {meta.get('dtype')!r} is not one we accept")
    if meta.get("codec") not in CODECS:
        raise CodecError(f"unknown codec {meta.get('codec')!r}")
    shape = meta.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CodecError(f"shape must be a list of non-negative ints, got {shape!r}")
    if len(shape) > limits.max_tensor_dims:
        raise LimitExceeded("tensor dimensions", len(shape), limits.max_tensor_dims)
    numel = 1
    for d in shape:
        if d > limits.max_tensor_elements:
            raise LimitExceeded("tensor dimension", d, limits.max_tensor_elements)
        numel *= d
    if numel > limits.max_tensor_elements:
        raise LimitExceeded("tensor elements", numel, limits.max_tensor_elements)
    return dtype, shape, numel


def _readable(buffer: object) -> memoryview:
    try:
        view = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError:
        raise CodecError(f"a payload buffer must be bytes-like, got {type(buffer).__name__}") from None
    if not view.c_contiguous:
        raise CodecError("payload buffers must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _decompress(raw: object, expected: int, payload: memoryview, limits: Limits) -> memoryview:
    """Inflate to exactly `expected` bytes, never more than the limit, whatever the block says."""
    if type(raw) is not int or raw != expected:
        raise CodecError(f"lz4 payload announces {raw!r} raw bytes, the shape needs {expected}")
    if raw > limits.max_decompressed_bytes:
        raise LimitExceeded("decompressed bytes", raw, limits.max_decompressed_bytes)
    if raw == 0 or payload.nbytes > raw + raw // 255 + 16:  # LZ4_compressBound: nobody sends more
        raise CodecError(f"{payload.nbytes} lz4 bytes cannot be a compressed {raw}-byte payload")
    if raw > payload.nbytes * limits.max_lz4_ratio:
        raise LimitExceeded(f"lz4 expansion of {payload.nbytes} bytes", raw, payload.nbytes * limits.max_lz4_ratio)
    try:
        out = lz4.block.decompress(payload, uncompressed_size=raw, return_bytearray=True)
    except lz4.block.LZ4BlockError as exc:
        raise CodecError(f"lz4 payload is corrupt: {exc}") from None
    if len(out) != raw:
        raise CodecError(f"lz4 payload inflates to {len(out)} bytes, announced {raw}")
    return memoryview(out)


def _decode_int8(
    meta: dict, views: list[memoryview], dtype: torch.dtype, shape: list[int], numel: int, limits: Limits
) -> torch.Tensor:
    if dtype not in _TO_INT8:
        raise CodecError(f"int8 encoding of {meta['dtype']} is not something we send")
    block = meta["block"]
    if type(block) is not int or not 1 <= block <= limits.max_tensor_elements:
        raise CodecError(f"int8 block must be an int in [1, {limits.max_tensor_elements}], got {block!r}")
    blocks = -(-numel // block)
    codes_view, scales_view = views
    if codes_view.nbytes != numel or scales_view.nbytes != 4 * blocks:
        raise CodecError(
            f"int8 {shape} in blocks of {block} needs {numel} code bytes and {4 * blocks} scale bytes, "
            f"got {codes_view.nbytes} and {scales_view.nbytes}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    codes = torch.frombuffer(_writable(codes_view), dtype=torch.int8)
    scales = torch.frombuffer(_writable(scales_view), dtype=torch.float32)
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise CodecError("int8 scales must be finite and non-negative")
    values = _cast(codes, torch.float32)
    full = numel // block * block
    values[:full].view(-1, block).mul_(scales[: full // block, None])
    values[full:].mul_(scales[-1])  # the last, partial block (empty when numel divides evenly)
    return _cast(values, dtype).view(shape)


def _writable(view: memoryview) -> memoryview:
    """torch.frombuffer wants writable memory; copy only what a caller handed us read-only."""
    return memoryview(bytearray(view)) if view.readonly else view
