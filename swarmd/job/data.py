"""Training data and its order: the same (seed, step, microbatch) gives the same samples everywhere.

A dataset is one long token stream, either text files read as bytes by the byte-level tokenizer or a
`.bin` token file (raw little-endian uint16 as nanoGPT's, or uint32; memory-mapped: swarmd.tokenfile). Sample i is the window of `seq_len`
tokens at `i * seq_len` with its next-token targets. Each epoch is a seeded permutation of the
samples cut into whole global batches (the remainder is skipped, a different one each epoch), so the
samples of a step are always distinct; step s's batch is split in order into microbatches whose ids
are stable, which is what lets stage peers refuse a duplicate and lets a single-process reference
see exactly the samples the swarm saw.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from swarmd.job.errors import DataError, SpecError
from swarmd.tokenfile import TokenDtype, TokenFileError, map_tokens

if TYPE_CHECKING:
    from swarmd.job.spec import BatchSpec, DataSpec

# Text files are loaded into memory; past this, pre-tokenize them into a memory-mapped `.bin` file.
MAX_TEXT_BYTES = 1 << 30
STDLIB_PLACEHOLDER = "{stdlib}"


class ByteTokenizer:
    """Bytes are tokens: no vocabulary file to ship, and any file is valid input."""

    vocab = 256

    def encode(self, data: bytes | str) -> np.ndarray:
        if isinstance(data, str):
            data = data.encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, tokens: np.ndarray | torch.Tensor | list[int]) -> bytes:
        return bytes(np.asarray(tokens, dtype=np.uint8))


@dataclass(frozen=True)
class Sources:
    """Where a spec's data lives on this machine: text files, or one token file."""

    files: tuple[Path, ...] = ()
    tokens: Path | None = None
    token_dtype: TokenDtype = "uint16"


def expand_path(pattern: str, base_dir: Path) -> str:
    """`{stdlib}` becomes Python's standard library directory; relative paths start at `base_dir`."""
    pattern = pattern.replace(STDLIB_PLACEHOLDER, sysconfig.get_paths()["stdlib"])
    return str(Path(base_dir, os.path.expanduser(pattern)))


@dataclass(frozen=True)
class GlobLimits:
    """Bounds on expanding a spec's `data.files` patterns, all patterns of one spec together.

    A pattern comes from whoever submits the job: `/**/*` would walk the daemon's whole filesystem
    (through directories only the daemon may list) and match millions of files, so the walk stops
    with a `SpecError` on `data.files` as soon as either bound is passed, before anything is read.
    A training set of more files than this belongs in a pre-tokenized `data.tokens` file."""

    max_files: int = 4096  # distinct regular files matched
    max_entries: int = 50_000  # directory entries looked at while matching

    def __post_init__(self) -> None:
        if self.max_files < 1 or self.max_entries < 1:
            raise ValueError("GlobLimits needs max_files >= 1 and max_entries >= 1")


