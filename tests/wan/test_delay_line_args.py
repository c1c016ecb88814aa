"""What needs no root: the delay line's port syntax and the stream arithmetic of bench/wan_link.py."""

from __future__ import annotations

import argparse

import pytest
from benchmod import load_bench
from netns_link import wan_link


delay_line = load_bench("delay_line.py")


def test_a_port_is_a_name_and_a_delay_in_ms():
    assert delay_line._port("wh0=25") == ("wh0", 25.0)
    assert delay_line._port("wh0=0.5") == ("wh0", 0.5)


@pytest.mark.parametrize("text", ["wh0", "=25", "wh0=", "wh0=-1", "wh0=abc", "wh0=nan", "wh0=10001"])
def test_a_bad_port_is_refused_with_the_syntax(text):
    with pytest.raises(argparse.ArgumentTypeError, match="IFNAME=DELAY_MS"):
        delay_line._port(text)


def test_goodput_is_taken_past_the_ramp():
    timeline = [(0.5, 1_000), (1.0, 2_000), (2.0, 2_502_000), (3.0, 5_002_000)]
    assert wan_link.goodput_mbps(timeline, 2.0) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="ended before"):
        wan_link.goodput_mbps(timeline, 2.5)


def test_a_star_is_refused_before_anything_is_built():
    with pytest.raises((ValueError, RuntimeError)):
        with wan_link.wan_star(peers=1):
            pass
