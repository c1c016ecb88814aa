"""bench/wan_pipeline.py's step model and its calibration, and bench/dht.py's latency rows on a small
swarm (virtual time, so the figures are the protocol's). The real sweeps are run by hand (root)."""

from __future__ import annotations

import pytest
from benchmod import load_bench


wp = load_bench("wan_pipeline.py")
dht = load_bench("dht.py")


def test_one_in_flight_pays_every_round_trip_of_every_microbatch():
    cal = wp.Calibration(chain_s=0.01, busy_s=0.002, commit_s=0.06)  # 0.05 of tick wait, 0.01 of work
    # 16 microbatches x (0.01 + 3 RPCs x 0.1), then the commit: at RTT >= the 0.1 s tick the
    # long-poll always arrives after the tick, so one RTT, plus the work
    assert wp.step_seconds(cal, 0.1, 1, 16, 2) == pytest.approx(16 * 0.31 + 0.1 + 0.01)


def test_the_commit_is_seen_at_the_later_of_the_stages_tick_and_one_round_trip():
    """E[max(U(0, 0.1), r)] + work: 0.05 at r = 0 (the calibration), 0.0625 at 50 ms (half the
    time the tick comes first), r from the tick's length on."""
    cal = wp.Calibration(chain_s=0.01, busy_s=0.002, commit_s=0.06)
    seen = [wp.commit_seconds(cal, rtt, tick_s=0.1) for rtt in (0.0, 0.05, 0.1, 0.2)]
    assert seen == pytest.approx([0.06, 0.0725, 0.11, 0.21])


def test_all_in_flight_pay_one_chain_and_the_busiest_resource():
    cal = wp.Calibration(chain_s=0.01, busy_s=0.002, commit_s=0.06)
    chain = 0.01 + 3 * 0.1
    assert wp.step_seconds(cal, 0.1, 16, 16, 2) == pytest.approx(16 * 0.002 + chain - 0.002 + 0.11)
    # compute-bound: with a slow stage, in-flight count no longer matters past the fill
    slow = wp.Calibration(chain_s=0.01, busy_s=0.5, commit_s=0.0)
    assert wp.step_seconds(slow, 0.0, 4, 16, 2) == wp.step_seconds(slow, 0.0, 16, 16, 2)


def test_calibration_recovers_the_constants_it_was_made_from():
    """Identifiable when the middle k is bound by its chains, as the runs here are (at k = 4 the
    chains, at k = 16 the fill and the busiest resource)."""
    truth = wp.Calibration(chain_s=0.06, busy_s=0.004, commit_s=0.12)
    zero = {k: 16 / wp.step_seconds(truth, 0.0, k, 16, 2) for k in (1, 4, 16)}
    cal = wp.calibrate(zero, 16, 2, 16)
    for k in (1, 4, 16):
        assert wp.predict(cal, 0.0, k, 16, 2, 16) == pytest.approx(zero[k], rel=0.02)
    assert cal.commit_s == pytest.approx(truth.commit_s, rel=0.05)
    for k in (1, 4, 16):
        assert wp.predict(cal, 0.2, k, 16, 2, 16) == pytest.approx(wp.predict(truth, 0.2, k, 16, 2, 16), rel=0.02)


@pytest.mark.parametrize("failure", ["killed", "frozen"])
def test_dht_gets_at_100_ms_all_succeed_under_a_second(failure):
    row = dht.latency_run(32, failure, keys=20, writers=3, one_way_s=0.05, seed=1)
    assert row["rtt_ms"] == 100
    assert row["success_rate"] == 1.0
    assert row["get_p99_ms"] < 1000


def test_dht_latency_records_outlive_the_run():
    """The latency rows' records are held a day: under a peer-rule namespace a storer keeps them at
    most max_announce_ttl (150 s), less than 200 keys' stores and reads take at 100 ms, and every
    key had expired before it was read (success 0.0)."""
    from swarmd.dht import DHTConfig
    from swarmd.dht.storage import Storage

    assert Storage(DHTConfig()).ttl_cap(dht.latency_key(0)) >= 24 * 3600
