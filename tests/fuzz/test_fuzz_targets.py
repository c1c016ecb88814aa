"""Fuzz, bounded for CI: every target in fuzz_targets.TARGETS (wire frames, tensor codecs, handshake
hello, DHT payloads, gossip entries, job spec, control requests, daemon config) fed damaged seeds,
structured near-misses and random bytes. Each target's docstring in fuzz_targets says what it drives
and which documented errors may come out; a spec or config that parses must round-trip.

Crash, hang and over-allocation are defined in fuzz_oracle (docs/fuzzing.md); none is tolerated.
About a minute of CPU for all targets, so `slow`: `make test-fast` keeps only the recorded
reproducers (test_fuzz_fixed_bugs.py) and the oracle's own tests.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzz_oracle import assert_clean
from fuzz_strategies import CI_SETTINGS, inputs_for
from fuzz_targets import TARGETS


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TARGETS))
@CI_SETTINGS
@given(draw=st.data())
def test_hostile_bytes_end_in_documented_errors(name: str, draw: st.DataObject) -> None:
    assert_clean(TARGETS[name], draw.draw(inputs_for(name), label=f"{name} input"))
