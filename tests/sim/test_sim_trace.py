"""Trace CSV format and generator."""

import statistics

import pytest

from swarmd.sim.trace import (
    HEADER, JOIN, LEAVE, TraceError, TraceEvent, TraceModel, dumps, generate, loads, read, write,
)


def test_csv_round_trip_is_exact(tmp_path):
    events = generate(TraceModel(peers=30, hours=2.0, speed_cv=0.5), seed=3)
    write(tmp_path / "t.csv", events)
    assert read(tmp_path / "t.csv") == events
    assert (tmp_path / "t.csv").read_text().splitlines()[0] == HEADER


def test_leave_row_may_leave_speed_empty_and_peer_may_rejoin():
    text = f"{HEADER}\n0,join,a,2.5\n10,leave,a,\n20,join,a,1\n"
    assert loads(text) == [TraceEvent(0.0, JOIN, "a", 2.5), TraceEvent(10.0, LEAVE, "a", 0.0),
                           TraceEvent(20.0, JOIN, "a", 1.0)]


@pytest.mark.parametrize(
    "body, message",
    [
        ("time,event,peer\n", "header"),
        (f"{HEADER}\n0,join,a\n", "4 fields"),
        (f"{HEADER}\nzero,join,a,1\n", "not a number"),
        (f"{HEADER}\n-1,join,a,1\n", "negative"),
        (f"{HEADER}\n5,join,a,1\n4,join,b,1\n", "goes back"),
        (f"{HEADER}\n0,join,a,1\n1,join,a,1\n", "joins while live"),
        (f"{HEADER}\n0,leave,a,\n", "not live"),
        (f"{HEADER}\n0,crash,a,1\n", "join or leave"),
        (f"{HEADER}\n0,join,a,0\n", "positive speed"),
        (f"{HEADER}\n0,join,a,nan\n", "finite"),
        (f"{HEADER}\n0,join,,1\n", "peer name"),
    ],
)
def test_malformed_trace_names_the_problem(body, message):
    with pytest.raises(TraceError, match=message):
        loads(body)


def test_row_limit_countermeasure_refuses_huge_traces_before_parsing():
    text = HEADER + "\n" + "".join(f"0,join,p{i},1\n" for i in range(11))
    with pytest.raises(TraceError, match="exceed"):
        loads(text, max_rows=10)


def test_generator_is_deterministic_per_seed():
    model = TraceModel(peers=50, hours=4.0)
    assert generate(model, 1) == generate(model, 1)
    assert generate(model, 1) != generate(model, 2)


def test_generated_population_stays_near_target_through_bursts():
    model = TraceModel(peers=200, hours=24.0, burst_rate_per_h=0.5)
    events = generate(model, seed=0)
    live, sizes, bursts = 0, [], 0
    for i, e in enumerate(events):
        live += 1 if e.event == JOIN else -1
        sizes.append(live)
        if e.event == LEAVE and i + 1 < len(events) and events[i + 1].time == e.time:
            bursts += 1
    assert bursts > 0.15 * 200  # several bursts of ~40 simultaneous leaves
    assert 170 < statistics.fmean(sizes) < 215
    loads(dumps(events))  # a generated trace is always valid


def test_weibull_lifetimes_keep_their_mean_and_speeds_their_spread():
    model = TraceModel(peers=300, hours=48.0, lifetime="weibull", burst_rate_per_h=0.0, speed_cv=0.5)
    events = generate(model, seed=1)
    joined, lifetimes = {}, []
    for e in events:
        if e.event == JOIN:
            joined[e.peer] = e
        else:
            lifetimes.append(e.time - joined[e.peer].time)
    assert 5000 < statistics.fmean(lifetimes) < 8500  # censored at the end, so a little short of 7200
    speeds = [e.speed for e in joined.values()]
    assert 0.4 < statistics.pstdev(speeds) / statistics.fmean(speeds) < 0.6


def test_bad_generator_settings_are_refused():
    with pytest.raises(TraceError):
        TraceModel(lifetime="pareto")
    with pytest.raises(TraceError):
        TraceModel(burst_fraction=1.5)
