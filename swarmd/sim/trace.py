"""Join/preemption traces: the CSV format and a generator of preemptible-cloud-like traces.

CSV: header `time,event,peer,speed`; one row per event, `time` in seconds from the trace start and
non-decreasing, `event` is `join` or `leave`, `peer` a non-empty name without commas, `speed` the
peer's samples/s (positive; required on `join`, empty or ignored on `leave`). A peer may rejoin after
it left. Validation is strict and reports the line, because a silently mangled trace would make every
figure computed from it meaningless.
"""

from __future__ import annotations

import heapq
import io
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from swarmd.errors import LocalError

HEADER = "time,event,peer,speed"
JOIN = "join"
LEAVE = "leave"
# Rows one trace may hold: 32 h of 400 peers is ~15k; a million leaves ample room and bounds memory.
MAX_TRACE_ROWS = 1_000_000
MAX_PEER_NAME = 128


class TraceError(LocalError, ValueError):
    """A trace file or a generator setting is malformed; the message names the line or the field."""


@dataclass(frozen=True)
class TraceEvent:
    time: float
    event: str
    peer: str
    speed: float


def dumps(events: list[TraceEvent]) -> str:
    out = io.StringIO()
    out.write(HEADER + "\n")
    for e in events:
        speed = repr(e.speed) if e.event == JOIN else ""
        out.write(f"{e.time!r},{e.event},{e.peer},{speed}\n")
    return out.getvalue()


def loads(text: str, max_rows: int = MAX_TRACE_ROWS) -> list[TraceEvent]:
    lines = text.splitlines()
    if not lines or lines[0].strip() != HEADER:
        raise TraceError(f"line 1: the header must be {HEADER!r}")
    if len(lines) - 1 > max_rows:
        raise TraceError(f"{len(lines) - 1} rows exceed the limit of {max_rows}")
    events: list[TraceEvent] = []
    live: set[str] = set()
    last = 0.0
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        event = _parse_row(line, number)
        if event.time < last:
            raise TraceError(f"line {number}: time {event.time} goes back before {last}")
        if event.event == JOIN and event.peer in live:
            raise TraceError(f"line {number}: peer {event.peer!r} joins while live")
        if event.event == LEAVE and event.peer not in live:
            raise TraceError(f"line {number}: peer {event.peer!r} leaves but is not live")
        (live.add if event.event == JOIN else live.discard)(event.peer)
        last = event.time
        events.append(event)
    return events


def _parse_row(line: str, number: int) -> TraceEvent:
    fields = line.split(",")
    if len(fields) != 4:
        raise TraceError(f"line {number}: expected 4 fields, got {len(fields)}")
    time_s, event, peer, speed_s = (f.strip() for f in fields)
    time = _number(time_s, number, "time")
    if time < 0:
        raise TraceError(f"line {number}: negative time {time}")
    if event not in (JOIN, LEAVE):
        raise TraceError(f"line {number}: event must be join or leave, got {event!r}")
    if not peer or len(peer) > MAX_PEER_NAME:
        raise TraceError(f"line {number}: peer name must be 1..{MAX_PEER_NAME} characters")
    speed = 0.0
    if event == JOIN:
        speed = _number(speed_s, number, "speed")
        if speed <= 0:
            raise TraceError(f"line {number}: a joining peer needs a positive speed, got {speed}")
    return TraceEvent(time, event, peer, speed)


def _number(text: str, number: int, name: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"line {number}: {name} {text!r} is not a number") from None
    if not math.isfinite(value):
        raise TraceError(f"line {number}: {name} must be finite")
    return value


def read(path: Path) -> list[TraceEvent]:
    return loads(Path(path).read_text())


def write(path: Path, events: list[TraceEvent]) -> None:
    Path(path).write_text(dumps(events))


