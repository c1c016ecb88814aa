"""Job spec validation: every bad spec is refused with a SpecError naming the offending field."""

import copy
import tomllib
import typing
from pathlib import Path

import msgpack
import pytest

from swarmd.job import JobSpec, SpecError, load_spec, parse_toml, resolve_sources
from swarmd.jobs.serving import job_limits
from swarmd.model import TransformerConfig
from swarmd.stage import StageLimits
from swarmd.stage.robust import AGGREGATES

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-lm.toml"


def minimal() -> dict:
    return {
        "name": "t",
        "steps": 3,
        "model": {"arch": "transformer-lm", "d_model": 32, "n_heads": 4},
        "data": {"files": ["data/*.txt"], "seq_len": 16},
        "batch": {"global_samples": 8, "microbatch_samples": 4},
    }


def with_(path: str, value) -> dict:
    raw = minimal()
    *parents, leaf = path.split(".")
    table = raw
    for key in parents:
        table = table.setdefault(key, {})
    table[leaf] = value
    return raw


def test_minimal_spec_fills_defaults():
    spec = JobSpec.from_dict(minimal())
    assert spec.seed == 0 and spec.pipeline.stages == 1
    assert spec.wire.activations == "fp16+lz4" and spec.wire.gradients == "fp16+lz4"
    assert spec.optim.name == "adamw" and spec.optim.betas == (0.9, 0.95)
    assert isinstance(spec.model.config, TransformerConfig)
    assert spec.model.config.d_ff == 128 and spec.model.config.max_seq_len == 16
    assert spec.batch.microbatches_per_step == 2


@pytest.mark.parametrize(
    ("path", "value", "field", "words"),
    [
        ("model.arch", "no-such-arch", "model.arch", "unknown architecture"),
        ("pipeline.stages", 0, "pipeline.stages", "at least 1"),
        ("batch.global_samples", 10, "batch.global_samples", "multiple"),
        ("optim.colour", 1, "optim.colour", "unknown key"),
        ("flavour", "x", "flavour", "unknown key"),
        ("model.d_modle", 1, "model.d_modle", "unknown key"),
        ("steps", "10", "steps", "integer"),
        ("seed", True, "seed", "integer"),
        ("optim.lr", "fast", "optim.lr", "number"),
        ("optim.lr", float("inf"), "optim.lr", "finite"),
        ("optim.weight_decay", float("nan"), "optim.weight_decay", "negative"),
        ("optim.betas", [0.9], "optim.betas", "2 items"),
        ("optim.name", "adam", "optim.name", "one of"),
        ("optim.schedule", "step", "optim.schedule", "one of"),
        ("wire.activations", "zstd", "wire.activations", "one of"),
        ("pipeline.delayed_updates", 1, "pipeline.delayed_updates", "true or false"),
        ("model.n_heads", 5, "model.n_heads", "divide"),
        ("model.dropout", 0.1, "model.dropout", "recomputes"),
        ("model.vocab", 100, "model.vocab", "256"),
        ("model.max_seq_len", 8, "model.max_seq_len", "seq_len"),
        ("data.tokens", "x.bin", "data.files", "exactly one"),
        ("data.seq_len", 0, "data.seq_len", "at least 1"),
        ("optim.min_lr", 1.0, "optim.min_lr", "optim.lr"),
        ("checkpoint.every_steps", -1, "checkpoint.every_steps", "negative"),
        ("name", "has space", "name", "letters"),
        ("batch", 3, "batch", "table"),
        ("optim.aggregate", "median", "optim.aggregate", "one of"),
        ("optim.clip_tau", 0, "optim.clip_tau", "positive"),
        ("optim.clip_tau", float("nan"), "optim.clip_tau", "finite"),
        ("optim.clip_iterations", 0, "optim.clip_iterations", "[1, 100]"),
        ("optim.clip_iterations", 10**6, "optim.clip_iterations", "[1, 100]"),
        ("optim.clip_iterations", 2.5, "optim.clip_iterations", "integer"),
        ("optim.outlier_factor", -1.0, "optim.outlier_factor", "positive"),
    ],
)
def test_bad_field_is_named(path, value, field, words):
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict(with_(path, value))
    assert info.value.field == field
    assert words in str(info.value)
    assert str(info.value).startswith(field + ":")


