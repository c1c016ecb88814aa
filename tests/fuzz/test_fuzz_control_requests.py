"""Fuzz, bounded for CI: swarmd.control's handlers on request headers decoded as the control socket's RPC decodes
them. Only RpcError may come out, and a key handed to the daemon's dht_get is a schema key.

Crash, hang and over-allocation are defined in fuzz_oracle (docs/fuzzing.md); none is tolerated.
"""

from __future__ import annotations

from fuzz_oracle import assert_clean
from fuzz_strategies import CI_SETTINGS, inputs_for
from fuzz_targets import TARGETS
from hypothesis import given

TARGET = TARGETS["control"]


@CI_SETTINGS
@given(inputs_for("control"))
def test_control_hostile_bytes_end_in_documented_errors(data: bytes) -> None:
    assert_clean(TARGET, data)