class _GlobWalk:
    """glob's rules (`*`, `?`, `[...]` within a name, `**` for any depth, names starting with a
    dot only matched by patterns that start with one), walked by hand so every directory entry
    is counted. Unlike glob, `**` does not descend into symlinked directories: a link loop or a
    link to `/` cannot multiply the walk. Only the listings along the current path are held, so
    memory follows the tree's depth, not its size; a directory listed by two parts of a pattern
    (`**/*.py`) or by two patterns counts twice against `max_entries`."""

    def __init__(self, limits: GlobLimits) -> None:
        self.limits = limits
        self.entries = 0

    def matches(self, expanded: str, pattern: str) -> Iterator[Path]:
        """Candidate paths for `expanded`; `pattern` (as the spec wrote it) is for messages."""
        path = Path(expanded)
        parts = path.parts[1:] if path.is_absolute() else path.parts
        yield from self._walk(Path(path.anchor) if path.is_absolute() else Path(), parts, pattern)

    def _walk(self, here: Path, parts: tuple[str, ...], pattern: str) -> Iterator[Path]:
        if not parts:
            yield here
            return
        head, rest = parts[0], parts[1:]
        if head == "**":
            yield from self._walk(here, rest, pattern)
            for entry in self._listing(here, pattern):
                if entry.name.startswith("."):
                    continue
                if not rest:
                    yield here / entry.name
                if entry.is_dir(follow_symlinks=False):
                    yield from self._walk(here / entry.name, parts, pattern)
        elif glob.has_magic(head):
            for entry in self._listing(here, pattern):
                if fnmatch.fnmatchcase(entry.name, head) and (head.startswith(".") or not entry.name.startswith(".")):
                    yield from self._walk(here / entry.name, rest, pattern)
        else:
            yield from self._walk(here / head, rest, pattern)

    def _listing(self, here: Path, pattern: str) -> list[os.DirEntry]:
        try:
            with os.scandir(here) as it:
                listing = []
                for entry in it:
                    self.entries += 1
                    if self.entries > self.limits.max_entries:
                        raise SpecError("data.files", f"{pattern!r} looks at more than {self.limits.max_entries} "
                                                      "directory entries (jobs.data_max_entries); name the files "
                                                      "more precisely, or pre-tokenize them into data.tokens")
                    listing.append(entry)
                return listing
        except OSError:  # not a directory, gone, or not ours to list: no matches there, as with glob
            return []


def _is_file(path: Path) -> bool:
    """Path.is_file, but a path we may not even stat (EACCES, e.g. /proc/1/cwd) is simply no file."""
    try:
        return path.is_file()
    except OSError:
        return False


def resolve_sources(data: "DataSpec", base_dir: str | Path, limits: GlobLimits = GlobLimits()) -> Sources:
    """The concrete files behind a data spec; raises `SpecError` naming the field when any is
    missing or when `data.files` expands past `limits`. It walks the filesystem: call it off
    the event loop."""
    base = Path(base_dir)
    if data.tokens is not None:
        path = Path(expand_path(data.tokens, base))
        if not path.is_file():
            raise SpecError("data.tokens", f"{path} is not a file")
        return Sources(tokens=path, token_dtype=data.token_dtype)
    found: set[Path] = set()
    walk = _GlobWalk(limits)
    for pattern in data.files or ():
        matched = False
        for path in walk.matches(expand_path(pattern, base), pattern):
            if path in found or not _is_file(path):
                matched = matched or path in found
                continue
            matched = True
            found.add(path)
            if len(found) > limits.max_files:
                raise SpecError("data.files", f"{pattern!r} matches more than {limits.max_files} files "
                                              "(jobs.data_max_files); pre-tokenize them into data.tokens")
        if not matched:
            raise SpecError("data.files", f"{pattern!r} matches no files (from {base})")
    return Sources(files=tuple(sorted(found)))


def read_tokens(sources: Sources, max_text_bytes: int = MAX_TEXT_BYTES) -> np.ndarray:
    """The whole token stream: uint8 bytes of the files in path order, or the memory-mapped .bin."""
    if sources.tokens is not None:
        try:
            return map_tokens(sources.tokens, sources.token_dtype)
        except TokenFileError as exc:
            raise SpecError("data.tokens", str(exc)) from None
    total = sum(path.stat().st_size for path in sources.files)
    if total > max_text_bytes:
        raise SpecError("data.files", f"{total} bytes of text exceed max_text_bytes ({max_text_bytes}); "
                                      "pre-tokenize into a .bin file for data.tokens")
    stream = np.empty(total, dtype=np.uint8)
    offset = 0
    for path in sources.files:
        chunk = ByteTokenizer().encode(path.read_bytes())[: total - offset]
        stream[offset: offset + len(chunk)] = chunk
        offset += len(chunk)
    return stream[:offset]


