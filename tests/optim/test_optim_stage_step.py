"""StageOptimizer: gradient sums become means, are clipped per stage, and the schedule is stepped;
its state travels as tensors plus plain values (torch.save / weights_only load, msgpack meta)."""

import io

import msgpack
import pytest
import torch

from swarmd.job import OptimSpec
from swarmd.model import TransformerConfig, build_stage
from swarmd.model.precision import LossScaler
from swarmd.optim import (
    NonFiniteGradient,
    OptimizerState,
    OptimizerStateError,
    StageOptimizer,
    export_state,
    import_state,
    param_groups,
)

torch.set_num_threads(1)

CONFIG = TransformerConfig(d_model=16, n_heads=2, max_seq_len=8, layers_per_stage=1)


def test_weight_decay_excludes_norms_and_biases():
    stage = build_stage(CONFIG, 1, 2, seed=0)
    groups = param_groups(stage.named_parameters(), 0.1)
    names = {id(p): n for n, p in stage.named_parameters()}
    decayed = {names[id(p)] for p in groups[0]["params"]}
    plain = {names[id(p)] for p in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert "head.weight" in decayed and "blocks.0.attn.qkv.weight" in decayed
    assert {"norm.weight", "norm.bias", "blocks.0.ln_attn.weight", "blocks.0.mlp.up.bias"} <= plain
    assert not any("ln" in n or "norm" in n or n.endswith("bias") for n in decayed)
    assert decayed | plain == set(names.values())


def linear_with_grad(grad):
    module = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        module.weight.copy_(torch.tensor([[1.0, 1.0]]))
    module.weight.grad = torch.tensor([grad])
    return module


def test_step_divides_the_sum_by_samples():
    module = linear_with_grad([8.0, -4.0])
    opt = StageOptimizer(module, OptimSpec(name="sgd", lr=0.5, momentum=0.0, weight_decay=0.0,
                                           schedule="constant", clip_norm=0.0), total_steps=10)
    report = opt.step(4)
    assert module.weight.tolist() == [[1.0 - 0.5 * 2.0, 1.0 + 0.5 * 1.0]]
    assert report.grad_norm == pytest.approx(5 ** 0.5) and not report.clipped
    assert module.weight.grad is None and opt.step_count == 1


def test_clipping_applies_to_the_averaged_gradient():
    module = linear_with_grad([30.0, 40.0])  # mean over 2 samples: norm 25
    opt = StageOptimizer(module, OptimSpec(name="sgd", lr=1.0, momentum=0.0, weight_decay=0.0,
                                           schedule="constant", clip_norm=5.0), total_steps=10)
    report = opt.step(2)
    assert report.clipped and report.grad_norm == pytest.approx(25.0)
    delta = torch.tensor([[1.0, 1.0]]) - module.weight.detach()
    assert delta.norm().item() == pytest.approx(5.0, rel=1e-5)


def test_non_finite_gradient_changes_nothing():
    module = linear_with_grad([float("nan"), 1.0])
    opt = StageOptimizer(module, OptimSpec(name="adamw"), total_steps=10)
    with pytest.raises(NonFiniteGradient):
        opt.step(1)
    assert module.weight.tolist() == [[1.0, 1.0]] and opt.step_count == 0


def test_schedule_is_really_stepped():
    module = torch.nn.Linear(2, 2)
    opt = StageOptimizer(module, OptimSpec(name="lamb", lr=1e-2, warmup_steps=2, schedule="cosine"), total_steps=6)
    lrs = []
    for _ in range(6):
        module(torch.ones(1, 2)).sum().backward()
        lrs.append(opt.step(1).lr)
        assert opt.optimizer.param_groups[0]["lr"] == lrs[-1]
    assert len(set(lrs)) == 6 and lrs[2] == pytest.approx(1e-2)


def train_a_little(opt, stage, steps):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, 8), generator=g) if stage.is_first else torch.randn(2, 8, 16, generator=g)
    for _ in range(steps):
        stage(x).square().sum().backward()
        opt.step(2)


