"""Issue 8 benchmark: long fuzzing runs of every decoder and parser, coverage-guided with atheris.

Each target (tests/fuzz/fuzz_targets.py: frames, codecs, handshake, dht, gossip, jobspec, control,
config) runs in its own subprocess under libFuzzer (atheris.Fuzz never returns) for
`--seconds-per-target`, starting from the project's own encoders' seed corpus, with the modules of
`transport` and `swarmd` (and tomllib, which parses our TOML) instrumented for coverage. Every input
is judged by tests/fuzz/fuzz_oracle.py: crash (an exception outside the target's documented types),
invariant (a documented property broken), hang (> 1 s for one input), over-allocation (tracemalloc
peak or max-RSS growth past the target's bound). Findings are counted, not fatal, so a run measures
how many inputs were tried and how many failed. Without atheris the same targets run under hypothesis
(`engine: hypothesis`), seeded mutations plus structured near-misses, for the same time.

Prints one JSON object: `targets.<name>.inputs`, `.crashes`, `.invariants`, `.hangs`,
`.over_allocations`, `.seconds`, `.engine`, `.coverage` (libFuzzer's final `cov:`, atheris only),
`.findings` (distinct ones, with the input as hex (cut after 1 KiB) and the traceback's last lines),
and `totals`: the same counts summed, plus `findings`, every failing input of every kind (the
target is 0; each one is fixed at its root and its input appended to fuzz_targets.FIXED_BUGS).

    .venv/bin/python bench/fuzz.py [--quick] [--seconds-per-target N] [--targets a,b] [--engine E]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
HARNESS = REPO / "tests" / "fuzz"
OUT = BENCH / "out" / "fuzz"
# bench/transport.py is named like the package: keep bench/ off the path so `transport` is the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
sys.path.insert(0, str(REPO))
STATS_EVERY_S = 0.5
MAX_LEN = 64 * 1024
"""libFuzzer's -max_len: every limit under fuzz (FUZZ_LIMITS, MAX_SPEC_BYTES, a header) fits in it."""
LIBFUZZER_TIMEOUT_S = 10
"""libFuzzer kills an input after this (a real infinite loop); the oracle's 1 s hang rule is separate."""
INSTRUMENTED = ["transport", "swarmd", "tomllib"]
FINDING_KINDS = ("crashes", "invariants", "hangs", "over_allocations")


def _harness():
    sys.path.insert(0, str(HARNESS))
    import torch

    torch.set_num_threads(1)


def _write_stats(path: Path, tally, engine: str, started: float) -> None:
    out = {
        "engine": engine, "inputs": tally.inputs, "crashes": tally.crashes, "invariants": tally.invariants,
        "hangs": tally.hangs, "over_allocations": tally.over_allocations,
        "seconds": round(time.perf_counter() - started, 2), "slowest_input_s": round(tally.slowest_s, 4),
        "peak_alloc_bytes": tally.peak_bytes, "findings": [f.as_dict() for f in tally.findings],
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, path)


# ------------------------------------------------------------------------------- child: atheris


def child_atheris(name: str, seconds: int, stats: Path, workdir: Path) -> None:
    """Runs in the target's subprocess; never returns (libFuzzer exits the process at the end)."""
    _harness()
    import atheris

    with atheris.instrument_imports(include=INSTRUMENTED):
        import fuzz_oracle
        import fuzz_targets
    target = fuzz_targets.TARGETS[name]
    tally, started = fuzz_oracle.Tally(), time.perf_counter()
    last = [0.0]
    corpus = workdir / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for index, seed in enumerate(target.seeds()):
        (corpus / f"seed-{index}").write_bytes(seed)

    def one_input(data: bytes) -> None:
        finding, elapsed, peak = fuzz_oracle.check(target, data, watchdog=False)
        tally.add(finding, elapsed, peak)
        now = time.perf_counter()
        if now - started >= seconds:  # exact final counts: libFuzzer's own exit skips Python's atexit
            _write_stats(stats, tally, "atheris", started)
            sys.stdout.flush()
            os._exit(0)
        if finding is not None or now - last[0] > STATS_EVERY_S:
            last[0] = now
            _write_stats(stats, tally, "atheris", started)

    # -max_total_time is only a backstop: the budget is enforced above, where the counts are known.
    args = [sys.argv[0], f"-max_total_time={seconds + 30}", f"-timeout={LIBFUZZER_TIMEOUT_S}",
            f"-max_len={MAX_LEN}", "-rss_limit_mb=4096", f"-artifact_prefix={workdir}/", str(corpus)]
    atheris.Setup(args, one_input)
    atheris.Fuzz()


# ---------------------------------------------------------------------------- child: hypothesis


class _TimeUp(Exception):
    """Ends a hypothesis run when its time budget is spent."""


