"""Fuzz, bounded for CI: swarmd.dht.protocol's parse_* validators on RPC metas decoded as the transport decodes
them, with every decoded record checked (records.check_record) and stored (storage.Storage.put), and
namespace_of on raw key bytes. Only the DHT's DHTError tree may come out.

Crash, hang and over-allocation are defined in fuzz_oracle (docs/fuzzing.md); none is tolerated.
"""

from __future__ import annotations

from fuzz_oracle import assert_clean
from fuzz_strategies import CI_SETTINGS, inputs_for
from fuzz_targets import TARGETS
from hypothesis import given

TARGET = TARGETS["dht"]


@CI_SETTINGS
@given(inputs_for("dht"))
def test_dht_hostile_bytes_end_in_documented_errors(data: bytes) -> None:
    assert_clean(TARGET, data)