@dataclass(frozen=True)
class TraceModel:
    """A preemptible cloud: a target population, random lifetimes, refilling arrivals, bursts.

    Defaults are the calibration of issue 6 (8 stages, 400 peers, 2 h exponential lifetimes, bursts
    of 20% at 0.25/h), on which no rebalancing lands near the paper's 0.827 of optimal.
    """

    peers: int = 400
    hours: float = 32.0
    lifetime: str = "exponential"  # or "weibull"
    mean_lifetime_s: float = 7200.0
    # Weibull shape < 1: many short-lived peers and a long tail, as spot fleets show.
    weibull_shape: float = 0.7
    # Arrivals come at peers / mean_lifetime plus deficit / refill_s: an autoscaler replacing
    # preempted machines within minutes, which is what keeps the population near its target.
    refill_s: float = 600.0
    burst_rate_per_h: float = 0.25
    burst_fraction: float = 0.2
    # Coefficient of variation of peer speeds (lognormal, mean 1); 0 gives equal speeds.
    speed_cv: float = 0.0

    def __post_init__(self):
        if self.peers < 1 or self.hours <= 0 or self.mean_lifetime_s <= 0 or self.refill_s <= 0:
            raise TraceError("peers, hours, mean_lifetime_s and refill_s must be positive")
        if self.lifetime not in ("exponential", "weibull"):
            raise TraceError(f"lifetime must be exponential or weibull, got {self.lifetime!r}")
        if self.weibull_shape <= 0 or self.speed_cv < 0 or self.burst_rate_per_h < 0:
            raise TraceError("weibull_shape must be positive; speed_cv and burst_rate_per_h >= 0")
        if not 0 <= self.burst_fraction <= 1:
            raise TraceError(f"burst_fraction must be in [0, 1], got {self.burst_fraction}")

    def as_dict(self) -> dict:
        return asdict(self)


def generate(model: TraceModel, seed: int) -> list[TraceEvent]:
    """A trace from `model`, the same for the same seed.

    Competing processes: each peer's own departure (its lifetime, drawn at join), arrivals whose
    rate is recomputed after every event (exact, arrivals being memoryless), and bursts.
    """
    rng = random.Random(seed)
    end = model.hours * 3600.0
    events: list[TraceEvent] = []
    departures: list[tuple[float, str]] = []
    live: dict[str, bool] = {}
    counter = 0

    def join(now: float) -> None:
        nonlocal counter
        name = f"p{counter}"
        counter += 1
        live[name] = True
        events.append(TraceEvent(now, JOIN, name, _speed(rng, model.speed_cv)))
        heapq.heappush(departures, (now + _lifetime(rng, model), name))

    for _ in range(model.peers):
        join(0.0)
    now = 0.0
    burst_rate = model.burst_rate_per_h / 3600.0
    next_burst = now + rng.expovariate(burst_rate) if burst_rate > 0 else math.inf
    while True:
        while departures and departures[0][1] not in live:
            heapq.heappop(departures)
        rate = model.peers / model.mean_lifetime_s + max(0, model.peers - len(live)) / model.refill_s
        next_arrival = now + rng.expovariate(rate)
        next_departure = departures[0][0] if departures else math.inf
        now = min(next_arrival, next_departure, next_burst)
        if now >= end:
            return events
        if now == next_departure:
            _, name = heapq.heappop(departures)
            del live[name]
            events.append(TraceEvent(now, LEAVE, name, 0.0))
        elif now == next_burst:
            victims = rng.sample(list(live), round(model.burst_fraction * len(live)))
            for name in victims:
                del live[name]
                events.append(TraceEvent(now, LEAVE, name, 0.0))
            next_burst = now + rng.expovariate(burst_rate)
        else:
            join(now)


def _lifetime(rng: random.Random, model: TraceModel) -> float:
    if model.lifetime == "exponential":
        return rng.expovariate(1.0 / model.mean_lifetime_s)
    scale = model.mean_lifetime_s / math.gamma(1.0 + 1.0 / model.weibull_shape)
    return rng.weibullvariate(scale, model.weibull_shape)


def _speed(rng: random.Random, cv: float) -> float:
    if cv == 0:
        return 1.0
    sigma2 = math.log(1.0 + cv * cv)
    return rng.lognormvariate(-sigma2 / 2.0, math.sqrt(sigma2))
