"""What counts as a failure when hostile bytes go into a decoder, judged one input at a time.

Shared by the bounded hypothesis tests (tests/fuzz/) and the long coverage-guided runs
(bench/fuzz.py), so both count crashes, hangs and over-allocations by the same rules:

- crash: the target raised anything outside its documented error types (a peer's bytes must end in
  a typed error the caller can act on, never in a KeyError three frames down);
- invariant: the target returned normally but broke a property its module documents (a canonical
  form that does not load back, two feeding patterns that decode differently);
- hang: one input took longer than `HANG_S` (a real infinite loop is cut at `WATCHDOG_S`);
- over_allocation: tracemalloc's peak for the input, or the process's max RSS growth, passed the
  target's bound, which each target derives from the limits it runs under.

Nothing is tolerated: a finding is fixed at its root and its input kept in fuzz_targets.FIXED_BUGS.
"""

from __future__ import annotations

import resource
import signal
import time
import traceback
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field

HANG_S = 1.0
"""One input may take this long; every decoder here is linear in a few KiB, so 1 s is ~1000x slack."""
WATCHDOG_S = 10.0
"""A target still running after this is interrupted (SIGALRM) so a real infinite loop ends the run."""
RSS_SLACK_BYTES = 64 * 1024 * 1024
"""Max-RSS growth allowed beyond the tracemalloc bound: allocator and import noise, while still
catching memory torch allocates behind tracemalloc's back (it only sees Python and numpy)."""


class InvariantBroken(AssertionError):
    """A target's own post-condition failed (raised by the target's runner, never by the module)."""


class WatchdogFired(BaseException):
    """Raised into a target that ran past WATCHDOG_S; a BaseException so no `except Exception` eats it."""


@dataclass(frozen=True)
class Target:
    """One decoder entry point fed raw bytes; `run` raises only `expected` errors when it works, and
    returns False when the harness skipped the input before the module under test saw it."""

    name: str
    run: Callable[[bytes], bool | None]
    expected: tuple[type[BaseException], ...]
    alloc_bound: Callable[[int], int]  # input length -> bytes allowed at peak
    seeds: Callable[[], list[bytes]]
    description: str = ""


@dataclass(frozen=True)
class Finding:
    kind: str  # crash | invariant | hang | over_allocation
    target: str
    data: bytes
    detail: str

    @property
    def signature(self) -> tuple:
        """What tells two findings apart: kind and the error's type (text before ':')."""
        last = self.detail.splitlines()[-1] if self.detail else ""
        return self.kind, last.split(":")[0]

    def as_dict(self) -> dict:
        return {"kind": self.kind, "target": self.target, "input_hex": self.data.hex(),
                "detail": self.detail}


@dataclass
class Tally:
    """Counts for one target over a run (the bench's JSON per target)."""

    inputs: int = 0
    crashes: int = 0
    invariants: int = 0
    hangs: int = 0
    over_allocations: int = 0
    slowest_s: float = 0.0
    peak_bytes: int = 0
    findings: list[Finding] = field(default_factory=list)

    def add(self, finding: Finding | None, elapsed: float, peak: int, keep: int = 20) -> None:
        self.inputs += 1
        self.slowest_s = max(self.slowest_s, elapsed)
        self.peak_bytes = max(self.peak_bytes, peak)
        if finding is None:
            return
        attr = {"crash": "crashes", "invariant": "invariants", "hang": "hangs",
                "over_allocation": "over_allocations"}[finding.kind]
        setattr(self, attr, getattr(self, attr) + 1)
        if finding.signature not in {f.signature for f in self.findings} and len(self.findings) < keep:
            self.findings.append(finding)


def _on_alarm(signum, frame):  # noqa: ARG001 - signal handler signature
    raise WatchdogFired(f"input still running after {WATCHDOG_S} s")


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def check(target: Target, data: bytes, watchdog: bool = True) -> tuple[Finding | None, float, int]:
    """Run one input; returns (the failure or None, seconds taken, tracemalloc peak in bytes).

    `watchdog=False` under libFuzzer, whose own `-timeout` owns SIGALRM there."""
    # Tracing left on would slow every later test and swell every later tracemalloc peak: stop what we start.
    started_tracing = not tracemalloc.is_tracing()
    if started_tracing:
        tracemalloc.start()
    try:
        return _check_traced(target, data, watchdog)
    finally:
        if started_tracing:
            tracemalloc.stop()


def _check_traced(target: Target, data: bytes, watchdog: bool) -> tuple[Finding | None, float, int]:
    bound = target.alloc_bound(len(data))
    tracemalloc.clear_traces()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    rss_before = _max_rss_bytes()
    if watchdog:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, WATCHDOG_S)
    failure: tuple[str, BaseException] | None = None
    start = time.perf_counter()
    try:
        target.run(data)
    except target.expected:
        pass
    except InvariantBroken as exc:
        failure = ("invariant", exc)
    except WatchdogFired as exc:
        failure = ("hang", exc)
    except Exception as exc:  # the point of the oracle: anything undocumented is a crash
        failure = ("crash", exc)
    finally:
        if watchdog:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    elapsed = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] - base
    rss_growth = _max_rss_bytes() - rss_before
    if failure is not None:
        kind, exc = failure
        detail = "".join(traceback.format_exception(exc)).strip()
        return Finding(kind, target.name, data, detail), elapsed, peak
    if elapsed > HANG_S:
        return Finding("hang", target.name, data, f"took {elapsed:.3f} s, limit {HANG_S} s"), elapsed, peak
    if peak > bound or rss_growth > bound + RSS_SLACK_BYTES:
        detail = f"tracemalloc peak {peak} B, max-RSS growth {rss_growth} B; bound {bound} B"
        return Finding("over_allocation", target.name, data, detail), elapsed, peak
    return None, elapsed, peak


def assert_clean(target: Target, data: bytes) -> None:
    """For tests: fail on any finding, with the input as hex so it can be appended to FIXED_BUGS."""
    finding, _, _ = check(target, data)
    if finding is not None:
        raise AssertionError(f"{finding.kind} in {target.name} on input {data.hex()}:\n{finding.detail}")
