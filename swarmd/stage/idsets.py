"""Microbatch id sets on the wire as sorted, disjoint [start, end) ranges.

A step's ids are one contiguous block (`step * microbatches_per_step + m`), and a peer's share is
usually a few runs of it, so ranges keep a progress reply or a round header a few dozen bytes
where the full id list grew with the step (4096 ids: ~20 KB on every poll of every mate). The
decoder is the one edge where a mate's set is read: every range must be well formed, inside the
step, sorted and disjoint, and there can be no more ranges than the step has ids.
"""

from __future__ import annotations

from collections.abc import Iterable


def encode_ranges(ids: Iterable[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for i in sorted(ids):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def decode_ranges(value: object, span: range | frozenset[int]) -> frozenset[int]:
    """The ids `value` names, each in `span` (a step's ids); ValueError on anything else."""
    lo, hi = (span.start, span.stop) if isinstance(span, range) else (min(span, default=0), max(span, default=-1) + 1)
    if not isinstance(value, list) or len(value) > max(1, hi - lo):
        raise ValueError("an id set must be a list of at most one range per id of the step")
    ids: set[int] = set()
    last = lo
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and all(type(v) is int for v in item)):
            raise ValueError(f"bad id range {item!r}")
        start, end = item
        if not last <= start < end <= hi:
            raise ValueError(f"id range {item!r} is outside the step's ids [{lo}, {hi}), unsorted or overlapping")
        ids.update(range(start, end))
        last = end
    return frozenset(ids)
