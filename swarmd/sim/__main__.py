"""`python -m swarmd.sim`: replay a trace (CSV or generated) under one or more rules, print JSON.

    python -m swarmd.sim --stages 8 --rules none,T300,swarmd --seed 0 --plot out.png
    python -m swarmd.sim --trace my.csv --stages 8
    python -m swarmd.sim --write-trace gen.csv --peers 400 --lifetime weibull
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from swarmd.rebalance.policy import PolicyConfig
from swarmd.sim import trace as tracefile
from swarmd.sim.engine import SimConfig, simulate, standard_rules
from swarmd.sim.optimal import track
from swarmd.sim.trace import TraceModel, generate


def parse_args(argv: list[str]) -> argparse.Namespace:
    defaults = TraceModel()
    p = argparse.ArgumentParser(prog="python -m swarmd.sim", description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, help="CSV trace (time,event,peer,speed); else one is generated")
    p.add_argument("--write-trace", type=Path, help="write the (generated) trace as CSV here")
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--rules", default="none,T60,T300,T600,swarmd")
    p.add_argument("--move-cost", type=float, default=60.0, help="seconds to download a stage's state")
    p.add_argument("--period", type=float, default=PolicyConfig().period_s, help="swarmd per-peer check period")
    p.add_argument("--margin", type=float, default=PolicyConfig().margin)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hours", type=float, default=defaults.hours)
    p.add_argument("--peers", type=int, default=defaults.peers)
    p.add_argument("--lifetime", choices=("exponential", "weibull"), default=defaults.lifetime)
    p.add_argument("--mean-lifetime", type=float, default=defaults.mean_lifetime_s)
    p.add_argument("--weibull-shape", type=float, default=defaults.weibull_shape)
    p.add_argument("--burst-rate", type=float, default=defaults.burst_rate_per_h, help="bursts per hour")
    p.add_argument("--burst-fraction", type=float, default=defaults.burst_fraction)
    p.add_argument("--speed-cv", type=float, default=defaults.speed_cv)
    p.add_argument("--plot", type=Path, help="PNG of throughput against the optimum")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.trace:
            events, model = tracefile.read(args.trace), None
        else:
            model = TraceModel(
                peers=args.peers, hours=args.hours, lifetime=args.lifetime, mean_lifetime_s=args.mean_lifetime,
                weibull_shape=args.weibull_shape, burst_rate_per_h=args.burst_rate,
                burst_fraction=args.burst_fraction, speed_cv=args.speed_cv,
            )
            events = generate(model, args.seed)
        config = SimConfig(stages=args.stages, move_cost_s=args.move_cost)
        rules = standard_rules(PolicyConfig(period_s=args.period, margin=args.margin))
        chosen = [name.strip() for name in args.rules.split(",") if name.strip()]
        unknown = [name for name in chosen if name not in rules]
        if unknown:
            raise ValueError(f"unknown rules {unknown}; known: {sorted(rules)}")
    except (OSError, ValueError) as exc:  # TraceError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.write_trace:
        tracefile.write(args.write_trace, events)
    duration = model.hours * 3600.0 if model else (events[-1].time if events else 0.0)
    optimum = track(events, config.stages)
    results = {
        name: simulate(events, rules[name], config, seed=args.seed, duration_s=duration,
                       timeline=args.plot is not None, optimum=optimum)
        for name in chosen
    }
    out = {
        "trace": model.as_dict() if model else {"file": str(args.trace), "events": len(events)},
        "stages": config.stages, "move_cost_s": config.move_cost_s, "optimal_gap": optimum.gap_avg,
        "rules": {
            name: {"ratio": round(r.ratio, 4), "throughput": round(r.throughput_avg, 3),
                   "optimal": round(r.optimal_avg, 3), "moves_per_hour": round(r.moves_per_hour, 1),
                   "moving_share": round(r.moving_share, 5)}
            for name, r in results.items()
        },
    }
    if args.plot:
        from swarmd.sim.plot import plot_timelines

        plot_timelines({f"{config.stages} stages, seed {args.seed}": results}, args.plot)
        out["plot"] = str(args.plot)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
