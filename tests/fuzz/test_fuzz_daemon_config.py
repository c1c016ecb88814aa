"""Fuzz, bounded for CI: swarmd.config.read_file + build on arbitrary config file bytes, then the --check-config
TOML (to_toml) must load back to the same config. Only swarmd.config.ConfigError may come out.

Crash, hang and over-allocation are defined in fuzz_oracle (docs/fuzzing.md); none is tolerated.
"""

from __future__ import annotations

from fuzz_oracle import assert_clean
from fuzz_strategies import CI_SETTINGS, inputs_for
from fuzz_targets import TARGETS
from hypothesis import given

TARGET = TARGETS["config"]


@CI_SETTINGS
@given(inputs_for("config"))
def test_config_hostile_bytes_end_in_documented_errors(data: bytes) -> None:
    assert_clean(TARGET, data)
