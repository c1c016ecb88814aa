"""Data: byte tokenizer, .bin token files, and the seeded order every trainer and the reference share."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from swarmd.job import (
    BatchSampler,
    BatchSpec,
    ByteTokenizer,
    DataError,
    DataSpec,
    SpecError,
    TokenDataset,
    open_training_data,
    read_tokens,
    resolve_sources,
)

torch.set_num_threads(1)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids.dtype == np.uint8 and list(ids[:2]) == [104, 0xC3]
    assert tok.decode(ids) == "héllo".encode()
    assert tok.vocab == 256


def test_text_files_are_read_in_path_order(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"BBB")
    (tmp_path / "a.txt").write_bytes(b"AA")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_bytes(b"C")
    sources = resolve_sources(DataSpec(seq_len=2, files=("*.txt", "**/*.txt")), tmp_path)
    assert [p.name for p in sources.files] == ["a.txt", "b.txt", "c.txt"]
    assert read_tokens(sources).tobytes() == b"AABBBC"


def test_text_over_the_limit_is_refused_before_reading(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"x" * 100)
    sources = resolve_sources(DataSpec(seq_len=2, files=("a.txt",)), tmp_path)
    with pytest.raises(SpecError, match="max_text_bytes"):
        read_tokens(sources, max_text_bytes=99)


def test_stdlib_placeholder_resolves():
    sources = resolve_sources(DataSpec(seq_len=8, files=("{stdlib}/json/*.py",)), "/nonexistent")
    assert any(p.name == "decoder.py" for p in sources.files)


def test_bin_file_is_memory_mapped_little_endian_uint16(tmp_path):
    ids = np.array([1, 2, 300, 65535, 7], dtype="<u2")
    ids.tofile(tmp_path / "train.bin")
    tokens = read_tokens(resolve_sources(DataSpec(seq_len=2, tokens="train.bin"), tmp_path))
    assert isinstance(tokens, np.memmap)
    assert tokens.tolist() == [1, 2, 300, 65535, 7]
    assert (tmp_path / "train.bin").read_bytes()[4:6] == b"\x2c\x01"  # 300, little-endian


def test_bin_file_of_odd_size_is_refused(tmp_path):
    (tmp_path / "train.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(SpecError, match=r"^data\.tokens: .*whole number"):
        read_tokens(resolve_sources(DataSpec(seq_len=2, tokens="train.bin"), tmp_path))


def test_samples_are_windows_with_shifted_targets():
    ds = TokenDataset(np.arange(11, dtype=np.uint16), seq_len=3, vocab=100)
    assert len(ds) == 3  # 10 usable targets // 3
    x, y = ds.samples(np.array([2, 0]))
    assert x.dtype == torch.int64 and x.tolist() == [[6, 7, 8], [0, 1, 2]]
    assert y.tolist() == [[7, 8, 9], [1, 2, 3]]


def test_token_outside_vocabulary_is_a_data_error():
    ds = TokenDataset(np.array([1, 2, 900, 3, 4], dtype=np.uint16), seq_len=2, vocab=512)
    with pytest.raises(DataError, match="900"):
        ds.samples(np.array([1]))


def test_sampler_is_a_function_of_seed_step_and_microbatch():
    a = BatchSampler(num_samples=100, global_samples=12, microbatch_samples=4, seed=7)
    b = BatchSampler(num_samples=100, global_samples=12, microbatch_samples=4, seed=7)
    # b is queried out of order: the answer does not depend on what was asked before.
    for step in (20, 3, 0, 9, 8):
        for mb in (2, 0, 1):
            assert np.array_equal(a.microbatch_indices(step, mb), b.microbatch_indices(step, mb))
    other = BatchSampler(num_samples=100, global_samples=12, microbatch_samples=4, seed=8)
    assert not np.array_equal(a.step_indices(0), other.step_indices(0))


def test_microbatches_of_a_step_are_disjoint_and_make_the_global_batch():
    s = BatchSampler(num_samples=50, global_samples=12, microbatch_samples=4, seed=1)
    for step in range(20):  # crosses several epochs (4 steps each)
        parts = [s.microbatch_indices(step, mb) for mb in range(3)]
        joined = np.concatenate(parts)
        assert len(set(joined.tolist())) == 12
        assert np.array_equal(joined, s.step_indices(step))
    first_epoch = np.concatenate([s.step_indices(step) for step in range(4)])
    assert len(set(first_epoch.tolist())) == 48  # no sample twice within an epoch


def test_microbatch_ids_are_stable_and_invertible():
    s = BatchSampler(num_samples=50, global_samples=12, microbatch_samples=4, seed=1)
    assert s.microbatch_id(5, 2) == 17
    assert s.split_id(17) == (5, 2)
    with pytest.raises(ValueError):
        s.microbatch_indices(0, 3)


def test_too_little_data_for_one_global_batch_is_refused():
    with pytest.raises(SpecError, match=r"^batch\.global_samples"):
        BatchSampler(num_samples=10, global_samples=12, microbatch_samples=4, seed=1)


def test_training_data_yields_the_sampled_windows(tmp_path):
    (tmp_path / "t.txt").write_bytes(bytes(range(256)) * 4)
    data = open_training_data(DataSpec(seq_len=8, files=("t.txt",)), BatchSpec(16, 4), vocab=256, seed=3,
                              base_dir=tmp_path)
    mb = data.microbatch(2, 1)
    assert mb.id == 2 * 4 + 1 and mb.inputs.shape == (4, 8)
    expected = torch.tensor([[(i * 8 + t) % 256 for t in range(8)] for i in mb.sample_indices])
    assert torch.equal(mb.inputs, expected)
    assert torch.equal(mb.targets, (expected + 1) % 256)


def _tree(root):
    """Files at several depths, hidden ones, and a symlink loop back to the root."""
    for rel in ("a.txt", "b.py", ".hidden.txt", "d/c.txt", "d/e/f.txt", "d/.h/g.txt", ".dot/i.txt"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x" * 8)
    (root / "d" / "loop").symlink_to(root, target_is_directory=True)


@pytest.mark.parametrize("pattern", ["*.txt", "**/*.txt", "d/**", "d/*/f.txt", "**/[ab].*", ".*", ".dot/*", "d/e/f.txt"])
def test_data_globs_match_like_glob_without_following_links_in_double_star(tmp_path, pattern):
    """Steps: a tree with hidden files and a symlink loop; expand a pattern through the spec.
    Expected: the same regular files as Python's glob finds, except that `**` never enters the
    symlinked directory (glob follows it, once per level)."""
    import glob

    _tree(tmp_path)
    got = resolve_sources(DataSpec(seq_len=2, files=(pattern,)), tmp_path).files
    want = {p for p in map(Path, glob.glob(str(tmp_path / pattern), recursive=True))
            if p.is_file() and "loop" not in p.relative_to(tmp_path).parts}
    assert set(got) == want and got == tuple(sorted(want))


def test_data_globs_past_the_file_limit_are_refused_naming_data_files(tmp_path):
    """Steps: 30 files; a spec matching them all with GlobLimits(max_files=29), then 30.
    Expected: SpecError on data.files naming the limit; at 30 all are found."""
    from swarmd.job.sources import GlobLimits

    for i in range(30):
        (tmp_path / f"{i:02}.txt").write_bytes(b"x")
    spec = DataSpec(seq_len=2, files=("*.txt", "0*.txt"))
    with pytest.raises(SpecError, match="max_files") as err:
        resolve_sources(spec, tmp_path, GlobLimits(max_files=29))
    assert err.value.field == "data.files" and "'*.txt'" in str(err.value)
    assert len(resolve_sources(spec, tmp_path, GlobLimits(max_files=30)).files) == 30


def test_a_glob_over_the_whole_filesystem_stops_at_the_entry_limit():
    """Steps: `/**/no-such-file-*` (matches nothing, so only the walk's own bound can end it
    early) with the default GlobLimits, over this machine's real filesystem.
    Expected: SpecError on data.files naming max_entries, not a walk of every directory."""
    with pytest.raises(SpecError, match="max_entries") as err:
        resolve_sources(DataSpec(seq_len=2, files=("/**/no-such-file-*",)), "/")
    assert err.value.field == "data.files"


def test_an_entry_limit_counts_every_pattern_of_a_spec(tmp_path):
    """Steps: 10 files; patterns `*.txt` and `[0-4].txt`, each listing the directory once, with
    max_entries 15.
    Expected: the second listing passes the bound: refused, naming that pattern as the spec
    wrote it; with max_entries 20 both pass."""
    from swarmd.job.sources import GlobLimits

    for i in range(10):
        (tmp_path / f"{i}.txt").write_bytes(b"x")
    spec = DataSpec(seq_len=2, files=("*.txt", "[0-4].txt"))
    with pytest.raises(SpecError, match="max_entries") as err:
        resolve_sources(spec, tmp_path, GlobLimits(max_entries=15))
    assert "'[0-4].txt' looks at more than 15" in str(err.value)
    assert len(resolve_sources(spec, tmp_path, GlobLimits(max_entries=20)).files) == 10


def test_a_path_the_daemon_may_not_stat_is_no_match_not_a_crash():
    """Steps: a data.files pattern naming /proc/1/cwd, which even root may not stat in a
    container without ptrace rights (the path a fuzzed `/**/*` glob met first).
    Expected: SpecError "matches no files" on data.files, not PermissionError."""
    try:
        os.stat("/proc/1/cwd")
    except PermissionError:
        pass
    else:
        pytest.skip("/proc/1/cwd can be stat'ed here: no unstatable path to try")
    with pytest.raises(SpecError, match="matches no files") as err:
        resolve_sources(DataSpec(seq_len=2, files=("/proc/1/cwd", "/proc/1/cwd/*")), "/")
    assert err.value.field == "data.files"
