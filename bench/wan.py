"""The regime SWARM is for, on this machine: links with real latency and a swarm of dozens.
Gathers three measurements into one JSON object (needs root for the first two):

    sudo .venv/bin/python bench/wan.py [--quick] [--scale-daemons 8,16,32] [--no-scale]

- emulator: the link emulator (bench/wan_link.py) against its configuration: `rtt_error_max`, the
  worst relative error of the median ICMP round trip at 20, 100 and 200 ms (the configured RTT is
  the baseline); `max_rate_mbps`, one TCP stream's goodput past its ramp over a 100 ms link with no
  rate limit, i.e. the most the userspace delay line carries here; beside them one stream over
  100 ms / 200 Mb/s as a fraction of the rate and the window-limited rate with a 64 KiB buffer.
- latency: bench/wan_pipeline.py's rows, a real swarm behind delayed links, samples/s measured and
  predicted by the overlap model, for RTT × microbatches in flight (RTT 0, the calibration, once
  before each other RTT, so it appears once per RTT).
- scale: bench/swarm_scale.py's rows, per-daemon control bytes/s, RSS and step time at each size,
  the growth of control traffic from the smallest to the largest size, and whether every step of
  the churned job was exact (samples and duplicates counted, not bits: the stage all-reduce runs at
  its default codec, fp16). `control_growth_8_to_32` is null when 32 daemons were not run (the
  growth that was measured is then given under its own sizes).

    {"emulator": {"rtt_error_max", "max_rate_mbps", ...}, "latency": [{"rtt_ms", "in_flight",
     "measured_samples_per_s", "predicted_samples_per_s"}, ...], "scale": {"daemons": {"8":
     {"control_bytes_per_s", "rss_mb", "step_s"}, ...}, "control_growth_8_to_32", "exact"}}
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
PING_RTTS_MS = (20, 100, 200)
PINGS = 20
STREAM_S = 9.0
#: Past BBR's start-up and receive-window autotuning at 100 ms (about 1 s here), with room.
RAMP_S = 3.0
#: Each sub-benchmark's own limit: the full pipeline sweep takes ~10 min, 32 daemons' start-up more.
SUB_TIMEOUT_S = 3600


def _load_wan_link():
    name = "swarmd_bench_wan_link"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / "wan_link.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def emulator() -> dict:
    wan_link = _load_wan_link()
    errors = {}
    for rtt in PING_RTTS_MS:
        with wan_link.wan_star(peers=2, rtt_ms=rtt, rate_mbit=200) as star:
            errors[rtt] = abs(statistics.median(star.ping(1, 0, PINGS)) - rtt) / rtt
    with wan_link.wan_star(peers=2, rtt_ms=100, rate_mbit=None) as star:
        unshaped = wan_link.goodput_mbps(star.stream(1, 0, STREAM_S), RAMP_S)
    late_us_mean = star.delay_stats.get("late_us_mean")
    with wan_link.wan_star(peers=2, rtt_ms=100, rate_mbit=200) as star:
        shaped = wan_link.goodput_mbps(star.stream(1, 0, STREAM_S), RAMP_S)
        small = wan_link.goodput_mbps(star.stream(1, 0, 6.0, buffer=64 * 1024, port=5002), 2.0)
    return {"rtt_error_max": round(max(errors.values()), 4), "max_rate_mbps": round(unshaped, 1),
            "rtt_error": {str(k): round(v, 4) for k, v in errors.items()},
            "stream_100ms_200mbps_ratio": round(shaped / 200, 3),
            "stream_100ms_64kib_buffer_mbps": round(small, 2),
            "window_limit_64kib_100ms_mbps": round(64 * 1024 * 8 / 0.1 / 1e6, 2),
            "delay_line_late_us_mean_at_max_rate": late_us_mean}


def sub_bench(script: str, argv: list[str]) -> dict:
    done = subprocess.run([sys.executable, str(BENCH / script), *argv], capture_output=True, text=True,
                          timeout=SUB_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout)


def latency(quick: bool) -> list[dict]:
    report = sub_bench("wan_pipeline.py", ["--quick"] if quick else [])
    return [{k: r[k] for k in ("rtt_ms", "in_flight", "measured_samples_per_s", "predicted_samples_per_s")}
            for r in report.get("latency", [])]


def scale(daemons: str, quick: bool) -> dict:
    argv = ["--daemons", daemons] + (["--idle", "10", "--churn", "40"] if quick else [])
    report = sub_bench("swarm_scale.py", argv)
    rows = {n: {"control_bytes_per_s": r.get("control_bytes_per_s"), "rss_mb": r.get("rss_mb_max"),
                "step_s": r.get("step_s"), **({"error": r["error"]} if "error" in r else {})}
            for n, r in report["daemons"].items()}
    growth = {k: v for k, v in report.items() if k.startswith("control_growth_")}
    return {"daemons": rows, "control_growth_8_to_32": growth.get("control_growth_8_to_32"), **growth,
            "exact": report["exact"]}


def _or_error(part, *args):
    """A part that fails leaves its error in the report instead of taking the others with it."""
    try:
        return part(*args)
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError, KeyError) as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[-2000:]}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the pipeline at RTT 0/100 only, short scale windows")
    parser.add_argument("--scale-daemons", default="8,16,32")
    parser.add_argument("--no-scale", action="store_true")
    args = parser.parse_args()
    reason = _load_wan_link().unavailable_reason()
    report: dict = {}
    if reason is None:
        report["emulator"] = emulator()
        report["latency"] = _or_error(latency, args.quick)
    else:
        report["emulator"], report["latency"], report["skipped"] = None, None, reason
    report["scale"] = None if args.no_scale else _or_error(scale, args.scale_daemons, args.quick)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
