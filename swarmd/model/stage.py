"""What every pipeline stage promises the rest of swarmd, whatever its architecture.

A stage server checks RPC inputs against `input_spec` before any compute, so a wrong shape or dtype
from a confused or hostile trainer is refused with a reason instead of failing deep inside torch.
Initialisation draws from a generator seeded by (job seed, stage index) alone, so every peer that
builds stage i of a job holds bit-identical parameters without exchanging a byte.
"""

from __future__ import annotations

import abc
import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype a stage expects for one of its inputs."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def mismatch(self, tensor: torch.Tensor) -> str | None:
        """Why `tensor` does not fit, or None when it does."""
        if tensor.dtype != self.dtype:
            return f"expected dtype {self.dtype}, got {tensor.dtype}"
        if tuple(tensor.shape) != self.shape:
            return f"expected shape {list(self.shape)}, got {list(tensor.shape)}"
        return None


class Stage(nn.Module, abc.ABC):
    """Stage `stage_index` of `num_stages`: the first takes token ids, the last returns losses.

    Contract (docs/training.md): `forward(x)` for all but the last stage returns the activations for
    the next stage; the last stage's `forward(x, targets)` returns the *sample-summed loss*, the sum
    over the microbatch's samples of each sample's mean token loss, so that summing gradients over
    microbatches and dividing by the global sample count yields the gradient of the global-batch
    mean loss whatever the microbatch sizes are.
    """

    def __init__(self, stage_index: int, num_stages: int) -> None:
        super().__init__()
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage index {stage_index} is outside 0..{num_stages - 1}")
        self.stage_index = stage_index
        self.num_stages = num_stages

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @abc.abstractmethod
    def input_spec(self, microbatch_samples: int, seq_len: int) -> TensorSpec:
        """What `forward` takes as `x`: token ids for the first stage, activations after it."""

    @abc.abstractmethod
    def output_spec(self, microbatch_samples: int, seq_len: int) -> TensorSpec:
        """What `forward` returns: the next stage's `input_spec`, or a scalar loss for the last."""

    def target_spec(self, microbatch_samples: int, seq_len: int) -> TensorSpec:
        """The targets the last stage takes: next-token ids."""
        return TensorSpec((microbatch_samples, seq_len), torch.int64)


def derive_seed(job_seed: int, stage_index: int, purpose: str) -> int:
    """A 63-bit seed for one purpose of one stage; hashing keeps stages' streams unrelated."""
    digest = hashlib.sha256(f"swarmd/{purpose}/{job_seed}/{stage_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_generator(job_seed: int, stage_index: int) -> torch.Generator:
    """The CPU generator a stage draws its initial parameters from (CPU so CUDA peers agree too)."""
    return torch.Generator(device="cpu").manual_seed(derive_seed(job_seed, stage_index, "init"))


class LanguageModelStage(Stage):
    """A token language model's stage: token ids in at the first, d_model-wide activations between
    stages, per-sample mean cross-entropy at the last.

    The forward contract, the run through the stage's blocks and the loss are the same for every
    architecture, so they live here; a subclass builds `blocks` (one shared block when
    `config.share_layers`, else `config.layers_per_stage`), the last stage's `norm` and `head`, and
    gives `embed` for the first stage (where architectures differ: learned positions or none)."""

    config: Any
    blocks: nn.ModuleList
    norm: nn.Module | None
    head: nn.Module | None

    @abc.abstractmethod
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The first stage's (B, T, C) activations from (B, T) token ids."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Activations (B, T, C) for the next stage, or on the last stage the sample-summed loss."""
        if not self.is_last:
            if targets is not None:
                raise ValueError(f"only the last stage takes targets; this is stage {self.stage_index}")
            return self.hidden(x)
        if targets is None:
            raise ValueError("the last stage needs targets: it returns the loss, never logits")
        return self.sample_losses(x, targets).sum()

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """This stage's blocks over its input (embedded first on the first stage), (B, T, C)."""
        if self.is_first:
            x = self.embed(x)
        for i in range(self.config.layers_per_stage):
            x = self.blocks[0 if self.config.share_layers else i](x)  # (B, T, C)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, vocab): for sampling from a whole model, never sent over the network."""
        return self.head(self.norm(self.hidden(x)))

    def sample_losses(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each sample's mean token cross-entropy, (B,): an executor that batched several
        microbatches together splits this to answer each one."""
        logits = self.logits(x).float()  # (B, T, vocab)
        B, T, V = logits.shape
        token_losses = F.cross_entropy(logits.reshape(B * T, V), targets.reshape(B * T), reduction="none")
        return token_losses.view(B, T).mean(dim=1)  # (B,)

    def input_spec(self, microbatch_samples: int, seq_len: int) -> TensorSpec:
        if self.is_first:
            return TensorSpec((microbatch_samples, seq_len), torch.int64)
        return TensorSpec((microbatch_samples, seq_len, self.config.d_model), torch.float32)

    def output_spec(self, microbatch_samples: int, seq_len: int) -> TensorSpec:
        if self.is_last:
            return TensorSpec((), torch.float32)
        return TensorSpec((microbatch_samples, seq_len, self.config.d_model), torch.float32)

