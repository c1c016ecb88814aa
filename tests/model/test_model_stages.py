"""Stage split and deterministic init of `transformer-lm`: what lets peers of a stage agree bit for bit."""

import math

import pytest
import torch
import torch.nn.functional as F

from swarmd.model import TensorSpec, TransformerConfig, build_reference, build_stage

torch.set_num_threads(1)

CONFIG = TransformerConfig(d_model=32, n_heads=4, max_seq_len=16, layers_per_stage=2)


def params(module):
    return dict(module.named_parameters())


def test_two_builds_of_a_stage_are_bit_identical():
    for i in range(3):
        a, b = params(build_stage(CONFIG, i, 3, seed=5)), params(build_stage(CONFIG, i, 3, seed=5))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_build_does_not_touch_the_global_rng():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_stage(CONFIG, 0, 2, seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_stages_and_seeds_differ():
    mid_a, mid_b = params(build_stage(CONFIG, 1, 4, seed=5)), params(build_stage(CONFIG, 2, 4, seed=5))
    assert mid_a.keys() == mid_b.keys()
    key = "blocks.0.attn.qkv.weight"
    assert not torch.equal(mid_a[key], mid_b[key])
    other_seed = params(build_stage(CONFIG, 1, 4, seed=6))
    assert not torch.equal(mid_a[key], other_seed[key])


def test_init_statistics():
    stage = build_stage(CONFIG, 0, 2, seed=1)
    p = params(stage)
    assert torch.all(p["blocks.0.ln_attn.weight"] == 1) and torch.all(p["blocks.0.attn.qkv.bias"] == 0)
    assert abs(p["tok_emb.weight"].std().item() - 0.02) < 0.002
    residual_std = 0.02 / math.sqrt(2 * CONFIG.layers_per_stage * 2)
    assert abs(p["blocks.1.mlp.proj.weight"].std().item() - residual_std) < 0.1 * residual_std


def test_stage_roles():
    first, middle, last = (build_stage(CONFIG, i, 3, seed=0) for i in range(3))
    assert first.tok_emb is not None and first.head is None
    assert middle.tok_emb is None and middle.head is None and middle.norm is None
    assert last.tok_emb is None and last.norm is not None and last.head is not None
    only = build_stage(CONFIG, 0, 1, seed=0)
    assert only.tok_emb is not None and only.head is not None
    with pytest.raises(ValueError, match="outside"):
        build_stage(CONFIG, 3, 3, seed=0)


def test_reference_parameters_equal_stage_parameters():
    ref = build_reference(CONFIG, 3, seed=9)
    for i in range(3):
        stage = params(build_stage(CONFIG, i, 3, seed=9))
        mine = {k.split(".", 2)[2]: v for k, v in params(ref).items() if k.startswith(f"stages.{i}.")}
        assert mine.keys() == stage.keys()
        assert all(torch.equal(mine[k], stage[k]) for k in mine)


def test_composed_stages_equal_reference_forward():
    ref = build_reference(CONFIG, 3, seed=9)
    stages = [build_stage(CONFIG, i, 3, seed=9) for i in range(3)]
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(idx, -1, dims=1)
    x = stages[0](idx)
    assert x.shape == (2, 16, 32)
    with pytest.raises(ValueError, match="only the last stage"):
        stages[1](x, targets)
    x = stages[1](x)
    assert torch.equal(stages[2](x, targets), ref(idx, targets))


def test_last_stage_loss_is_sample_summed_cross_entropy():
    cfg = TransformerConfig(d_model=32, n_heads=4, max_seq_len=16, layers_per_stage=1)
    first, last = build_stage(cfg, 0, 2, seed=2), build_stage(cfg, 1, 2, seed=2)
    idx = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(2))
    h = first(idx)
    logits = last.head(last.norm(last.blocks[0](h)))  # (B, T, V)
    expected = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1)) * 3  # mean per token × samples
    assert torch.allclose(last(h, targets), expected, rtol=1e-5)
    per_sample = last.sample_losses(h, targets)
    assert per_sample.shape == (3,)
    assert torch.allclose(last(h[:1], targets[:1]), per_sample[0], rtol=1e-5)
    with pytest.raises(ValueError, match="targets"):
        last(h)


def test_gradients_of_microbatch_sums_equal_the_global_mean():
    """Summing the sample-summed losses' gradients over microbatches and dividing by the sample count
    gives the gradient of the mean loss over the whole batch: what stage peers rely on."""
    ref_a, ref_b = build_reference(CONFIG, 2, seed=4), build_reference(CONFIG, 2, seed=4)
    idx = torch.randint(0, 256, (6, 16), generator=torch.Generator().manual_seed(3))
    targets = torch.roll(idx, -1, dims=1)
    (ref_a(idx, targets) / 6).backward()
    for part in (slice(0, 2), slice(2, 6)):
        ref_b(idx[part], targets[part]).backward()
    for (name, pa), (_, pb) in zip(ref_a.named_parameters(), ref_b.named_parameters()):
        assert torch.allclose(pa.grad, pb.grad / 6, atol=1e-7, rtol=1e-4), name


def test_share_layers_holds_one_block_applied_k_times():
    shared = TransformerConfig(d_model=32, n_heads=4, max_seq_len=16, layers_per_stage=3, share_layers=True)
    separate = TransformerConfig(d_model=32, n_heads=4, max_seq_len=16, layers_per_stage=3)
    one = TransformerConfig(d_model=32, n_heads=4, max_seq_len=16, layers_per_stage=1)
    count = lambda cfg: sum(p.numel() for p in build_stage(cfg, 1, 3, seed=0).parameters())  # noqa: E731
    block = count(one)
    assert count(shared) == block and count(separate) == 3 * block
    stage = build_stage(shared, 1, 3, seed=0)
    x = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(0))
    applied = x
    for _ in range(3):
        applied = stage.blocks[0](applied)
    assert torch.equal(stage(x), applied)


def test_input_and_output_specs():
    first, middle, last = (build_stage(CONFIG, i, 3, seed=0) for i in range(3))
    assert first.input_spec(4, 16) == TensorSpec((4, 16), torch.int64)
    assert middle.input_spec(4, 16) == TensorSpec((4, 16, 32), torch.float32)
    assert first.output_spec(4, 16) == middle.input_spec(4, 16)
    assert last.output_spec(4, 16) == TensorSpec((), torch.float32)
    assert last.target_spec(4, 16) == TensorSpec((4, 16), torch.int64)
    spec = middle.input_spec(4, 16)
    assert spec.mismatch(torch.zeros(4, 16, 32)) is None
    assert "dtype" in spec.mismatch(torch.zeros(4, 16, 32, dtype=torch.float16))
    assert "shape" in spec.mismatch(torch.zeros(4, 16, 33))


def test_device_argument_keeps_cpu_init():
    a = build_stage(CONFIG, 0, 2, seed=3, device="cpu")
    b = build_stage(CONFIG, 0, 2, seed=3, device=torch.device("cpu"))
    assert torch.equal(a.tok_emb.weight, b.tok_emb.weight)