@pytest.mark.parametrize("name", ["adamw", "lamb", "sgd"])
def test_state_round_trips_without_pickle(name):
    """Export after 2 steps, ship (torch.save + weights_only load; meta through msgpack), import into a
    fresh stage with the same parameters, take one more step on both: identical parameters."""
    spec = OptimSpec(name=name, lr=1e-2, warmup_steps=1)
    stage_a, stage_b = build_stage(CONFIG, 0, 2, seed=1), build_stage(CONFIG, 0, 2, seed=1)
    opt_a = StageOptimizer(stage_a, spec, total_steps=10)
    train_a_little(opt_a, stage_a, 2)
    state = export_state(opt_a)
    buffer = io.BytesIO()
    torch.save(state.tensors, buffer)
    buffer.seek(0)
    shipped = OptimizerState(torch.load(buffer, weights_only=True), msgpack.unpackb(msgpack.packb(state.meta)))
    stage_b.load_state_dict(stage_a.state_dict())
    opt_b = StageOptimizer(stage_b, spec, total_steps=10)
    import_state(opt_b, shipped)
    assert opt_b.step_count == 2 and opt_b.lr == opt_a.lr
    train_a_little(opt_a, stage_a, 1)
    train_a_little(opt_b, stage_b, 1)
    for (n, pa), (_, pb) in zip(stage_a.named_parameters(), stage_b.named_parameters()):
        assert torch.equal(pa, pb), n


def test_whole_state_survives_torch_save_weights_only():
    stage = build_stage(CONFIG, 0, 2, seed=1)
    opt = StageOptimizer(stage, OptimSpec(name="adamw"), total_steps=10)
    train_a_little(opt, stage, 1)
    buffer = io.BytesIO()
    torch.save(export_state(opt).to_dict(), buffer)
    buffer.seek(0)
    loaded = OptimizerState.from_dict(torch.load(buffer, weights_only=True))
    assert loaded.meta["step"] == 1 and loaded.meta["optimizer"] == "adamw"


def test_state_from_another_stage_or_optimizer_is_refused():
    first, second, third = (build_stage(CONFIG, i, 4, seed=1) for i in range(3))
    opt_first = StageOptimizer(first, OptimSpec(name="adamw"), total_steps=10)
    train_a_little(opt_first, first, 1)
    state = export_state(opt_first)
    for other in (second, third):
        opt_other = StageOptimizer(other, OptimSpec(name="adamw"), total_steps=10)
        with pytest.raises(OptimizerStateError, match="stage"):
            import_state(opt_other, state)
        assert opt_other.step_count == 0 and not opt_other.optimizer.state
    # Middle stages have the same shapes: the recorded index still tells them apart.
    opt_second = StageOptimizer(second, OptimSpec(name="adamw"), total_steps=10)
    train_a_little(opt_second, second, 1)
    with pytest.raises(OptimizerStateError, match="stage 1"):
        import_state(StageOptimizer(third, OptimSpec(name="adamw"), total_steps=10), export_state(opt_second))
    with pytest.raises(OptimizerStateError, match="lamb"):
        import_state(StageOptimizer(first, OptimSpec(name="lamb"), total_steps=10), state)
    bad = OptimizerState({**state.tensors, "0/exp_avg": torch.zeros(3, 3)}, state.meta)
    with pytest.raises(OptimizerStateError, match="shape"):
        import_state(StageOptimizer(first, OptimSpec(name="adamw"), total_steps=10), bad)


@pytest.mark.parametrize("name", ["adamw", "lamb", "sgd"])
def test_an_offloaded_optimizer_steps_exactly_as_one_on_the_device(name):
    """`[compute] optimizer_offload`: the state on the host, stepped on host copies of the
    parameters. On CPU (no GPU here: the pinned copy is the CUDA path's one difference, covered by
    scripts/gpu-check.sh) the parameters after 4 steps equal bitwise the plain optimizer's, the
    state's layout is the same (a snapshot moves between the two), a state loaded into the module
    from elsewhere is what the next step starts from, and no gradient is left on the module."""
    spec = OptimSpec(name=name, lr=1e-2, warmup_steps=1, clip_norm=0.05)  # clipping on as well
    plain, offloaded = build_stage(CONFIG, 0, 2, seed=1), build_stage(CONFIG, 0, 2, seed=1)
    opt_plain = StageOptimizer(plain, spec, total_steps=10)
    opt_off = StageOptimizer(offloaded, spec, total_steps=10, offload=True)
    train_a_little(opt_plain, plain, 4)
    train_a_little(opt_off, offloaded, 4)
    for (n, a), (_, b) in zip(plain.named_parameters(), offloaded.named_parameters()):
        assert torch.equal(a, b), n
        assert b.grad is None, n
    host_state = {id(t) for t in opt_off.optimizer.state}
    assert host_state and not host_state & {id(p) for p in offloaded.parameters()}  # not the module's
    state = export_state(opt_off)
    assert {k: v.shape for k, v in state.tensors.items()} == {k: v.shape for k, v in export_state(opt_plain).tensors.items()}

    # A downloaded state lands in the module and the offloading optimizer (as apply_snapshot does).
    fresh = build_stage(CONFIG, 0, 2, seed=2)
    opt_fresh = StageOptimizer(fresh, spec, total_steps=10, offload=True)
    fresh.load_state_dict(plain.state_dict())
    import_state(opt_fresh, export_state(opt_plain))
    train_a_little(opt_plain, plain, 1)
    train_a_little(opt_fresh, fresh, 1)
    for (n, a), (_, b) in zip(plain.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), n


