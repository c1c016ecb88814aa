"""Fuzz, bounded for CI: transport.codecs.decode_tensor with arbitrary metadata maps and buffers (writable and
read-only, aligned and not), for every codec. Only CodecError / LimitExceeded / ProtocolError may come
out, and a tensor that does decode has exactly the announced shape and dtype.

Crash, hang and over-allocation are defined in fuzz_oracle (docs/fuzzing.md); none is tolerated.
"""

from __future__ import annotations

from fuzz_oracle import assert_clean
from fuzz_strategies import CI_SETTINGS, inputs_for
from fuzz_targets import TARGETS
from hypothesis import given

TARGET = TARGETS["codecs"]


@CI_SETTINGS
@given(inputs_for("codecs"))
def test_codecs_hostile_bytes_end_in_documented_errors(data: bytes) -> None:
    assert_clean(TARGET, data)
