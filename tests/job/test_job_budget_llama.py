"""The stage memory estimate covers the built-in `llama` architecture too.

Attack (adversary): a stranger publishes a `llama` spec; the budget used to know only
`transformer-lm`'s config, returned "no estimate" for llama, and a daemon serving "all" built a stage
of any size the spec limits allow (d_model 32768, 1024 layers: terabytes)."""

from __future__ import annotations

import pytest
import torch

from swarmd.job import JobSpec
from swarmd.job.budget import BYTES_PER_VALUE, StageTooLarge, check_stage_fits, stage_memory
from swarmd.model.registry import get_architecture

torch.set_num_threads(1)


def llama(stages: int = 3, microbatch: int = 4, seq_len: int = 16, **model) -> JobSpec:
    return JobSpec.from_dict({
        "name": "llama-budget", "steps": 3,
        "model": {"arch": "llama", "d_model": 32, "n_heads": 4, "layers_per_stage": 2, **model},
        "data": {"files": ["x"], "seq_len": seq_len},
        "batch": {"global_samples": microbatch * 2, "microbatch_samples": microbatch},
        "pipeline": {"stages": stages},
    })


@pytest.mark.parametrize("model", [{}, {"share_layers": True}, {"n_kv_heads": 2, "vocab": 1000},
                                   {"n_kv_heads": 1, "d_ff": 48}])
def test_llama_parameter_count_is_exact_for_every_stage(model: dict) -> None:
    job = llama(**model)
    arch = get_architecture("llama")
    for stage in range(3):
        built = arch.build_stage(job.model.config, stage, 3, seed=0)
        need = stage_memory(job, stage)
        assert need is not None, "llama has no memory estimate: any llama spec would be joined"
        assert need.parameters == sum(p.numel() for p in built.parameters()), stage
        assert need.weights == need.parameters * BYTES_PER_VALUE


def test_a_huge_llama_stage_is_refused_before_it_is_built() -> None:
    big = llama(d_model=8192, n_heads=64, n_kv_heads=8, layers_per_stage=32)
    with pytest.raises(StageTooLarge, match=r"^stage 1 of job llama-budget needs about .* GiB"):
        check_stage_fits(big, 1, 64 * 2**30)
    assert check_stage_fits(llama(), 1, 2**30).total < 2**30


def test_llama_activations_grow_with_the_batch_and_the_square_of_the_sequence() -> None:
    base = stage_memory(llama(), 1).activations
    assert stage_memory(llama(microbatch=8), 1).activations == 2 * base
    assert stage_memory(llama(seq_len=64, max_seq_len=64), 1).activations > 4 * base
