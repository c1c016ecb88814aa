"""Token files of uint16 or uint32 ids: memory-mapped (a huge file costs no memory), the width
checked against the model's vocabulary, ids past the vocabulary refused where they are read."""

import resource

import numpy as np
import pytest

from swarmd.job import JobSpec, SpecError
from swarmd.job.data import DataError
from swarmd.job.sources import open_training_data, read_tokens, resolve_sources
from swarmd.job.spec import BatchSpec, DataSpec
from swarmd.tokenfile import TokenFileError, map_tokens, write_tokens


def spec_dict(vocab: int, **data) -> dict:
    return {"name": "t", "steps": 1, "model": {"arch": "llama", "d_model": 32, "n_heads": 4, "vocab": vocab},
            "data": {"seq_len": 8, "tokens": "/t.bin", **data}, "batch": {"global_samples": 2, "microbatch_samples": 1}}


def test_vocabulary_over_65536_needs_uint32():
    spec = JobSpec.from_dict(spec_dict(100_000, token_dtype="uint32"))
    assert spec.data.token_dtype == "uint32" and spec.to_dict()["data"]["token_dtype"] == "uint32"
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert "token_dtype" not in JobSpec.from_dict(spec_dict(50_000)).to_dict()["data"]  # default: ids unchanged
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict(spec_dict(100_000))
    assert info.value.field == "model.vocab" and "uint32" in info.value.message
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict({**spec_dict(256), "data": {"seq_len": 8, "files": ["x"], "token_dtype": "uint32"}})
    assert info.value.field == "data.token_dtype"


def test_uint32_ids_train_and_out_of_vocabulary_ids_are_refused(tmp_path):
    ids = (np.arange(1000, dtype=np.int64) * 7919) % 100_000 + 65_536 // 2
    write_tokens(tmp_path / "t.bin", ids, "uint32")
    data = DataSpec(seq_len=8, tokens="t.bin", token_dtype="uint32")
    training = open_training_data(data, BatchSpec(4, 2), vocab=100_000 + 65_536, seed=1, base_dir=tmp_path)
    mb = training.microbatch(0, 0)
    for row, index in zip(mb.inputs, mb.sample_indices):
        assert row.tolist() == ids[index * 8: index * 8 + 8].tolist()
    assert int(mb.inputs.max()) > 65_535
    small = open_training_data(data, BatchSpec(4, 2), vocab=1000, seed=1, base_dir=tmp_path)
    with pytest.raises(DataError, match="outside the model's vocabulary"):
        small.microbatch(0, 0)
    with pytest.raises(TokenFileError):
        write_tokens(tmp_path / "bad.bin", np.array([70_000]), "uint16")


def test_a_partial_id_is_refused(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\0" * 6)
    with pytest.raises(SpecError, match="not a whole number of uint32 tokens"):
        read_tokens(resolve_sources(DataSpec(seq_len=1, tokens="odd.bin", token_dtype="uint32"), tmp_path))
    with pytest.raises(TokenFileError):
        map_tokens(tmp_path / "odd.bin", "uint32")
    assert len(map_tokens(tmp_path / "odd.bin", "uint16")) == 3


def test_a_huge_file_is_mapped_not_read(tmp_path):
    """A 4 GiB (sparse) file: opening it and drawing a batch leaves resident memory where it was."""
    path = tmp_path / "huge.bin"
    with open(path, "wb") as f:
        f.truncate(4 << 30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    data = DataSpec(seq_len=256, tokens="huge.bin", token_dtype="uint32")
    tokens = read_tokens(resolve_sources(data, tmp_path))
    assert isinstance(tokens, np.memmap) and len(tokens) == 1 << 30
    training = open_training_data(data, BatchSpec(8, 4), vocab=1000, seed=0, base_dir=tmp_path)
    assert int(training.microbatch(3, 1).inputs.sum()) == 0
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 64 * 1024, f"resident memory grew {grown} KiB"
