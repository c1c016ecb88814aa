"""The link emulator (bench/wan_link.py + bench/delay_line.py) gives real delay and real rate:
ICMP round trips match the configured RTT, one TCP stream fills a 100 ms / 200 Mb/s pipe with the
buffers docs/transport-tuning.md asks for and is held to window/RTT with a pinned 64 KiB buffer,
the delay line's queue is bounded, and every namespace is gone afterwards, also on failure.
Needs root (skipped with the reason otherwise)."""

from __future__ import annotations

import statistics
import subprocess

import pytest
from netns_link import WAN_MARKS, wan_link

# Rates and round trips through a userspace delay line: a second test worker's load would skew them.
pytestmark = [*WAN_MARKS, pytest.mark.serial]

RATE_MBIT = 200
# Past BBR's start-up and the receive window's autotuning at 100 ms (about 1 s here), with room.
RAMP_S = 3.0
STREAM_S = 9.0


def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


@pytest.mark.parametrize("rtt_ms", [20, 100, 200])
def test_ping_round_trip_is_the_configured_rtt(rtt_ms):
    with wan_link.wan_star(peers=2, rtt_ms=rtt_ms, rate_mbit=RATE_MBIT) as star:
        rtts = star.ping(0, 1, count=20)
    assert abs(statistics.median(rtts) - rtt_ms) <= 0.05 * rtt_ms, rtts
    assert min(rtts) >= rtt_ms, f"a frame left the delay line early: {rtts}"
    assert star.delay_stats["frames"] >= 40


def test_one_stream_fills_a_long_fat_pipe():
    with wan_link.wan_star(peers=2, rtt_ms=100, rate_mbit=RATE_MBIT) as star:
        timeline = star.stream(sender=1, receiver=0, seconds=STREAM_S)
    rate = wan_link.goodput_mbps(timeline, RAMP_S)
    assert rate >= 0.9 * RATE_MBIT, timeline
    # The ramp is real: slow start over a 100 ms round trip cannot deliver the rate at once.
    first = next(point for point in timeline if point[0] >= 0.3)
    assert 8 * first[1] / first[0] / 1e6 < 0.5 * RATE_MBIT, timeline[:5]


def test_a_64_kib_buffer_is_held_to_window_over_rtt():
    with wan_link.wan_star(peers=2, rtt_ms=100, rate_mbit=RATE_MBIT) as star:
        timeline = star.stream(sender=1, receiver=0, seconds=6.0, buffer=64 * 1024)
    window_limit = 64 * 1024 * 8 / 0.100 / 1e6  # 5.2 Mb/s
    rate = wan_link.goodput_mbps(timeline, 2.0)
    assert 0.5 * window_limit <= rate <= 1.6 * window_limit, timeline


def test_the_delay_line_drops_past_its_limit():
    """A 256 KiB limit is a tenth of this path's bandwidth-delay product: the line drops, TCP backs
    off, and the rate falls well short of the link's."""
    with wan_link.wan_star(peers=2, rtt_ms=100, rate_mbit=RATE_MBIT, limit_bytes=256 * 1024) as star:
        timeline = star.stream(sender=1, receiver=0, seconds=5.0)
    assert star.delay_stats["dropped_frames"] > 0, star.delay_stats
    assert star.delay_stats["max_held_bytes"] <= 256 * 1024
    assert wan_link.goodput_mbps(timeline, 2.0) < 0.5 * RATE_MBIT


def test_every_namespace_is_deleted_also_on_failure():
    with pytest.raises(RuntimeError, match="inside"):
        with wan_link.wan_star(peers=3, rtt_ms=10, rate_mbit=None) as star:
            assert set(star.namespaces) | {star.hub} <= _namespaces()
            raise RuntimeError("failure inside the block")
    assert not (set(star.namespaces) | {star.hub}) & _namespaces()
    assert star.delay_line.poll() is not None


def test_the_round_trip_changes_in_place():
    with wan_link.wan_star(peers=3, rtt_ms=20, rate_mbit=None) as star:
        before = statistics.median(star.ping(0, 2, count=5))
        star.set_rtt(60)
        after = statistics.median(star.ping(2, 1, count=5))
    assert abs(before - 20) <= 1 and abs(after - 60) <= 3, (before, after)
