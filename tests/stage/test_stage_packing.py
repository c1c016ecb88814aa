"""All-reduce pieces on the wire (swarmd/stage/packing.py): fp16 scaled by a power of two per
piece, fp32 for a piece with inf or nan; what a receiver decodes is what the sender keeps."""

from __future__ import annotations

import pytest
import torch

from swarmd.stage.packing import (FP32_SAFE, MAX_EXPONENT, MIN_EXPONENT, message_codec, pack, pack_part, round_trip,
                                  unpack)
from transport.codecs import decode_tensor, encode_tensor
from transport.errors import RpcError

FP16_EPS = 2.0**-11  # fp16's relative rounding error (11 significant bits, round to nearest)


def received(piece, codec):
    """The piece through the transport's codec, as a mate's handler sees it, then unpacked."""
    meta, buffers = encode_tensor(piece.tensor, message_codec(codec))
    return unpack(decode_tensor(meta, [bytes(b) for b in buffers]), piece.exponent)


def spread(n, low, high, seed=0):
    """n values of random sign whose magnitudes span 10**low .. 10**high."""
    g = torch.Generator().manual_seed(seed)
    magnitudes = 10.0 ** (low + (high - low) * torch.rand(n, generator=g, dtype=torch.float64))
    return (magnitudes * torch.randn(n, generator=g, dtype=torch.float64).sign()).float()


@pytest.mark.parametrize("codec", ["fp16", "fp16+lz4"])
@pytest.mark.parametrize("low, high", [(-8, 2), (3, 9), (-38, -30), (30, 38)])
def test_every_receiver_decodes_what_the_sender_keeps(codec, low, high):
    """Steps: parts whose magnitudes span ten decades, from near fp32's smallest normal to near its
    largest, cut in pieces of 1000 and round-tripped as an owner does, then each piece through the
    transport. Expected: the receiver's values equal the owner's bit for bit (I2), every element
    is within fp16's rounding of its exact value, relative to itself, or for elements 2^28 and
    more below their piece's largest, relative to that largest."""
    part = spread(4000, low, high)
    kept, pieces = round_trip(part, 1000, codec)
    got = torch.cat([received(p, codec) for p in pieces])
    assert torch.equal(got, kept)
    for piece in pieces:
        assert piece.tensor.dtype == torch.float16 and MIN_EXPONENT <= piece.exponent <= MAX_EXPONENT
        exact = part[piece.offset: piece.offset + piece.tensor.numel()].double()
        error = (kept[piece.offset: piece.offset + piece.tensor.numel()].double() - exact).abs()
        bound = exact.abs() * FP16_EPS + exact.abs().max() * 2.0**-38
        assert bool((error <= bound).all()), (error / bound).max()


def test_values_past_fp16s_range_are_scaled_not_clamped():
    """Steps: a gradient sum with elements of 1e6 and -3e5 (past fp16's 65504) packed under fp16,
    and the same through a plain fp16 cast (the transport's codec, what the all-reduce sent before
    pieces were scaled). Expected: the plain cast clamps them to 65504 silently; the packed piece
    keeps them within fp16's rounding, finite (1e-3, 2^30 below the largest, within 2^-38 of it)."""
    part = torch.tensor([1e6, -3e5, 1.0, 1e-3])
    meta, buffers = encode_tensor(part, "fp16")
    assert decode_tensor(meta, [bytes(b) for b in buffers])[0].item() == 65504.0  # the silent clamp
    kept, (piece,) = round_trip(part, 1000, "fp16")
    assert torch.isfinite(kept).all()
    assert ((kept - part).abs() <= part.abs() * FP16_EPS + part.abs().max() * 2.0**-38).all(), kept
    assert kept[0].item() != 65504.0


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), 2.0**127])
def test_a_piece_holding_non_finite_values_travels_in_fp32_unchanged(bad):
    """Steps: a piece holding inf, -inf, nan or 2^127 (fp16 rounding could carry it past fp32's
    largest) packed under fp16. Expected: it travels as the fp32 piece it is (no exponent): the
    members then reduce the same non-finite sum and skip the update alike, as without the codec,
    where a plain fp16 cast would have turned inf into a finite 65504. The other pieces of the
    part are scaled fp16 as usual."""
    part = torch.tensor([1.0, bad, 3.0, 4.0])
    kept, (first, second) = round_trip(part, 2, "fp16")
    assert first.exponent is None and first.tensor.dtype == torch.float32
    assert second.exponent is not None and second.tensor.dtype == torch.float16
    assert torch.allclose(kept, part, rtol=0, atol=0, equal_nan=True)
    assert torch.allclose(received(first, "fp16"), part[:2], rtol=0, atol=0, equal_nan=True)


def test_fp32_codecs_send_the_part_as_it_is():
    part = torch.randn(10)
    for codec in ("none", "lz4"):
        kept, pieces = round_trip(part, 4, codec)
        assert kept is part and [p.offset for p in pieces] == [0, 4, 8]
        assert all(p.exponent is None and p.tensor.dtype == torch.float32 for p in pieces)


def test_an_empty_part_is_one_empty_piece_and_zeros_need_no_scale():
    """The first message of a part carries the sender's ids: an empty part still sends one."""
    (piece,) = pack_part(torch.zeros(0), 8, "fp16")
    assert piece.offset == 0 and piece.tensor.numel() == 0 and piece.exponent is None
    zeros = pack(0, torch.zeros(5), "fp16")
    assert zeros.exponent == 0 and torch.equal(unpack(zeros.tensor, zeros.exponent), torch.zeros(5))


@pytest.mark.parametrize("tensor, exponent", [
    (torch.zeros(3, dtype=torch.float16), None),  # fp16 without its scale
    (torch.zeros(3), 4),  # an exponent on fp32
    (torch.zeros(3, dtype=torch.float16), MAX_EXPONENT + 1),
    (torch.zeros(3, dtype=torch.float16), MIN_EXPONENT - 1),
    (torch.zeros(3, dtype=torch.float16), 2.0),
    (torch.zeros(3, dtype=torch.float16), True),
])
def test_a_malformed_piece_is_bad_input(tensor, exponent):
    """A mate's piece is input: an exponent out of range (2.0**-10**6 is 0, 2.0**10**6 raises) or a
    dtype that does not match it is refused before anything is placed."""
    with pytest.raises(RpcError) as info:
        unpack(tensor, exponent)
    assert info.value.code == "bad_input"


def test_the_exponent_bounds_keep_unpacking_exact():
    """At MAX_EXPONENT fp16's least step unpacks to 2^-149 (fp32's least); at MIN_EXPONENT fp16's
    largest below 2^15 unpacks below FP32_SAFE."""
    least = torch.tensor([2.0**-24], dtype=torch.float16)
    assert unpack(least, MAX_EXPONENT).item() == 2.0**-149
    top = torch.tensor([32752.0], dtype=torch.float16)
    assert unpack(top, MIN_EXPONENT).item() < FP32_SAFE