def test_an_offloaded_optimizer_refuses_a_non_finite_gradient_and_changes_nothing():
    stage = build_stage(CONFIG, 0, 2, seed=1)
    opt = StageOptimizer(stage, OptimSpec(name="adamw"), total_steps=10, offload=True)
    before = {n: p.detach().clone() for n, p in stage.named_parameters()}
    for p in stage.parameters():
        p.grad = torch.full_like(p, float("nan"))
    with pytest.raises(NonFiniteGradient):
        opt.step(2)
    assert all(torch.equal(before[n], p) for n, p in stage.named_parameters()) and opt.step_count == 0


def test_a_loss_scale_divides_the_sum_and_moves_with_each_step():
    """fp16's S: the gradient sums are S times the true ones, so the step divides by samples x S
    (the same update as unscaled); a clean step counts toward growth, an overflow halves S and
    raises with the parameters unchanged."""
    module = linear_with_grad([8.0 * 1024, -4.0 * 1024])
    opt = StageOptimizer(module, OptimSpec(name="sgd", lr=0.5, momentum=0.0, weight_decay=0.0,
                                           schedule="constant", clip_norm=0.0), total_steps=10,
                         scaler=LossScaler(1024.0, growth_interval=2))
    report = opt.step(4)
    assert module.weight.tolist() == [[1.0 - 0.5 * 2.0, 1.0 + 0.5 * 1.0]]
    assert report.grad_norm == pytest.approx(5 ** 0.5)
    assert opt.loss_scale == 1024.0 and opt.scaler.good_steps == 1
    module.weight.grad = torch.tensor([[float("inf"), 1.0]])
    with pytest.raises(NonFiniteGradient):
        opt.step(4)
    assert module.weight.tolist() == [[0.0, 1.5]] and opt.loss_scale == 512.0 and opt.scaler.good_steps == 0


def test_the_loss_scale_travels_with_the_state_and_a_bad_one_changes_nothing():
    """A joiner of an fp16 stage takes its mate's S with the optimizer state; a state whose S no
    correct mate could hold is refused before anything is loaded."""
    spec = OptimSpec(name="adamw", lr=1e-2)
    stage_a, stage_b = build_stage(CONFIG, 0, 2, seed=1), build_stage(CONFIG, 0, 2, seed=1)
    opt_a = StageOptimizer(stage_a, spec, total_steps=10, scaler=LossScaler(256.0, growth_interval=3))
    train_a_little(opt_a, stage_a, 2)
    state = export_state(opt_a)
    assert state.meta["loss_scale"] == {"scale": 256.0, "good_steps": 2}
    opt_b = StageOptimizer(stage_b, spec, total_steps=10, scaler=LossScaler(65536.0, growth_interval=3))
    for bad in [{"scale": 0.5, "good_steps": 0}, {"scale": 256.0, "good_steps": 3}, None]:
        shipped = OptimizerState(state.tensors, {**state.meta, "loss_scale": bad})
        with pytest.raises(OptimizerStateError, match="loss_scale"):
            import_state(opt_b, shipped)
        assert opt_b.step_count == 0 and opt_b.loss_scale == 65536.0
    import_state(opt_b, OptimizerState(state.tensors, msgpack.unpackb(msgpack.packb(state.meta))))
    assert opt_b.step_count == 2 and opt_b.loss_scale == 256.0 and opt_b.scaler.good_steps == 2
