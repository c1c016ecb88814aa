"""`[compute] dtype`: the precision policy, the per-stage loss scaler and the reference following it.

A swarm peer or reference refuses fp16 off CUDA; the fp16 tests run on CUDA (the `cuda` lane
`scripts/gpu-check.sh` runs) and on CPU with torch's float16 autocast standing in (FP16_DEVICES)."""

import json
import math
from pathlib import Path

import pytest
import torch

from swarmd.job import JobSpec, SpecError
from swarmd.model.precision import MAX_SCALE, MIN_SCALE, LossScaler, Precision, PrecisionError
from swarmd.reference import ReferenceTrainer

torch.set_num_threads(1)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device, none here (scripts/gpu-check.sh runs "
                                                  "the cuda lane on one)")


def spec(corpus: Path, dtype: str, steps: int = 8, **compute) -> JobSpec:
    return JobSpec.from_dict({
        "name": "prec", "seed": 4, "steps": steps,
        "model": {"arch": "llama", "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "layers_per_stage": 1},
        "data": {"files": [str(corpus)], "seq_len": 32}, "batch": {"global_samples": 8, "microbatch_samples": 4},
        "optim": {"name": "adamw", "lr": 3e-3, "schedule": "constant"}, "pipeline": {"stages": 3},
        "compute": {"dtype": dtype, **compute}})


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(Path(json.__file__).read_text() * 2)
    return path


def test_spec_section_bounds_and_canonical_form(corpus):
    assert spec(corpus, "bf16").compute.dtype == "bf16"
    assert spec(corpus, "fp32").to_dict().get("compute") is None  # the default is left out: ids unchanged
    assert spec(corpus, "fp16").to_dict()["compute"]["dtype"] == "fp16"
    assert spec(corpus, "fp32", optimizer_offload=True).to_dict()["compute"]["optimizer_offload"] is True
    for bad, field in [({"dtype": "fp8"}, "compute.dtype"), ({"loss_scale": 0.5}, "compute.loss_scale"),
                       ({"loss_scale": 2.0 ** 30}, "compute.loss_scale"),
                       ({"growth_interval": 0}, "compute.growth_interval"),
                       ({"growth_interval": 10 ** 7}, "compute.growth_interval"), ({"nope": 1}, "compute.nope"),
                       ({"optimizer_offload": "yes"}, "compute.optimizer_offload"),
                       ({"optimizer_offload": 1}, "compute.optimizer_offload")]:
        with pytest.raises(SpecError) as info:
            spec(corpus, "fp32", **bad) if "dtype" not in bad else spec(corpus, bad["dtype"])
        assert info.value.field == field


def test_policy_autocasts_and_refuses_fp16_without_cuda():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with Precision("bf16").autocast("cpu"):
        assert (a @ b).dtype == torch.bfloat16
    with Precision("fp32").autocast("cpu"):
        assert (a @ b).dtype == torch.float32
    Precision("bf16").check("cpu")
    with pytest.raises(PrecisionError, match="needs a CUDA device"):
        Precision("fp16").check("cpu")
    assert Precision("fp16").scaled and not Precision("bf16").scaled


def test_loss_scaler_backs_off_grows_and_stays_bounded():
    s = LossScaler(initial=8.0, growth_interval=3)
    s.update(True)
    assert s.scale == 4.0 and s.good_steps == 0
    for _ in range(3):
        s.update(False)
    assert s.scale == 8.0 and s.good_steps == 0
    for _ in range(10):
        s.update(True)
    assert s.scale == MIN_SCALE
    top = LossScaler(initial=MAX_SCALE, growth_interval=1)
    top.update(False)
    assert top.scale == MAX_SCALE
    mate = LossScaler(growth_interval=3)
    mate.load(s.state())
    assert mate.state() == s.state()
    for bad in [{"scale": 0.0, "good_steps": 0}, {"scale": 4.0, "good_steps": 3}, {"scale": 4, "good_steps": 0},
                {"scale": math.inf, "good_steps": 0}, [4.0, 0]]:
        with pytest.raises(ValueError):
            mate.load(bad)


def test_bf16_reference_keeps_fp32_master_weights_and_tracks_fp32(corpus):
    fp32 = ReferenceTrainer.from_spec(spec(corpus, "fp32"), corpus.parent)
    bf16 = ReferenceTrainer.from_spec(spec(corpus, "bf16"), corpus.parent)
    a, b = [r.loss for r in fp32.train(8)], [r.loss for r in bf16.train(8)]
    print("fp32", [f"{x:.4f}" for x in a], "\nbf16", [f"{x:.4f}" for x in b])
    assert a[0] != b[0]  # bf16 really computed something else
    assert all(abs(x - y) <= 0.02 * x for x, y in zip(a, b))
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    states = [t for opt in bf16.optimizers for s in opt.optimizer.state.values() for t in s.values()
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim()]
    assert states and all(t.dtype == torch.float32 for t in states)


def test_fp16_reference_refuses_cpu(corpus):
    with pytest.raises(PrecisionError, match="needs a CUDA device"):
        ReferenceTrainer.from_spec(spec(corpus, "fp16"), corpus.parent)


#: Where the fp16 reference runs: on CUDA, and on CPU with torch's float16 autocast standing in
#: for it (the device check waived). The stand-in is faithful here: the GPU run of 2026-12-04 (H200,
#: torch 2.11) gave the same per-step losses as CPU float16 autocast to 4 decimals, overflows included.
FP16_DEVICES = [pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda]), "cpu-float16"]


