"""The comparison of issue 6: every rule on the same generated traces, seed by seed.

Each seed gives one trace; every rule replays that same trace (and shares its optimum), so the
rules differ only by what they decide. Rules with their own randomness (random joins) draw it from
the seed as well, so a whole run is reproducible.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from swarmd.sim.engine import Rule, SimConfig, SimResult, simulate
from swarmd.sim.optimal import track
from swarmd.sim.trace import TraceModel, generate


@dataclass(frozen=True)
class Variant:
    name: str
    model: TraceModel
    config: SimConfig


# The issue author's calibration: lands `none` and the paper's T=300 rule near 0.827 and 0.958.
DEFAULT = Variant("default", TraceModel(), SimConfig(stages=8))
# Many stages and mixed speeds: what the paper names as where rebalancing helps least.
HARD = Variant("hard", TraceModel(speed_cv=0.5), SimConfig(stages=32))


def run_variant(variant: Variant, rules: dict[str, Rule], seeds: list[int], keep_timeline_of: int | None = None):
    """Summary per rule (mean/std of the ratio, moves/h, moving share) and the kept seed's results."""
    per_rule: dict[str, list[SimResult]] = {name: [] for name in rules}
    kept: dict[str, SimResult] = {}
    gaps = []
    for seed in seeds:
        events = generate(variant.model, seed)
        optimum = track(events, variant.config.stages)
        gaps.append(optimum.gap_avg)
        for name, rule in rules.items():
            result = simulate(
                events, rule, variant.config, seed=seed, duration_s=variant.model.hours * 3600.0,
                timeline=seed == keep_timeline_of, optimum=optimum,
            )
            per_rule[name].append(result)
            if seed == keep_timeline_of:
                kept[name] = result
    summary = {
        "trace": {**variant.model.as_dict(), **asdict(variant.config), "seeds": list(seeds)},
        "optimal_gap": max(gaps),
        "policies": {name: summarise(results) for name, results in per_rule.items()},
    }
    return summary, kept


def summarise(results: list[SimResult]) -> dict:
    ratios = [r.ratio for r in results]
    return {
        "mean": round(statistics.fmean(ratios), 4),
        "std": round(statistics.stdev(ratios), 4) if len(ratios) > 1 else 0.0,
        "moves_per_hour": round(statistics.fmean(r.moves_per_hour for r in results), 1),
        "moving_share": round(statistics.fmean(r.moving_share for r in results), 5),
    }
