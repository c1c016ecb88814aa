"""Fuzz, bounded for CI: transport.wire.FrameDecoder: preludes, length tables, headers and chunked messages,
fed whole and in small pieces. Only ProtocolError subclasses may come out; both feeding patterns
must decode alike; allocation stays under max_inflight_bytes + 4 x max_frame_bytes (+ header objects).

Crash, hang and over-allocation are defined in fuzz_oracle (docs/fuzzing.md); none is tolerated.
"""

from __future__ import annotations

from fuzz_oracle import assert_clean
from fuzz_strategies import CI_SETTINGS, inputs_for
from fuzz_targets import TARGETS
from hypothesis import given

TARGET = TARGETS["frames"]


@CI_SETTINGS
@given(inputs_for("frames"))
def test_frames_hostile_bytes_end_in_documented_errors(data: bytes) -> None:
    assert_clean(TARGET, data)
