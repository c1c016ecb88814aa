"""Fuzz, bounded for CI: every kind of swarmd value read from the DHT (`swarmd.values`). Each target
must swallow what its schema refuses (counted, never raised: `expected` is empty), and what it
accepts must hold its declared types and bounds.

Crash, hang and over-allocation are defined in fuzz_oracle (docs/fuzzing.md); none is tolerated.
"""

from __future__ import annotations

import msgpack
import pytest
from fuzz_oracle import assert_clean
from fuzz_strategies import CI_SETTINGS, msgpack_values, mutated
from fuzz_values import VALUE_TARGETS
from hypothesis import given
from hypothesis import strategies as st

FIELDS = {
    "value_announcement": ["addr", "samples_per_s", "queue", "step", "state"],
    "value_end": ["state", "step", "at", "by"],
}


def near_misses(name: str) -> st.SearchStrategy[bytes]:
    """A seed's map (or list) with fields replaced by any msgpack value: wrong types, huge numbers."""
    target = VALUE_TARGETS[name]
    seed = msgpack.unpackb(target.seeds()[0], raw=False)

    @st.composite
    def build(draw) -> bytes:
        if isinstance(seed, dict):
            value = dict(seed)
            for key in draw(st.lists(st.sampled_from(FIELDS.get(name, list(seed))), max_size=3)):
                if draw(st.booleans()):
                    value[key] = draw(msgpack_values)
                else:
                    value.pop(key, None)
        else:
            value = draw(st.lists(st.one_of(st.binary(min_size=31, max_size=33), msgpack_values), max_size=12))
        return msgpack.packb(value, use_bin_type=True)

    return build()


def inputs(name: str) -> st.SearchStrategy[bytes]:
    target = VALUE_TARGETS[name]
    return st.one_of(mutated(target.seeds()), near_misses(name), st.binary(max_size=512),
                     msgpack_values.map(lambda v: msgpack.packb(v, use_bin_type=True)))


@pytest.mark.parametrize("name", sorted(VALUE_TARGETS))
def test_dht_values_hostile_bytes_are_refused_without_raising(name: str) -> None:
    @CI_SETTINGS
    @given(inputs(name))
    def run(data: bytes) -> None:
        assert_clean(VALUE_TARGETS[name], data)

    run()


@pytest.mark.parametrize("name", sorted(VALUE_TARGETS))
def test_dht_values_seeds_pass_the_oracle(name: str) -> None:
    for seed in VALUE_TARGETS[name].seeds():
        assert_clean(VALUE_TARGETS[name], seed)