@pytest.mark.parametrize("missing", ["name", "steps", "model", "data", "batch"])
def test_missing_required_section(missing):
    raw = minimal()
    del raw[missing]
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict(raw)
    assert info.value.field == missing


def test_missing_arch_and_required_model_key():
    raw = minimal()
    del raw["model"]["arch"]
    with pytest.raises(SpecError, match=r"^model\.arch: is required"):
        JobSpec.from_dict(raw)
    raw = minimal()
    del raw["model"]["d_model"]
    with pytest.raises(SpecError, match=r"^model\.d_model: is required"):
        JobSpec.from_dict(raw)


def test_loading_a_spec_never_looks_for_its_data(tmp_path):
    """Steps: a spec whose data.files match nothing; load it, then resolve its data.
    Expected: loading succeeds (parsing walks no filesystem: a daemon that only serves stages
    never reads the data); resolving is what refuses, naming data.files and the pattern."""
    (tmp_path / "job.toml").write_text(EXAMPLE.read_text().replace('"{stdlib}/*.py"', '"nothing/*.txt"'))
    spec = load_spec(tmp_path / "job.toml")
    assert spec.name == "tiny-lm"
    with pytest.raises(SpecError) as info:
        resolve_sources(spec.data, tmp_path)
    assert info.value.field == "data.files" and "nothing/*.txt" in str(info.value)


def test_missing_token_file_is_refused_when_resolved(tmp_path):
    text = EXAMPLE.read_text().replace('files = ["{stdlib}/*.py"]', 'tokens = "train.bin"')
    (tmp_path / "job.toml").write_text(text)
    with pytest.raises(SpecError, match=r"^data\.tokens: .*train\.bin is not a file"):
        resolve_sources(load_spec(tmp_path / "job.toml").data, tmp_path)


def test_bad_toml_is_a_spec_error():
    with pytest.raises(SpecError, match="<toml>"):
        parse_toml("name = ")


def test_example_spec_loads():
    spec = load_spec(EXAMPLE)
    assert spec.pipeline.stages == 3 and spec.data.files == ("{stdlib}/*.py",)


def test_msgpack_round_trip_and_canonical_form():
    spec = load_spec(EXAMPLE)
    again = JobSpec.from_msgpack(spec.to_msgpack())
    assert again == spec
    assert again.to_msgpack() == spec.to_msgpack()
    # Writing a default explicitly, or an int for a float, does not change the canonical form.
    raw = tomllib.loads(EXAMPLE.read_text())
    raw["optim"]["lr"] = 3e-3
    raw["pipeline"]["microbatches_in_flight"] = 4
    raw["optim"]["clip_norm"] = 1
    assert JobSpec.from_dict(raw).to_msgpack() == spec.to_msgpack()
    assert list(spec.to_dict()) == sorted(spec.to_dict())
    assert list(spec.to_dict()["model"]) == sorted(spec.to_dict()["model"])


def test_from_msgpack_refuses_garbage_and_oversize():
    with pytest.raises(SpecError, match="msgpack"):
        JobSpec.from_msgpack(b"\xc1")
    with pytest.raises(SpecError, match="MAX_SPEC_BYTES"):
        JobSpec.from_msgpack(msgpack.packb({"name": "x" * 70000}))


