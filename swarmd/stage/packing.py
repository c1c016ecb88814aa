"""How a piece of an all-reduce part travels: fp32 as it is, or fp16 scaled by a power of two.

A gradient sum's magnitude depends on the model, the loss and how many samples a member holds,
while fp16's range is fixed (largest finite 65504, normal down to 2^-14): a plain cast clamps the
large values and flushes the small ones, silently. So each piece (one message, at most
`allreduce_chunk_bytes`) is multiplied by 2**exponent, chosen so that its largest magnitude lands
in [2^14, 2^15), and only then rounded to fp16: nothing can overflow, and every element keeps
fp16's 11 significant bits down to about 2^-28 of the piece's largest (fewer below, zero below
about 2^-39).
The exponent travels with the piece. Scaling by a power of two is exact, so `unpack` gives the
receiver, and the sender, the very same fp32 values: an owner that keeps `unpack(pack(shard))`
steps on the bytes its mates decode, and every member applies one averaged gradient (I2).

A piece holding inf or nan travels in fp32, unchanged: every member then reduces the same
non-finite sum and skips the update alike (StageOptimizer's NonFiniteGradient, StageService's
`_skip_step`), exactly as without the codec. A cast would have clamped an inf to a finite 65504
and the step would have been taken on it. A piece whose largest magnitude is 2^127 or more also
travels in fp32: rounding it to 11 bits could carry it past fp32's range, into an inf.

Pure functions on tensors, no I/O: the round shell (sync.py) packs in its auxiliary thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from swarmd.stage.errors import bad_input

#: All-reduce codecs a stage accepts. fp16 halves the bytes of fp32; lz4 (lossless, on the bytes
#: that travel) is kept only where a sample shows it pays. int8 is not among them: quantizing a
#: sum to 8 bits without error feedback biases every step, and belongs to the compression work.
ALLREDUCE_CODECS = ("none", "lz4", "fp16", "fp16+lz4")
SCALED = frozenset({"fp16", "fp16+lz4"})
#: The exponent puts a piece's largest magnitude in [2^14, 2^15): below fp16's 65504 whatever the
#: rounding (the largest rounds at most to 2^15).
TOP_BINADE = 15
#: Largest exponent: unpacking multiplies fp16's least step (2^-24) by 2^-exponent, which must stay
#: an fp32 value (2^-149 and up) for unpacking to be exact. Pieces smaller than 2^-110 throughout
#: are then scaled less than fully, and keep fewer bits: they are far below any gradient that moves
#: a weight.
MAX_EXPONENT = 125
#: Smallest exponent: a piece's largest magnitude is below FP32_SAFE = 2^127, so 15 - 127.
MIN_EXPONENT = TOP_BINADE - 127
FP32_SAFE = 2.0**127


@dataclass(frozen=True)
class Piece:
    """One message's worth of a part: `offset` (elements into the part), the tensor that travels
    (fp16 when `exponent` is set, else fp32), and the power of two it was scaled by."""

    offset: int
    tensor: torch.Tensor
    exponent: int | None = None

    @property
    def wire_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def meta(self) -> dict:
        return {"offset": self.offset} if self.exponent is None else {"offset": self.offset, "exp": self.exponent}


def message_codec(codec: str) -> str:
    """The transport codec a packed piece is sent with: lossless, since any rounding is done here."""
    return "lz4" if codec.endswith("lz4") else "none"


def pack(offset: int, piece: torch.Tensor, codec: str) -> Piece:
    """`piece` (fp32) as it travels under the all-reduce `codec`."""
    if codec not in SCALED or piece.numel() == 0:
        return Piece(offset, piece)
    lo, hi = torch.aminmax(piece)
    largest = max(hi.item(), -lo.item())  # nan if any element is nan
    if not largest < FP32_SAFE:  # inf, nan, or too close to fp32's largest
        return Piece(offset, piece)
    exponent = 0 if largest == 0 else min(MAX_EXPONENT, TOP_BINADE - math.frexp(largest)[1])
    return Piece(offset, (piece * 2.0**exponent).to(torch.float16), exponent)


def pack_part(part: torch.Tensor, per: int, codec: str) -> list[Piece]:
    """A part cut into messages of at most `per` elements, each packed; an empty part is one
    empty piece (the first message of a part carries the sender's ids and samples)."""
    return [pack(offset, part[offset: offset + per], codec) for offset in range(0, max(part.numel(), 1), per)]


def unpack(tensor: torch.Tensor, exponent: object) -> torch.Tensor:
    """The fp32 values of a received piece; `bad_input` for a piece that is neither plain fp32 nor
    fp16 with an exponent in [MIN_EXPONENT, MAX_EXPONENT]."""
    if exponent is None:
        if tensor.dtype != torch.float32:
            raise bad_input(f"an all-reduce piece without an exponent must be float32, not {tensor.dtype}")
        return tensor
    if type(exponent) is not int or not MIN_EXPONENT <= exponent <= MAX_EXPONENT or tensor.dtype != torch.float16:
        raise bad_input(f"a scaled all-reduce piece is float16 with an exponent in [{MIN_EXPONENT}, "
                        f"{MAX_EXPONENT}], got {tensor.dtype} and {exponent!r}")
    return tensor.to(torch.float32).mul_(2.0**-exponent)


def round_trip(part: torch.Tensor, per: int, codec: str) -> tuple[torch.Tensor, list[Piece]]:
    """What a part's receivers will decode, and the pieces that carry it: an owner keeps the
    former as its own reduced shard."""
    pieces = pack_part(part, per, codec)
    if codec not in SCALED:
        return part, pieces
    return torch.cat([unpack(p.tensor, p.exponent) for p in pieces]), pieces
