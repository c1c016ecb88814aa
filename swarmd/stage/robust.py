"""Robust aggregation of one all-reduce shard: a stage-mate cannot drag the step by sending a huge
or non-finite gradient.

The plain mean (the default) is exact and what the equivalence tests rely on, but one peer that
multiplies its gradient by 1e3 moves every member's step wherever it likes. `centered_clip` (after
Karimireddy et al.'s CenteredClip) bounds each peer's pull. Peers hold gradient SUMS over
different sample counts n_i, so the reducer of a shard works on per-sample means:

    a_i = g_i / n_i                                   (peers with n_i = 0 take no part)
    v_0 = coordinate-wise median of the a_i           (robust start: a mean would start at the outlier;
                                                       zero with fewer than three contributors)
    v   ← v + Σ_i n_i · clip(a_i − v, τ_s) / Σ_i n_i  (`clip_iterations` times)
    clip(x, τ) = x · min(1, τ / ‖x‖)
    result = v · N,   N = Σ_i n_i over every contributing peer

so the result is again a gradient SUM over N samples. An iteration that clips nothing lands v on the
sample-weighted mean Σ g_i / Σ n_i, so without outliers the result is Σ_i g_i up to rounding. With
fewer than three contributing peers there is no majority to start from, so v starts at zero: any
one peer then moves v by at most `clip_iterations` · τ_s, and parts whose per-sample norm is
below τ_s still give the exact mean in the first iteration. τ is a bound on the per-sample gradient norm over
the WHOLE stage; the shard of `len` of `numel` elements uses τ_s = τ · sqrt(len / numel), so the
bound does not depend on how many members cut the vector. A part with non-finite values is left
out (it would make every norm NaN), and so is its weight. A peer is reported as an outlier when
its part was not finite, or, with at least three finite contributors (two cannot say which of
them is odd), when its final distance ‖a_i − v‖ exceeds `outlier_factor` · τ_s.

What it does not cover: the reducer of a shard decides that shard alone, so a hostile member
could still corrupt the shard it reduces. Members are bounded by this, not verified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MEAN = "mean"
CENTERED_CLIP = "centered_clip"
AGGREGATES = (MEAN, CENTERED_CLIP)


@dataclass(frozen=True)
class Robust:
    """The reduced shard (a gradient sum) and the member indices reported as outliers."""

    total: torch.Tensor
    outliers: frozenset[int]


def centered_clip(parts: list[torch.Tensor], samples: list[int], numel: int, tau: float, iterations: int,
                  outlier_factor: float) -> Robust:
    """Reduce member `parts` (gradient sums of one shard, member order) with `samples` each."""
    length = parts[0].numel() if parts else 0
    tau_s = tau * math.sqrt(length / numel) if numel else tau
    outliers = set()
    used: list[int] = []
    for i, (part, n) in enumerate(zip(parts, samples)):
        if n <= 0:
            continue
        if not bool(torch.isfinite(part).all()):
            outliers.add(i)
            continue
        used.append(i)
    total_samples = sum(n for n in samples if n > 0)
    if not used or length == 0:
        return Robust(torch.zeros(length), frozenset(outliers))
    means = torch.stack([parts[i] / samples[i] for i in used])
    weights = torch.tensor([float(samples[i]) for i in used])
    weights = weights / weights.sum()
    v = means.median(dim=0).values if len(used) > 2 else torch.zeros(length)
    for _ in range(iterations):
        diff = means - v
        norms = diff.norm(dim=1)
        scale = torch.clamp(tau_s / norms.clamp_min(1e-30), max=1.0)
        v = v + (weights * scale) @ diff
    if len(used) > 2:  # with two, either could be the odd one: clipped alike, neither named
        distance = (means - v).norm(dim=1)
        for j, i in enumerate(used):
            if distance[j] > outlier_factor * tau_s:
                outliers.add(i)
    return Robust(v * total_samples, frozenset(outliers))
