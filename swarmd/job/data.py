"""Training data and its order: the same (seed, step, microbatch) gives the same samples everywhere.

A dataset is one long token stream, either text files read as bytes by the byte-level tokenizer or a
`.bin` token file (raw little-endian uint16 as nanoGPT's, or uint32; memory-mapped: swarmd.tokenfile). Sample i is the window of `seq_len`
tokens at `i * seq_len` with its next-token targets. Each epoch is a seeded permutation of the
samples cut into whole global batches (the remainder is skipped, a different one each epoch), so the
samples of a step are always distinct; step s's batch is split in order into microbatches whose ids
are stable, which is what lets stage peers refuse a duplicate and lets a single-process reference
see exactly the samples the swarm saw.

With `[eval]`, a `holdout` fraction of the samples is set aside first, drawn by the job's seed
(`held_out_split`): training permutes only the rest, so it never samples a held-out window, and
every evaluation reads the same first `eval.samples` of the held-out ones (`TrainingData.eval_batch`).
With `eval.files` instead, they are `eval.samples` windows of that data set, drawn by the seed alike,
and training keeps all of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from swarmd.job.errors import DataError, SpecError
from swarmd.job.spec import BatchSpec, EvalSpec

# Text files are loaded into memory; past this, pre-tokenize them into a memory-mapped `.bin` file.
MAX_TEXT_BYTES = 1 << 30


class ByteTokenizer:
    """Bytes are tokens: no vocabulary file to ship, and any file is valid input."""

    vocab = 256

    def encode(self, data: bytes | str) -> np.ndarray:
        if isinstance(data, str):
            data = data.encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, tokens: np.ndarray | torch.Tensor | list[int]) -> bytes:
        return bytes(np.asarray(tokens, dtype=np.uint8))


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


# Mixed into the job's seed for the held-out draw, so it is unrelated to every epoch's permutation
# (those are seeded by [seed, epoch]: two words, this is three).
_SPLIT_KEY = (0x65766131, 1)


def held_out_split(num_samples: int, holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(held out, training) sample indices of a dataset of `num_samples`: disjoint, together all of
    them, the same for the same seed everywhere. floor(holdout·num_samples) are held out, in the
    order drawn (so the first k of them are a random k); the training ones come sorted."""
    count = int(num_samples * holdout)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *_SPLIT_KEY])))
    order = rng.permutation(num_samples)
    return order[:count], np.sort(order[count:])


@dataclass(frozen=True)
class EvalBatch:
    """Held-out samples evaluated together: one forward-only call per stage (`stage.evaluate`)."""

    index: int
    sample_indices: np.ndarray
    inputs: torch.Tensor  # (B, T) int64 token ids
    targets: torch.Tensor  # (B, T) int64 next-token ids


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

    def __init__(self, dataset: TokenDataset, batch: BatchSpec, seed: int, evaluation: EvalSpec | None = None,
                 eval_dataset: TokenDataset | None = None) -> None:
        """`eval_dataset`: the data of `eval.files`, when the caller has it (without it such a job
        has no held-out samples here: `eval_batch_count()` is 0)."""
        self.dataset = dataset
        self.microbatch_samples = batch.microbatch_samples
        # Training samples: all of them, or (with eval.holdout) the ones not held out, as dataset indices.
        self.training_indices: np.ndarray | None = None
        self.eval_dataset = dataset  # where the held-out samples are read from
        self.eval_indices = np.zeros(0, dtype=np.int64)  # the held-out samples every evaluation reads
        if evaluation is not None and evaluation.enabled and evaluation.files is None:
            held, self.training_indices = held_out_split(len(dataset), evaluation.holdout, seed)
            if len(held) < evaluation.samples:
                raise SpecError("eval.holdout", f"holds out {len(held)} of the data's {len(dataset)} samples, "
                                                f"fewer than eval.samples ({evaluation.samples})")
            self.eval_indices = held[: evaluation.samples]
        elif evaluation is not None and evaluation.enabled and eval_dataset is not None:
            held, _ = held_out_split(len(eval_dataset), 1.0, seed)  # every window, in the seed's order
            if len(held) < evaluation.samples:
                raise SpecError("eval.files", f"hold {len(held)} samples of data.seq_len tokens, fewer than "
                                              f"eval.samples ({evaluation.samples})")
            self.eval_dataset, self.eval_indices = eval_dataset, held[: evaluation.samples]
        pool = len(dataset) if self.training_indices is None else len(self.training_indices)
        self.sampler = BatchSampler(pool, batch.global_samples, batch.microbatch_samples, seed)

    def microbatch(self, step: int, index: int) -> Microbatch:
        indices = self.sampler.microbatch_indices(step, index)
        if self.training_indices is not None:
            indices = self.training_indices[indices]
        inputs, targets = self.dataset.samples(indices)
        return Microbatch(self.sampler.microbatch_id(step, index), step, index, indices, inputs, targets)

    def eval_batch_count(self) -> int:
        return -(-len(self.eval_indices) // self.microbatch_samples)

    def eval_batch(self, index: int) -> EvalBatch:
        """Held-out batch `index`: `microbatch_samples` samples (the last one may hold fewer)."""
        if not 0 <= index < self.eval_batch_count():
            raise ValueError(f"eval batch must be in 0..{self.eval_batch_count() - 1}, got {index}")
        size = self.microbatch_samples
        indices = self.eval_indices[index * size: (index + 1) * size]
        inputs, targets = self.eval_dataset.samples(indices)
        return EvalBatch(index, indices, inputs, targets)
