"""Fuzz, bounded for CI: transport.handshake: a fuzzed peer hello and proof against our fixed side (with and
without swarm key, as initiator and responder), then Limits.from_dict on what it announced. Only
HandshakeError may come out (MalformedFrame from the limits is converted by the connection).

Crash, hang and over-allocation are defined in fuzz_oracle (docs/fuzzing.md); none is tolerated.
"""

from __future__ import annotations

from fuzz_oracle import assert_clean
from fuzz_strategies import CI_SETTINGS, inputs_for
from fuzz_targets import TARGETS
from hypothesis import given

TARGET = TARGETS["handshake"]


@CI_SETTINGS
@given(inputs_for("handshake"))
def test_handshake_hostile_bytes_end_in_documented_errors(data: bytes) -> None:
    assert_clean(TARGET, data)
