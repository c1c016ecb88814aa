"""The stage memory estimate: exact parameter counts against built stages, the parts that scale with
the batch, and the refusal a daemon logs before joining a stage that would not fit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarmd.job import JobSpec
from swarmd.job.budget import (
    BYTES_PER_VALUE,
    GRADIENT_COPIES,
    StageTooLarge,
    check_stage_fits,
    default_stage_memory,
    stage_memory,
)
from swarmd.model.registry import available, get_architecture

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]


def spec(stages: int = 3, optim: str = "adamw", microbatch: int = 4, seq_len: int = 16, arch: str = "transformer-lm",
         **model) -> JobSpec:
    return JobSpec.from_dict({
        "name": "budget", "steps": 3,
        "model": {"arch": arch, "d_model": 32, "n_heads": 4, "layers_per_stage": 2, **model},
        "data": {"files": ["x"], "seq_len": seq_len},
        "batch": {"global_samples": microbatch * 2, "microbatch_samples": microbatch},
        "optim": {"name": optim}, "pipeline": {"stages": stages},
    })


@pytest.mark.parametrize("model", [{"arch": "transformer-lm"}, {"arch": "transformer-lm", "share_layers": True},
                                   {"arch": "transformer-lm", "vocab": 1000, "d_ff": 48},
                                   {"arch": "llama", "n_kv_heads": 2}, {"arch": "llama", "vocab": 1000, "d_ff": 48}])
def test_parameter_count_is_exact_for_every_stage(model: dict) -> None:
    if model["arch"] not in available():
        pytest.skip(f"no {model['arch']} architecture in this tree")
    job = spec(**model)
    arch = get_architecture(model["arch"])
    for stage in range(3):
        built = arch.build_stage(job.model.config, stage, 3, seed=0)
        assert stage_memory(job, stage).parameters == sum(p.numel() for p in built.parameters()), stage


def test_weights_gradients_and_optimizer_follow_the_parameters() -> None:
    for optim, slots in (("adamw", 2), ("lamb", 2), ("sgd", 1)):
        need = stage_memory(spec(optim=optim), 1)
        assert need.weights == need.parameters * BYTES_PER_VALUE
        assert need.gradients == GRADIENT_COPIES * need.weights and need.optimizer == slots * need.weights


def test_activations_grow_with_the_batch_and_the_square_of_the_sequence() -> None:
    base = stage_memory(spec(), 1).activations
    assert stage_memory(spec(microbatch=8), 1).activations == 2 * base
    assert stage_memory(spec(), 1, microbatches_at_once=16).activations == 2 * base
    assert stage_memory(spec(seq_len=64, max_seq_len=64), 1).activations > 4 * base


def test_a_stage_past_the_limit_is_refused_naming_job_stage_and_limit() -> None:
    """The issue's stranger: d_model 2048 x 4 layers grew an idle daemon by 1.7 GB. With a 1 GiB
    limit its middle stage is refused before anything is built; the tiny job fits."""
    big = spec(d_model=2048, n_heads=16, layers_per_stage=4)
    with pytest.raises(StageTooLarge, match=r"^stage 1 of job budget needs about .* GiB .*over this daemon's "
                                            r"jobs.max_stage_memory \(1.00 GiB\)"):
        check_stage_fits(big, 1, 2**30)
    assert check_stage_fits(spec(), 1, 2**30).total < 2**30


#: Run in a process of its own: tracemalloc counts every thread, and a test session has others.
TOP_SPEC_PEAK = """
import tracemalloc
from swarmd.job import JobSpec
from swarmd.job.budget import StageTooLarge, check_stage_fits
from swarmd.job.spec import LIMITS
top = {name.split(".")[1]: LIMITS[name].value for name in ("model.d_model", "model.layers_per_stage",
                                                            "model.vocab", "model.d_ff", "model.max_seq_len")}
job = JobSpec.from_dict({
    "name": "top", "steps": LIMITS["steps"].value,
    "model": {"arch": "transformer-lm", "n_heads": LIMITS["model.n_heads"].value, **top},
    "data": {"tokens": "t.bin", "token_dtype": "uint32", "seq_len": LIMITS["data.seq_len"].value},
    "batch": {"global_samples": LIMITS["batch.global_samples"].value,
              "microbatch_samples": LIMITS["batch.microbatch_samples"].value},
    "pipeline": {"stages": LIMITS["pipeline.stages"].value},
})
tracemalloc.start()
try:
    check_stage_fits(job, 0, 64 * 2**30)
except StageTooLarge as exc:
    print(tracemalloc.get_traced_memory()[1], exc)
"""


@pytest.mark.slow
def test_the_largest_spec_the_limits_allow_is_estimated_without_allocating() -> None:
    """Every field at its limit: the estimate is arithmetic on ints (exabytes, refused), not tensors."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO))}
    done = subprocess.run([sys.executable, "-c", TOP_SPEC_PEAK], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    peak, message = done.stdout.split(" ", 1)
    assert "stage 0 of job top needs about" in message and int(peak) < 1 << 20, done.stdout


def test_the_default_limit_is_half_the_machine_split_among_max_stages() -> None:
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert default_stage_memory("cpu", 4) == int(ram * 0.5) // 4
    assert default_stage_memory("cpu", 0) == int(ram * 0.5)


def test_on_cuda_the_default_is_half_the_gpus_memory(monkeypatch) -> None:
    """No GPU here: the device's properties are stood in for (the only mocked part)."""
    from types import SimpleNamespace

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: asked.append(index) or SimpleNamespace(total_memory=80 * 2**30))
    assert default_stage_memory("cuda:1", 4) == 10 * 2**30 and asked == [1]
    assert default_stage_memory("cuda", 2) == 20 * 2**30 and asked == [1, 0]
