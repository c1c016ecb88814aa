"""`llama`: the Llama-style architecture's parts, its stage split and its deterministic init."""

import math

import pytest
import torch
import torch.nn.functional as F

from swarmd.job import JobSpec, SpecError
from swarmd.model import ConfigError, LlamaConfig, TensorSpec, build_reference, build_stage, get_architecture
from swarmd.model.llama import RMSNorm, apply_rotary, rotary_tables, swiglu_hidden

torch.set_num_threads(1)

CONFIG = LlamaConfig(d_model=32, n_heads=4, n_kv_heads=2, max_seq_len=16, layers_per_stage=2)


def params(module):
    return dict(module.named_parameters())


def test_config_fills_defaults_and_bounds_every_size():
    cfg = LlamaConfig(d_model=64, n_heads=4, max_seq_len=8)
    assert cfg.n_kv_heads == 4 and cfg.d_ff == swiglu_hidden(64) == 192
    for bad, field in [(dict(n_kv_heads=3), "n_kv_heads"), (dict(n_heads=3), "n_heads"),
                       (dict(d_model=1 << 20), "d_model"), (dict(vocab=0), "vocab"),
                       (dict(dropout=0.1), "dropout"), (dict(rope_theta=0.5), "rope_theta"),
                       (dict(d_ff=1 << 30), "d_ff")]:
        with pytest.raises(ConfigError) as info:
            LlamaConfig(**{"d_model": 64, "n_heads": 4, "max_seq_len": 8, **bad})
        assert info.value.field == field


def test_job_spec_selects_llama():
    raw = {"name": "l", "steps": 1, "model": {"arch": "llama", "d_model": 32, "n_heads": 4, "n_kv_heads": 1},
           "data": {"files": ["x"], "seq_len": 8}, "batch": {"global_samples": 2, "microbatch_samples": 1}}
    spec = JobSpec.from_dict(raw)
    assert spec.model.config == LlamaConfig(d_model=32, n_heads=4, n_kv_heads=1, max_seq_len=8)
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert spec.to_dict()["model"]["d_ff"] == swiglu_hidden(32)
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict({**raw, "model": {**raw["model"], "n_kv_heads": 3}})
    assert info.value.field == "model.n_kv_heads"
    assert get_architecture("llama").config_type is LlamaConfig


def test_no_biases_and_no_position_table():
    for i in range(3):
        names = params(build_stage(CONFIG, i, 3, seed=0))
        assert not [n for n in names if n.endswith("bias")]
        assert not [n for n in names if "pos" in n]
    first, last = build_stage(CONFIG, 0, 3, seed=0), build_stage(CONFIG, 2, 3, seed=0)
    assert first.tok_emb is not None and first.head is None and last.head is not None
    hd = CONFIG.d_model // CONFIG.n_heads
    assert first.blocks[0].attn.kv.weight.shape == (2 * CONFIG.n_kv_heads * hd, CONFIG.d_model)


def test_builds_are_bit_identical_per_seed_and_stage_and_leave_the_global_rng():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    a, b = params(build_stage(CONFIG, 1, 3, seed=5)), params(build_stage(CONFIG, 1, 3, seed=5))
    assert torch.equal(torch.rand(3), expected)
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = params(build_stage(CONFIG, 2, 3, seed=5))
    assert not torch.equal(a["blocks.0.attn.q.weight"], other["blocks.0.attn.q.weight"])


def test_init_statistics():
    p = params(build_stage(CONFIG, 0, 2, seed=1))
    assert torch.all(p["blocks.0.norm_attn.weight"] == 1)
    assert abs(p["tok_emb.weight"].std().item() - 0.02) < 0.002
    residual_std = 0.02 / math.sqrt(2 * CONFIG.layers_per_stage * 2)
    assert abs(p["blocks.1.mlp.proj.weight"].std().item() - residual_std) < 0.15 * residual_std


def test_rmsnorm_matches_its_definition():
    norm = RMSNorm(8, 1e-5)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    assert torch.allclose(norm(x), expected, atol=1e-6)


def test_rotary_scores_depend_only_on_relative_position():
    """q·k after rotation at positions (m, n) equals that at (m + s, n + s): RoPE's whole point."""
    hd, T = 8, 12
    cos, sin = rotary_tables(T, hd, 10000.0, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(hd, generator=g), torch.randn(hd, generator=g)
    qs = apply_rotary(q.expand(1, 1, T, hd), cos, sin)[0, 0]  # (T, hd): q at every position
    ks = apply_rotary(k.expand(1, 1, T, hd), cos, sin)[0, 0]
    assert torch.allclose(qs[5] @ ks[2], qs[9] @ ks[6], atol=1e-5)
    assert not torch.allclose(qs[5] @ ks[2], qs[5] @ ks[4], atol=1e-3)
    assert torch.allclose(qs[0], q)  # position 0 is not turned


def test_attention_is_causal():
    stage = build_stage(CONFIG, 0, 2, seed=3)
    idx = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    a, b = stage(idx), stage(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_grouped_query_attention_equals_multi_head_with_repeated_kv_weights():
    gqa = LlamaConfig(d_model=32, n_heads=4, n_kv_heads=2, max_seq_len=8)
    mha = LlamaConfig(d_model=32, n_heads=4, n_kv_heads=4, max_seq_len=8)
    a, b = build_stage(gqa, 1, 3, seed=0).blocks[0].attn, build_stage(mha, 1, 3, seed=0).blocks[0].attn
    hd = 8
    k, v = a.kv.weight.view(2, 2, hd, 32).unbind(0)  # 2 × (KV, hd, C)
    with torch.no_grad():
        b.q.weight.copy_(a.q.weight)
        b.proj.weight.copy_(a.proj.weight)
        b.kv.weight.copy_(torch.cat([k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)]).reshape(-1, 32))
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(a(x), b(x), atol=1e-6)


def test_composed_stages_equal_reference_and_loss_is_sample_summed():
    ref = build_reference(CONFIG, 3, seed=9)
    stages = [build_stage(CONFIG, i, 3, seed=9) for i in range(3)]
    idx = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(idx, -1, dims=1)
    h = stages[1](stages[0](idx))
    assert h.shape == (3, 16, 32)
    loss = stages[2](h, targets)
    assert torch.equal(loss, ref(idx, targets))
    logits = stages[2].logits(h)
    expected = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1)) * 3
    assert torch.allclose(loss, expected, rtol=1e-5)
    assert stages[2].sample_losses(h, targets).shape == (3,)


def test_specs_and_a_few_steps_learn():
    first, last = build_stage(CONFIG, 0, 2, seed=0), build_stage(CONFIG, 1, 2, seed=0)
    assert first.input_spec(4, 16) == TensorSpec((4, 16), torch.int64)
    assert first.output_spec(4, 16) == last.input_spec(4, 16) == TensorSpec((4, 16, 32), torch.float32)
    model = build_reference(CONFIG, 2, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.arange(16).repeat(4, 1) % 7  # a pattern to learn
    targets = torch.roll(idx, -1, dims=1)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = model(idx, targets) / 4
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
