"""What serving one stage of a job costs in memory, worked out from the spec alone, before joining.

A daemon with `jobs.serve = "all"` joins stages of jobs that strangers publish; the spec's upper
bounds (`swarmd.job.spec.LIMITS`) keep every number sane, but a stage of sane numbers can still
need more memory than the machine has. So before a daemon builds a stage it estimates the stage's
memory here and refuses, with the estimate in its reason, what exceeds `jobs.max_stage_memory`.

The estimate is an upper bound in the spirit of a capacity check, not an accounting to the byte:
fp32 weights; the gradient three times (each parameter's `.grad`, the all-reduce's flat sum, the
round's reduced copy: swarmd/stage/service.py, swarmd/stage/allreduce.py); the optimizer's state
(AdamW and LAMB two values per weight, SGD one); and the activations autograd keeps while one
compute call runs backward (a call fuses up to `StageLimits.max_batch` microbatches, and
`StageLimits.workers` calls run at once), with attention weights counted as if materialised.
Pure arithmetic on Python ints: nothing here allocates in proportion to the spec.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from swarmd.job.spec import JobSpec
from swarmd.model.llama import LlamaConfig
from swarmd.model.transformer import TransformerConfig

#: Every tensor a stage keeps is fp32 (swarmd/stage trains in fp32; codecs only touch the wire).
BYTES_PER_VALUE = 4
#: Copies of the gradient a stage holds around a step's all-reduce.
GRADIENT_COPIES = 3
#: Optimizer state per weight.
OPTIMIZER_SLOTS = {"adamw": 2, "lamb": 2, "sgd": 1}
#: Share of the machine's (or GPU's) memory all served stages together may take by default; the
#: rest is the daemon's own, the trainers', and the operating system's.
DEFAULT_SHARE = 0.5


class StageTooLarge(ValueError):
    """A stage's estimated memory exceeds this daemon's `jobs.max_stage_memory`."""


@dataclass(frozen=True)
class StageMemory:
    """Bytes one served stage needs, by part; `parameters` is a count."""

    parameters: int
    weights: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    def describe(self) -> str:
        return (f"{_gib(self.total)} ({self.parameters:,} parameters: weights {_gib(self.weights)}, gradients "
                f"{_gib(self.gradients)}, optimizer {_gib(self.optimizer)}; activations {_gib(self.activations)})")


def stage_memory(spec: JobSpec, stage: int, *, microbatches_at_once: int = 8) -> StageMemory | None:
    """The estimate for stage `stage` of `spec`; None for an architecture with no formula here
    (a plugin: installed by this machine's operator, so its own configs are its own to bound).
    `microbatches_at_once`: how many microbatches' activations may be alive together."""
    config = spec.model.config
    formula = _transformer_lm if isinstance(config, TransformerConfig) else \
        _llama if isinstance(config, LlamaConfig) else None
    if formula is None:
        return None
    first, last = stage == 0, stage == spec.pipeline.stages - 1
    samples = spec.batch.microbatch_samples * microbatches_at_once
    params, values = formula(config, first, last, samples, spec.data.seq_len)
    return StageMemory(parameters=params, weights=params * BYTES_PER_VALUE,
                       gradients=GRADIENT_COPIES * params * BYTES_PER_VALUE,
                       optimizer=OPTIMIZER_SLOTS.get(spec.optim.name, 2) * params * BYTES_PER_VALUE,
                       activations=values * BYTES_PER_VALUE)


def _transformer_lm(config: TransformerConfig, first: bool, last: bool, samples: int, tokens: int) -> tuple[int, int]:
    """(parameters, activation values) of a `transformer-lm` stage (swarmd/model/transformer.py)."""
    d, dff, vocab = config.d_model, config.d_ff, config.vocab
    block = 4 * d * d + 2 * d * dff + 9 * d + dff
    params = block * (1 if config.share_layers else config.layers_per_stage)
    params += (vocab + config.max_seq_len) * d if first else 0
    params += (2 * d + d * vocab) if last else 0
    per_layer = samples * tokens * (10 * d + 2 * dff) + 2 * samples * config.n_heads * tokens * tokens
    values = per_layer * config.layers_per_stage
    values += 2 * samples * tokens * d if first else 0
    values += 3 * samples * tokens * vocab if last else 0
    return params, values


def _llama(config: LlamaConfig, first: bool, last: bool, samples: int, tokens: int) -> tuple[int, int]:
    """(parameters, activation values) of a `llama` stage (swarmd/model/llama.py): no biases, two
    RMSNorm weights, grouped key/value heads, a three-matrix SwiGLU, no position table. Per layer
    it keeps about 16 d-wide values per token (norms, the fp32 rotary copies, the key/value heads
    repeated to every query head, the residuals) and four d_ff-wide ones (gate and up, silu, product)."""
    d, dff, vocab = config.d_model, config.d_ff, config.vocab
    kv = 2 * config.n_kv_heads * config.head_dim
    block = 2 * d + 2 * d * d + d * kv + 3 * d * dff
    params = block * (1 if config.share_layers else config.layers_per_stage)
    params += vocab * d if first else 0
    params += (d + d * vocab) if last else 0
    per_layer = samples * tokens * (16 * d + 2 * kv + 4 * dff) + 2 * samples * config.n_heads * tokens * tokens
    values = per_layer * config.layers_per_stage
    values += samples * tokens * d if first else 0
    values += 3 * samples * tokens * vocab if last else 0
    return params, values


def check_stage_fits(spec: JobSpec, stage: int, limit: int, *, microbatches_at_once: int = 8) -> StageMemory | None:
    """The estimate, or `StageTooLarge` naming the job, the stage, the estimate and the limit."""
    need = stage_memory(spec, stage, microbatches_at_once=microbatches_at_once)
    if need is not None and need.total > limit:
        raise StageTooLarge(f"stage {stage} of job {spec.name} needs about {need.describe()}, over this daemon's "
                            f"jobs.max_stage_memory ({_gib(limit)})")
    return need


def default_stage_memory(device: str, max_stages: int) -> int:
    """`jobs.max_stage_memory` when not set: DEFAULT_SHARE of the memory stages live in (the GPU's
    on CUDA, else the machine's RAM), split among the `jobs.max_stages` a daemon may serve."""
    if device.startswith("cuda"):
        import torch

        index = int(device.partition(":")[2] or 0)
        total = torch.cuda.get_device_properties(index).total_memory
    else:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(total * DEFAULT_SHARE) // max(1, max_stages)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