def fp16_device(device: str, monkeypatch) -> str:
    if device == "cpu-float16":
        monkeypatch.setattr(Precision, "check", lambda self, device: None)
        monkeypatch.setattr(Precision, "autocast", lambda self, device: torch.autocast("cpu", dtype=torch.float16))
        return "cpu"
    return device


@pytest.mark.parametrize("device", FP16_DEVICES)
def test_fp16_reference_at_a_fitting_scale_follows_fp32(corpus, device, monkeypatch):
    """At S = 2^12 every stage's scaled gradients fit fp16 (no step skipped, no regrowth): the loss
    follows fp32's step by step, within 1% (fp16's rounding of activations and gradients)."""
    device = fp16_device(device, monkeypatch)
    fp32 = ReferenceTrainer.from_spec(spec(corpus, "fp32"), corpus.parent, device=device)
    fp16 = ReferenceTrainer.from_spec(spec(corpus, "fp16", loss_scale=2.0 ** 12, growth_interval=1000),
                                      corpus.parent, device=device)
    a, b = [r.loss for r in fp32.train(8)], fp16.train(8)
    print("fp32", a, "\nfp16", [r.loss for r in b])
    assert all(math.isfinite(rep.grad_norm) for r in b for rep in r.reports)
    assert all(abs(x - y.loss) <= 0.01 * x for x, y in zip(a, b))
    assert all(p.dtype == torch.float32 for p in fp16.model.parameters())


@pytest.mark.parametrize("device", FP16_DEVICES)
def test_fp16_reference_backs_off_stage_by_stage_from_a_scale_too_large(corpus, device, monkeypatch):
    """From S = 2^24 (no regrowth) the scaled gradients overflow: the last stage first, then, as it
    passes back real gradients, the stages before it. Each stage skips its own steps and halves its
    own scale until its gradients fit; the others go on. Over 16 steps every stage has backed off
    (skipped a step, scale below 2^24), the last stage has no overflow in the last 6 steps, and
    the loss falls. (Measured on CPU float16: the last stage clean from step 9 at 2^15, stage 1
    from step 12, stage 0 overflowing at steps 11-14; 5.53 -> 4.89.)"""
    device = fp16_device(device, monkeypatch)
    fp16 = ReferenceTrainer.from_spec(spec(corpus, "fp16", steps=16, loss_scale=2.0 ** 24, growth_interval=1000),
                                      corpus.parent, device=device)
    steps = fp16.train(16)
    skipped = [[math.isinf(rep.grad_norm) for rep in r.reports] for r in steps]
    print("fp16", [round(r.loss, 4) for r in steps], "\nskipped per stage", skipped,
          "\nscales", [s.scale for s in fp16.scalers])
    assert all(any(step[i] for step in skipped) for i in range(3))
    assert all(s.scale < 2.0 ** 24 for s in fp16.scalers)
    assert not any(step[2] for step in skipped[10:])
    assert steps[-1].loss < steps[0].loss - 0.3
    assert all(p.dtype == torch.float32 for p in fp16.model.parameters())