def child_hypothesis(name: str, seconds: int, stats: Path) -> None:
    _harness()
    from hypothesis import HealthCheck, Phase, given, settings

    import fuzz_oracle
    import fuzz_strategies
    import fuzz_targets

    target = fuzz_targets.TARGETS[name]
    tally, started = fuzz_oracle.Tally(), time.perf_counter()
    deadline = started + seconds

    @settings(max_examples=10**9, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(fuzz_strategies.inputs_for(name))
    def run(data: bytes) -> None:
        if time.perf_counter() > deadline:
            raise _TimeUp
        finding, elapsed, peak = fuzz_oracle.check(target, data)
        tally.add(finding, elapsed, peak)

    for seed in target.seeds():
        tally.add(*fuzz_oracle.check(target, seed))
    try:
        run()
    except _TimeUp:
        pass
    _write_stats(stats, tally, "hypothesis", started)


# ------------------------------------------------------------------------------------- parent


def _atheris_available() -> tuple[bool, str]:
    try:
        import atheris  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "use the fallback", said in the JSON
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


def run_target(name: str, seconds: int, engine: str) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"swarmd-fuzz-{name}-") as tmp:
        workdir, stats = Path(tmp), Path(tmp) / "stats.json"
        cmd = [sys.executable, __file__, "--child", name, "--seconds-per-target", str(seconds),
               "--engine", engine, "--stats", str(stats), "--workdir", str(workdir)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        started = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=seconds * 3 + 300)
        wall = time.perf_counter() - started
        result = json.loads(stats.read_text()) if stats.exists() else {
            "engine": engine, "inputs": 0, "crashes": 0, "invariants": 0, "hangs": 0, "over_allocations": 0,
            "findings": []}
        result["wall_seconds"] = round(wall, 1)
        log = proc.stdout + proc.stderr
        coverage = re.findall(r"cov: (\d+)", log)
        if coverage:
            result["coverage"] = int(coverage[-1])
        # libFuzzer itself stopping the child (its -timeout, RSS limit, a crash in C) is a finding too.
        libfuzzer_kill = re.search(r"==\d+== ERROR: libFuzzer: (\S+)", log)
        if libfuzzer_kill or (proc.returncode != 0 and not stats.exists()):
            reason = libfuzzer_kill.group(1) if libfuzzer_kill else f"exit status {proc.returncode}"
            artifact = next(iter(sorted(workdir.glob("*-*"))), None)
            kind = "hangs" if "timeout" in reason else "over_allocations" if "rss" in reason else "crashes"
            result[kind] += 1
            result["findings"].append({"kind": kind.rstrip("s"), "target": name, "detail": f"libFuzzer: {reason}",
                                       "input_hex": artifact.read_bytes().hex() if artifact else None,
                                       "log_tail": log[-2000:]})
        return result


def _short_hex(data: bytes, limit: int = 1024) -> str:
    """Inputs as hex for the JSON; long ones (the 4300-digit TOML numbers) are cut, marked with '...'."""
    return data.hex() if len(data) <= limit else data[:limit].hex() + "..."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 s per target")
    parser.add_argument("--seconds-per-target", type=int, default=None, help="default 60 (5 with --quick)")
    parser.add_argument("--targets", default="", help="comma-separated subset (default: all)")
    parser.add_argument("--engine", choices=("auto", "atheris", "hypothesis"), default="auto")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--stats", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    seconds = args.seconds_per_target or (5 if args.quick else 60)
    if args.child:
        if args.engine == "atheris":
            child_atheris(args.child, seconds, Path(args.stats), Path(args.workdir))
        else:
            child_hypothesis(args.child, seconds, Path(args.stats))
        return
    has_atheris, why_not = _atheris_available()
    engine = args.engine if args.engine != "auto" else ("atheris" if has_atheris else "hypothesis")
    if engine == "atheris" and not has_atheris:
        parser.error(f"atheris cannot be imported: {why_not}")
    _harness()
    from fuzz_targets import TARGETS

    names = [n for n in args.targets.split(",") if n] or list(TARGETS)
    unknown = sorted(set(names) - set(TARGETS))
    if unknown:
        parser.error(f"unknown targets {unknown}; known: {', '.join(TARGETS)}")
    started = time.perf_counter()
    report: dict = {"engine": engine, "seconds_per_target": seconds, "targets": {}}
    if not has_atheris:
        report["atheris_unavailable"] = why_not
    for name in names:
        report["targets"][name] = run_target(name, seconds, engine)
    results = report["targets"].values()
    report["totals"] = {
        key: sum(r[key] for r in results) for key in ("inputs", *FINDING_KINDS)
    }
    report["totals"]["findings"] = sum(report["totals"][key] for key in FINDING_KINDS)
    for result in results:
        for finding in result["findings"]:
            if finding.get("input_hex"):
                raw = bytes.fromhex(finding["input_hex"])
                finding["input_bytes"], finding["input_hex"] = len(raw), _short_hex(raw)
            finding["detail"] = "\n".join(finding["detail"].splitlines()[-8:])
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