class TokenDataset:
    """Sample i: tokens [i*T, (i+1)*T) as inputs, shifted by one as targets."""

    def __init__(self, tokens: np.ndarray, seq_len: int, vocab: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.vocab = vocab
        self.num_samples = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.num_samples

    def samples(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (B, T) int64 for sample indices (B,)."""
        T = self.seq_len
        if len(indices) and not 0 <= int(np.min(indices)) <= int(np.max(indices)) < self.num_samples:
            raise DataError(f"sample index outside 0..{self.num_samples - 1}")
        windows = np.stack([np.asarray(self.tokens[i * T: i * T + T + 1], dtype=np.int64) for i in indices])  # (B, T+1)
        if windows.size and int(windows.max()) >= self.vocab:
            raise DataError(f"token id {int(windows.max())} is outside the model's vocabulary ({self.vocab})")
        batch = torch.from_numpy(windows)
        return batch[:, :-1], batch[:, 1:]


class BatchSampler:
    """Which samples form microbatch m of step s, from the seed alone."""

    def __init__(self, num_samples: int, global_samples: int, microbatch_samples: int, seed: int) -> None:
        if num_samples < global_samples:
            raise SpecError("batch.global_samples", f"is {global_samples}, but the data holds only "
                                                    f"{num_samples} samples of data.seq_len tokens")
        self.num_samples = num_samples
        self.global_samples = global_samples
        self.microbatch_samples = microbatch_samples
        self.microbatches_per_step = global_samples // microbatch_samples
        self.steps_per_epoch = num_samples // global_samples
        self.seed = seed
        self._permutations: dict[int, np.ndarray] = {}

    def step_indices(self, step: int) -> np.ndarray:
        """The global batch of `step`: `global_samples` distinct sample indices, (G,)."""
        if step < 0:
            raise ValueError(f"step must not be negative, got {step}")
        epoch, within = divmod(step, self.steps_per_epoch)
        start = within * self.global_samples
        return self._permutation(epoch)[start: start + self.global_samples].copy()  # callers may mutate

    def microbatch_indices(self, step: int, microbatch: int) -> np.ndarray:
        if not 0 <= microbatch < self.microbatches_per_step:
            raise ValueError(f"microbatch must be in 0..{self.microbatches_per_step - 1}, got {microbatch}")
        start = microbatch * self.microbatch_samples
        return self.step_indices(step)[start: start + self.microbatch_samples]

    def microbatch_id(self, step: int, microbatch: int) -> int:
        """A job-wide id for (step, microbatch): what stage peers deduplicate on."""
        return step * self.microbatches_per_step + microbatch

    def split_id(self, microbatch_id: int) -> tuple[int, int]:
        return divmod(microbatch_id, self.microbatches_per_step)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            # Keep two epochs: consecutive steps straddle at most one boundary.
            while len(self._permutations) >= 2:
                self._permutations.pop(min(self._permutations))
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            self._permutations[epoch] = rng.permutation(self.num_samples)
        return self._permutations[epoch]


@dataclass(frozen=True)
class Microbatch:
    id: int
    step: int
    index: int
    sample_indices: np.ndarray
    inputs: torch.Tensor  # (B, T) int64 token ids
    targets: torch.Tensor  # (B, T) int64 next-token ids


class TrainingData:
    """A job's dataset and order together: what a trainer (or the reference) pulls microbatches from."""

    def __init__(self, dataset: TokenDataset, batch: "BatchSpec", seed: int) -> None:
        self.dataset = dataset
        self.sampler = BatchSampler(len(dataset), batch.global_samples, batch.microbatch_samples, seed)

    def microbatch(self, step: int, index: int) -> Microbatch:
        indices = self.sampler.microbatch_indices(step, index)
        inputs, targets = self.dataset.samples(indices)
        return Microbatch(self.sampler.microbatch_id(step, index), step, index, indices, inputs, targets)


def open_training_data(data: "DataSpec", batch: "BatchSpec", vocab: int, seed: int, base_dir: str | Path,
                       max_text_bytes: int = MAX_TEXT_BYTES) -> TrainingData:
    tokens = read_tokens(resolve_sources(data, base_dir), max_text_bytes)
    return TrainingData(TokenDataset(tokens, data.seq_len, vocab), batch, seed)