@pytest.mark.parametrize("arch", ["transformer-lm", "llama"])
def test_bf16_stages_send_fp32_so_the_wire_carries_the_same_bytes(arch):
    """What crosses the network (activations, input gradients, the loss) stays fp32 under bf16
    autocast, so the [wire] codec sees the tensors it sees in fp32: bytes on the wire unchanged."""
    from swarmd.model import build_stage, get_architecture

    config = get_architecture(arch).parse_config({"d_model": 32, "n_heads": 4}, 16)
    first, last = build_stage(config, 0, 2, seed=0), build_stage(config, 1, 2, seed=0)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with Precision("bf16").autocast("cpu"):
        h = first(ids)
        x = h.detach().requires_grad_(True)
        loss = last(x, ids)
    loss.backward()
    assert h.dtype == loss.dtype == x.grad.dtype == torch.float32
    assert first.output_spec(2, 16).mismatch(h) is None and last.input_spec(2, 16).mismatch(x.grad) is None


@pytest.mark.cuda
@needs_cuda
def test_stages_on_cuda_match_cpu_and_bf16_reference_runs_there(corpus):
    from swarmd.model import LlamaConfig, build_reference

    config = LlamaConfig(d_model=64, n_heads=4, n_kv_heads=2, max_seq_len=32, layers_per_stage=2)
    cpu, gpu = build_reference(config, 2, seed=1), build_reference(config, 2, seed=1, device="cuda")
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    a, b = cpu(ids, ids).item(), gpu(ids.cuda(), ids.cuda()).item()
    assert abs(a - b) <= 1e-3 * abs(a)  # TF32/cuBLAS sums differ from CPU's in the last bits
    fp32 = ReferenceTrainer.from_spec(spec(corpus, "fp32"), corpus.parent, device="cuda")
    bf16 = ReferenceTrainer.from_spec(spec(corpus, "bf16"), corpus.parent, device="cuda")
    x, y = [r.loss for r in fp32.train(8)], [r.loss for r in bf16.train(8)]
    assert all(abs(p - q) <= 0.02 * p for p, q in zip(x, y))
    sample = gpu.generate(ids[:1, :4].cuda(), 8, temperature=0)
    assert sample.shape == (1, 12) and sample.device.type == "cuda"


def test_an_overflow_skips_that_stage_alone_and_halves_its_scale(corpus, monkeypatch):
    """The per-stage policy on CPU: fp16's arithmetic replaced by fp32 (autocast off, the device
    check waived), and stage 1's backward made to overflow on step 0 only. Stage 1 skips its update
    and halves its scale; stage 2 (after it) steps as usual; stage 0 (before it) steps on what it
    received, zeros for the overflowed microbatches; step 1 is clean everywhere."""
    monkeypatch.setattr(Precision, "check", lambda self, device: None)
    monkeypatch.setattr(Precision, "autocast", lambda self, device: torch.autocast("cpu", enabled=False))
    trainer = ReferenceTrainer.from_spec(spec(corpus, "fp16", loss_scale=1024.0), corpus.parent)
    overflow = {"on": True}

    def poison(module, inputs, output):
        if overflow["on"]:
            output.register_hook(lambda g: g * math.inf)

    trainer.model.stages[1].register_forward_hook(poison)
    before = [{k: v.clone() for k, v in s.state_dict().items()} for s in trainer.model.stages]
    first = trainer.train_step()
    norms = [r.grad_norm for r in first.reports]
    assert math.isinf(norms[1]) and math.isfinite(norms[2]) and norms[2] > 0
    assert norms[0] == 0.0  # every microbatch overflowed in stage 1: stage 0 was passed zeros only
    assert [s.scale for s in trainer.scalers] == [1024.0, 512.0, 1024.0]
    changed = [any(not torch.equal(v, before[i][k]) for k, v in s.state_dict().items())
               for i, s in enumerate(trainer.model.stages)]
    assert changed == [True, False, True]
    assert all(opt.step_count == 1 for opt in trainer.optimizers)  # the step is committed everywhere
    overflow["on"] = False
    assert all(math.isfinite(r.grad_norm) for r in trainer.train_step().reports)