def test_the_aggregate_defaults_to_the_exact_mean_with_the_stage_defaults():
    """Steps: a spec without the aggregate fields, then one asking for centered_clip with its own
    τ. Expected: the default is "mean" with StageLimits' own defaults (so a stage given no spec
    setting and one given the default spec combine alike) and the choices are the stage's; the
    chosen settings are read as given and round-trip through the canonical form."""
    optim = JobSpec.from_dict(minimal()).optim
    stage = StageLimits()
    assert (optim.aggregate, optim.clip_tau, optim.clip_iterations, optim.outlier_factor) == (
        stage.aggregate, stage.clip_tau, stage.clip_iterations, stage.outlier_factor) == ("mean", 10.0, 3, 2.0)
    assert typing.get_args(typing.get_type_hints(type(optim))["aggregate"]) == AGGREGATES
    raw = minimal()
    raw["optim"] = {"aggregate": "centered_clip", "clip_tau": 4, "clip_iterations": 5, "outlier_factor": 3}
    spec = JobSpec.from_dict(raw)
    assert (spec.optim.aggregate, spec.optim.clip_tau, spec.optim.clip_iterations, spec.optim.outlier_factor) == (
        "centered_clip", 4.0, 5, 3.0)
    assert JobSpec.from_msgpack(spec.to_msgpack()) == spec
    assert spec.job_id(b"a" * 32) != JobSpec.from_dict(minimal()).job_id(b"a" * 32)


def test_a_daemons_stage_limits_take_the_jobs_aggregate():
    """Steps: a daemon's StageLimits with its own queue size and a (different) aggregate of its own,
    given a centered_clip spec and then the default one. Expected: the served stage's limits keep
    the daemon's other fields and carry the spec's four aggregate fields, whatever the daemon had."""
    raw = minimal()
    raw["optim"] = {"aggregate": "centered_clip", "clip_tau": 4.0, "clip_iterations": 5, "outlier_factor": 3.0}
    daemon = StageLimits(queue_size=7, aggregate="mean", clip_tau=99.0)
    served = job_limits(daemon, JobSpec.from_dict(raw))
    assert (served.aggregate, served.clip_tau, served.clip_iterations, served.outlier_factor) == (
        "centered_clip", 4.0, 5, 3.0)
    assert served.queue_size == 7
    plain = job_limits(StageLimits(aggregate="centered_clip"), JobSpec.from_dict(minimal()))
    assert (plain.aggregate, plain.clip_tau) == ("mean", 10.0)


def test_the_allreduce_codec_is_the_jobs_choice_and_fp16_keeps_the_id():
    """Steps: the minimal spec, the same with `[wire] allreduce = "fp16"` written out, one with
    "none", one with int8; each given to a daemon whose StageLimits say otherwise. Expected: fp16
    is the default and StageLimits' own, and leaves the canonical form (and so the job id) what it
    was before the field existed; "none" is carried into the served stage's limits and changes the
    id; int8 is refused (no error feedback)."""
    plain = JobSpec.from_dict(minimal())
    assert plain.wire.allreduce == StageLimits().allreduce_codec == "fp16"
    assert "allreduce" not in plain.to_dict()["wire"]
    assert JobSpec.from_dict(with_("wire.allreduce", "fp16")).job_id(b"a" * 32) == plain.job_id(b"a" * 32)
    exact = JobSpec.from_dict(with_("wire.allreduce", "none"))
    assert exact.to_dict()["wire"]["allreduce"] == "none" and JobSpec.from_msgpack(exact.to_msgpack()) == exact
    assert exact.job_id(b"a" * 32) != plain.job_id(b"a" * 32)
    assert job_limits(StageLimits(allreduce_codec="fp16+lz4"), exact).allreduce_codec == "none"
    assert job_limits(StageLimits(allreduce_codec="none"), plain).allreduce_codec == "fp16"
    with pytest.raises(SpecError, match="allreduce"):
        JobSpec.from_dict(with_("wire.allreduce", "int8"))


def test_job_id_depends_on_spec_and_submitter():
    spec = JobSpec.from_dict(minimal())
    alice, bob = b"a" * 32, b"b" * 32
    assert spec.job_id(alice) == JobSpec.from_dict(copy.deepcopy(minimal())).job_id(alice)
    assert len(spec.job_id(alice)) == 32
    assert spec.job_id(alice) != spec.job_id(bob)
    assert spec.job_id(alice) != JobSpec.from_dict(with_("seed", 1)).job_id(alice)
