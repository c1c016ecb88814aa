"""[eval]: the spec table (defaults, bad values refused naming the field, bounds on the work a remote
spec can ask for) and the held-out split (deterministic from the seed; training never samples a
held-out window, over several epochs)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from swarmd.job import BatchSpec, EvalSpec, JobSpec, SpecError, TokenDataset, TrainingData
from swarmd.job.data import held_out_split
from swarmd.job.spec import LIMITS, MAX_EVAL_SHARE

torch.set_num_threads(1)

BASE = {
    "name": "evaluated", "steps": 10,
    "model": {"arch": "transformer-lm", "d_model": 32, "n_heads": 4},
    "data": {"files": ["data/*.txt"], "seq_len": 16},
    "batch": {"global_samples": 8, "microbatch_samples": 4},
}


def spec(**eval_table) -> JobSpec:
    raw = copy.deepcopy(BASE)
    raw["eval"] = eval_table
    return JobSpec.from_dict(raw)


def refused(**eval_table) -> SpecError:
    with pytest.raises(SpecError) as caught:
        spec(**eval_table)
    return caught.value


def test_without_eval_the_canonical_form_and_job_id_are_unchanged() -> None:
    plain = JobSpec.from_dict(copy.deepcopy(BASE))
    assert plain.eval == EvalSpec() and not plain.eval.enabled
    assert "eval" not in plain.to_dict()
    assert spec() == plain  # an empty [eval] table is the default
    assert spec().job_id(b"k" * 32) == plain.job_id(b"k" * 32)


def test_eval_round_trips_through_the_canonical_form_and_changes_the_id() -> None:
    evaluated = spec(every_steps=5, samples=16, holdout=0.1)
    assert evaluated.to_dict()["eval"] == {"every_steps": 5, "holdout": 0.1, "samples": 16}
    assert JobSpec.from_msgpack(evaluated.to_msgpack()) == evaluated
    assert evaluated.job_id(b"k" * 32) != JobSpec.from_dict(copy.deepcopy(BASE)).job_id(b"k" * 32)


@pytest.mark.parametrize("table, field, words", [
    ({"every_steps": -1}, "eval.every_steps", "must not be negative"),
    ({"samples": 4}, "eval.every_steps", "must be at least 1 when"),
    ({"holdout": 0.1}, "eval.every_steps", "must be at least 1 when"),
    ({"every_steps": 2, "holdout": 0.1}, "eval.samples", "must be at least 1"),
    ({"every_steps": 2, "samples": 4}, "eval.holdout", "must be a positive fraction"),
    ({"every_steps": 2, "samples": 4, "holdout": float("nan")}, "eval.holdout", "must be a positive fraction"),
    ({"every_steps": 2, "samples": 4, "holdout": 0.6}, "eval.holdout", "over MAX_HOLDOUT (0.5)"),
    ({"every_steps": 2, "samples": 4, "holdout": 0.1, "files": ["x"]}, "eval.files", "exactly one of"),
    ({"every_steps": 2, "samples": 4, "files": []}, "eval.files", "at least one pattern"),
    ({"files": ["x"]}, "eval.every_steps", "must be at least 1 when"),
    ({"every_steps": 2, "samples": 4, "files": [f"p{i}" for i in range(65)]}, "eval.files",
     "over MAX_DATA_PATTERNS (64)"),
    ({"every_steps": 2, "samples": 4, "colour": 1}, "eval.colour", "unknown key"),
    ({"every_steps": 2.5, "samples": 4, "holdout": 0.1}, "eval.every_steps", "must be an integer"),
    ({"every_steps": 1, "samples": 65_537, "holdout": 0.1}, "eval.samples", "over MAX_EVAL_SAMPLES (65536)"),
])
def test_bad_eval_tables_are_refused_naming_the_field(table, field, words) -> None:
    error = refused(**table)
    assert error.field == field and words in error.message, error


def test_eval_files_round_trip_and_with_token_data_name_one_file() -> None:
    evaluated = spec(every_steps=5, samples=16, files=["valid/*.txt"])
    assert evaluated.to_dict()["eval"] == {"every_steps": 5, "files": ["valid/*.txt"], "holdout": 0.0, "samples": 16}
    assert JobSpec.from_msgpack(evaluated.to_msgpack()) == evaluated
    assert "files" not in spec(every_steps=5, samples=16, holdout=0.1).to_dict()["eval"]
    raw = copy.deepcopy(BASE)
    raw["data"] = {"tokens": "train.bin", "seq_len": 16}
    raw["eval"] = {"every_steps": 5, "samples": 16, "files": ["a.bin", "b.bin"]}
    with pytest.raises(SpecError) as caught:
        JobSpec.from_dict(raw)
    assert caught.value.field == "eval.files" and "one token file" in caught.value.message
    raw["eval"]["files"] = ["valid.bin"]
    assert JobSpec.from_dict(raw).eval.files == ("valid.bin",)


def test_evaluation_may_not_outweigh_training() -> None:
    """A remote spec must not turn serving daemons into evaluators: eval.samples is bounded by the
    samples trained between two evaluations (MAX_EVAL_SHARE)."""
    assert MAX_EVAL_SHARE == 1
    assert spec(every_steps=2, samples=16, holdout=0.1).eval.samples == 16  # 2 steps x 8 samples
    error = refused(every_steps=2, samples=17, holdout=0.1)
    assert error.field == "eval.samples" and "over MAX_EVAL_SHARE (1)" in error.message
    assert set(LIMITS) >= {"eval.every_steps", "eval.samples", "eval.holdout"}


def test_due_after_every_every_steps_commits_and_after_the_last() -> None:
    evaluation = EvalSpec(every_steps=3, samples=1, holdout=0.1)
    assert [c for c in range(0, 11) if evaluation.due(c, 10)] == [3, 6, 9, 10]
    assert not any(EvalSpec().due(c, 10) for c in range(11))


def test_the_split_is_the_seeds_and_disjoint() -> None:
    held, train = held_out_split(1000, 0.1, seed=5)
    assert len(held) == 100 and len(train) == 900
    assert not set(held.tolist()) & set(train.tolist())
    assert sorted([*held.tolist(), *train.tolist()]) == list(range(1000))
    again, _ = held_out_split(1000, 0.1, seed=5)
    assert np.array_equal(held, again)
    other, _ = held_out_split(1000, 0.1, seed=6)
    assert not np.array_equal(held, other)


def dataset(samples: int, seq_len: int = 4) -> TokenDataset:
    # Token i*T is i mod 256: each window's first input names its sample... modulo 256, so use
    # fewer than 256 samples to read a sample's index back from its tokens.
    tokens = np.array([(i // seq_len) % 256 for i in range(samples * seq_len + 1)], dtype=np.uint8)
    return TokenDataset(tokens, seq_len, 256)


def test_training_never_samples_a_held_out_window_over_many_epochs() -> None:
    data = TrainingData(dataset(200), BatchSpec(8, 4), seed=11, evaluation=EvalSpec(5, 12, 0.25))
    held = set(data.eval_indices.tolist())
    assert len(held) == 12
    held_all, _ = held_out_split(200, 0.25, 11)
    assert held <= set(held_all.tolist())
    trained = set()
    steps = 5 * data.sampler.steps_per_epoch  # five epochs
    for step in range(steps):
        for index in range(2):
            mb = data.microbatch(step, index)
            trained |= set(mb.sample_indices.tolist())
            assert torch.equal(mb.inputs[:, 0], torch.from_numpy(mb.sample_indices % 256))  # the windows read
    assert not trained & set(held_all.tolist())
    assert len(trained) == 150  # every training sample is used: 200 - 50 held out


def test_eval_batches_cover_the_held_out_samples_in_microbatch_sized_pieces() -> None:
    data = TrainingData(dataset(200), BatchSpec(8, 4), seed=11, evaluation=EvalSpec(5, 10, 0.25))
    batches = [data.eval_batch(i) for i in range(data.eval_batch_count())]
    assert [len(b.sample_indices) for b in batches] == [4, 4, 2]
    assert np.array_equal(np.concatenate([b.sample_indices for b in batches]), data.eval_indices)
    assert torch.equal(batches[0].inputs[:, 0], torch.from_numpy(batches[0].sample_indices % 256))
    with pytest.raises(ValueError):
        data.eval_batch(3)


def test_without_eval_the_sample_order_is_what_it_was() -> None:
    plain = TrainingData(dataset(100), BatchSpec(8, 4), seed=3)
    assert plain.eval_batch_count() == 0
    from swarmd.job import BatchSampler
    sampler = BatchSampler(100, 8, 4, 3)
    assert np.array_equal(plain.microbatch(4, 1).sample_indices, sampler.microbatch_indices(4, 1))


def test_eval_files_are_their_own_data_set_and_training_keeps_all_of_its_own() -> None:
    evaluation = EvalSpec(every_steps=5, samples=10, files=("valid.txt",))
    valid = TokenDataset(np.array([(i // 4 + 100) % 256 for i in range(30 * 4 + 1)], dtype=np.uint8), 4, 256)
    data = TrainingData(dataset(40), BatchSpec(8, 4), seed=11, evaluation=evaluation, eval_dataset=valid)
    assert data.training_indices is None and data.sampler.num_samples == 40
    assert len(data.eval_indices) == 10 and len(set(data.eval_indices.tolist())) == 10
    batch = data.eval_batch(0)
    assert torch.equal(batch.inputs[:, 0], torch.from_numpy((batch.sample_indices + 100) % 256))  # valid's windows
    again = TrainingData(dataset(40), BatchSpec(8, 4), seed=11, evaluation=evaluation, eval_dataset=valid)
    assert np.array_equal(again.eval_indices, data.eval_indices)
    # Without the eval data (a trainer that evaluates nothing) there are no held-out samples.
    assert TrainingData(dataset(40), BatchSpec(8, 4), seed=11, evaluation=evaluation).eval_batch_count() == 0
    with pytest.raises(SpecError) as caught:
        TrainingData(dataset(40), BatchSpec(8, 4), seed=11, evaluation=EvalSpec(5, 31, files=("v",)), eval_dataset=valid)
    assert caught.value.field == "eval.files" and "hold 30 samples" in caught.value.message


def test_open_training_data_reads_eval_files_beside_the_spec(tmp_path) -> None:
    from swarmd.job import DataSpec, open_training_data

    (tmp_path / "train.txt").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "valid.txt").write_bytes(b"held out text, never trained on. " * 20)
    evaluation = EvalSpec(every_steps=2, samples=6, files=("valid.txt",))
    data = open_training_data(DataSpec(seq_len=8, files=("train.txt",)), BatchSpec(8, 4), 256, 3, tmp_path,
                              evaluation=evaluation)
    batch = data.eval_batch(0)
    text = (tmp_path / "valid.txt").read_bytes()
    for row, i in zip(batch.inputs, batch.sample_indices):
        assert bytes(row.tolist()) == text[i * 8: i * 8 + 8]
    with pytest.raises(SpecError) as caught:
        open_training_data(DataSpec(seq_len=8, files=("train.txt",)), BatchSpec(8, 4), 256, 3, tmp_path,
                           evaluation=EvalSpec(2, 6, files=("missing/*.txt",)))
    assert caught.value.field == "eval.files" and "matches no files" in caught.value.message


def test_too_small_a_holdout_for_the_samples_is_a_clear_error() -> None:
    with pytest.raises(SpecError) as caught:
        TrainingData(dataset(100), BatchSpec(8, 4), seed=3, evaluation=EvalSpec(5, 40, 0.2))
    assert caught.value.field == "eval.holdout" and "holds out 20 of the data's 100 samples" in caught.value.message
    with pytest.raises(SpecError) as caught:
        TrainingData(dataset(20), BatchSpec(16, 4), seed=3, evaluation=EvalSpec(5, 2, 0.5))
    assert caught.value.field == "batch.global_samples"
