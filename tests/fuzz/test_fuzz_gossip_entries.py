"""Fuzz, bounded for CI: swarmd.rebalance.view.decode_entries, then GossipView.merge (open and members-only) and
.table. Only RebalanceError (MalformedEntry) may come out, and a view never holds more than max_peers.

Crash, hang and over-allocation are defined in fuzz_oracle (docs/fuzzing.md); none is tolerated.
"""

from __future__ import annotations

from fuzz_oracle import assert_clean
from fuzz_strategies import CI_SETTINGS, inputs_for
from fuzz_targets import TARGETS
from hypothesis import given

TARGET = TARGETS["gossip"]


@CI_SETTINGS
@given(inputs_for("gossip"))
def test_gossip_hostile_bytes_end_in_documented_errors(data: bytes) -> None:
    assert_clean(TARGET, data)
