"""Fuzz, bounded for CI: swarmd.job.spec: TOML text through parse_toml and DHT bytes through JobSpec.from_msgpack.
Only SpecError may come out; a spec that parses must load back from its canonical msgpack unchanged.

Crash, hang and over-allocation are defined in fuzz_oracle (docs/fuzzing.md); none is tolerated.
"""

from __future__ import annotations

from fuzz_oracle import assert_clean
from fuzz_strategies import CI_SETTINGS, inputs_for
from fuzz_targets import TARGETS
from hypothesis import given

TARGET = TARGETS["jobspec"]


@CI_SETTINGS
@given(inputs_for("jobspec"))
def test_jobspec_hostile_bytes_end_in_documented_errors(data: bytes) -> None:
    assert_clean(TARGET, data)
