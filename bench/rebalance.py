"""Issue 6 benchmark: rebalancing rules against the optimum on simulated preemptible swarms.

Prints one JSON object: for the default and the hard trace models, each rule's time-averaged
throughput / time-averaged optimum (mean and std over seeds), moves per hour and the share of
peer-time spent moving, with the trace generator's parameters. The baseline (`none`) and the
paper's rule are measured in the same run on the same traces. Writes a PNG of throughput against
the optimum for the first seed to bench/out/rebalance.png.

    .venv/bin/python bench/rebalance.py [--quick] [--seeds N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from swarmd.sim.engine import standard_rules
from swarmd.sim.experiment import DEFAULT, HARD, run_variant
from swarmd.sim.plot import plot_timelines

OUT = Path(__file__).parent / "out"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 seeds instead of 10")
    parser.add_argument("--seeds", type=int, default=None)
    args = parser.parse_args()
    seeds = list(range(args.seeds or (3 if args.quick else 10)))
    started, cpu = time.perf_counter(), time.process_time()
    report, panels = {}, {}
    for variant in (DEFAULT, HARD):
        summary, kept = run_variant(variant, standard_rules(), seeds, keep_timeline_of=seeds[0])
        report[variant.name] = summary
        panels[f"{variant.name}: {variant.config.stages} stages, seed {seeds[0]}"] = {
            name: kept[name] for name in ("none", "T300", "swarmd")
        }
    png = plot_timelines(panels, OUT / "rebalance.png")
    default, hard = report["default"]["policies"], report["hard"]["policies"]
    report["targets"] = {
        "default_swarmd_ge_0.98": default["swarmd"]["mean"] >= 0.98,
        "hard_swarmd_ge_T300_plus_0.02": hard["swarmd"]["mean"] >= hard["T300"]["mean"] + 0.02,
        "paper_none_0.827_T300_0.958": [default["none"]["mean"], default["T300"]["mean"]],
    }
    report["png"] = str(png)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["cpu_seconds"] = round(time.process_time() - cpu, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
