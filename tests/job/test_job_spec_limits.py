"""Upper bounds on every spec field: a value past its `LIMITS` entry is refused with a SpecError that
names the field and the limit's constant; at the limit it parses. A spec comes from any peer of
the swarm, so these are what keep `stages = 10^9` from making every daemon loop for ever."""

from __future__ import annotations

import copy
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.job import JobSpec, SpecError
from swarmd.job.spec import LIMITS

BASE = {
    "name": "bounds", "steps": 3,
    "model": {"arch": "transformer-lm", "d_model": 32, "n_heads": 4},
    "data": {"files": ["data/*.txt"], "seq_len": 16},
    "batch": {"global_samples": 8, "microbatch_samples": 4},
}


def spec_with(field: str, value) -> dict:
    """BASE with `field` set to `value`, and the fields it must agree with moved along, so the
    limit is the only thing wrong with it."""
    raw = copy.deepcopy(BASE)
    section, _, name = field.rpartition(".")
    table = raw.setdefault(section, {}) if section else raw
    if field in ("data.files", "eval.files"):
        table["files"] = [f"p{i}/*.txt" for i in range(value)]
        if field == "eval.files":
            table.update(every_steps=1, samples=1)
        return raw
    if field == "batch.microbatches_per_step":
        raw["batch"] = {"global_samples": value, "microbatch_samples": 1}
        return raw
    table[name] = value
    if field in ("data.seq_len", "model.max_seq_len"):
        raw["data"]["seq_len"] = value if field == "data.seq_len" else 16
    if field == "model.n_heads":
        raw["model"]["d_model"] = value  # one dimension per head
    if field == "model.d_model":
        raw["model"]["n_heads"] = 1
    if field == "batch.microbatch_samples":
        raw["batch"]["global_samples"] = value
    if field == "batch.global_samples":
        raw["batch"]["microbatch_samples"] = value // 256  # within its own limit at global's
    if field == "optim.min_lr":
        raw["optim"]["lr"] = value
    if section == "eval":  # an enabled [eval] whose work stays within MAX_EVAL_SHARE of training's
        table.setdefault("every_steps", 10**6)
        table.setdefault("samples", 1)
        table.setdefault("holdout", 0.1)
    return raw


#: Fields whose values past their own limit must stay within another's: a step's microbatches and
#: a microbatch's samples are within its global samples, heads divide d_model.
CEILING = {"batch.microbatches_per_step": LIMITS["batch.global_samples"].value,
           "batch.microbatch_samples": LIMITS["batch.global_samples"].value,
           "model.n_heads": LIMITS["model.d_model"].value}


def over(field: str, limit) -> st.SearchStrategy:
    if isinstance(limit.value, float):
        return st.floats(min_value=limit.value, max_value=1e300, exclude_min=True, allow_nan=False)
    return st.integers(min_value=limit.value + 1, max_value=CEILING.get(field, limit.value * 1000))


@pytest.mark.parametrize("field", sorted(LIMITS))
def test_a_value_at_the_limit_parses(field: str) -> None:
    assert JobSpec.from_dict(spec_with(field, LIMITS[field].value)).name == "bounds"


@pytest.mark.parametrize("field", sorted(LIMITS))
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_every_field_past_its_limit_is_refused_naming_field_and_limit(field: str, data) -> None:
    limit = LIMITS[field]
    value = data.draw(over(field, limit))
    if field == "batch.global_samples":
        value = value - value % 256 + 256  # a multiple of the microbatch size spec_with picks
    with pytest.raises(SpecError) as refused:
        JobSpec.from_dict(spec_with(field, value))
    assert refused.value.field == field
    assert f"over {limit.name} ({limit.value})" in refused.value.message


def test_infinite_and_huge_floats_are_refused() -> None:
    for field in ("optim.clip_norm", "optim.lr", "optim.weight_decay"):
        with pytest.raises(SpecError) as refused:
            JobSpec.from_dict(spec_with(field, math.inf))
        assert refused.value.field == field


def test_a_billion_stages_is_refused_at_parse() -> None:
    """Issue 13: `stages = 10^9` made every daemon loop DHT reads over range(stages)."""
    with pytest.raises(SpecError, match=r"^pipeline\.stages: is 1000000000, over MAX_STAGES \(64\)"):
        JobSpec.from_dict(spec_with("pipeline.stages", 10**9))


def test_every_limit_says_why() -> None:
    for field, limit in LIMITS.items():
        assert limit.name.startswith("MAX_") and limit.why and limit.value > 0, field
