"""`llama`: a Llama-style decoder split into pipeline stages.

Read top to bottom like nanoGPT's model.py. What differs from `transformer-lm`: RMSNorm instead of
LayerNorm, rotary position embeddings applied to queries and keys instead of a learned position
table (so stage 0 holds no position parameters), a SwiGLU MLP, grouped-query attention (`n_kv_heads`
key/value heads shared by groups of query heads) and no biases anywhere. The stage split is the same
as `transformer-lm`'s: stage 0 embeds, every stage runs `layers_per_stage` blocks, the last adds
the final norm, the head and the loss, so logits never cross the network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from swarmd.model.config import ConfigError, parse_table
from swarmd.model.stage import LanguageModelStage, init_generator

INIT_STD = 0.02  # as transformer-lm; residual projections are further scaled by 1/sqrt(2 * depth)
# A spec comes from the DHT: these bound what it can make a serving daemon allocate before any
# sanity check of memory. Each is far above any model one stage peer could hold.
MAX_D_MODEL = 1 << 16
MAX_HEADS = 1024
MAX_SEQ_LEN = 1 << 20
MAX_LAYERS_PER_STAGE = 1024
MAX_VOCAB = 1 << 22
MAX_D_FF = 1 << 18


def swiglu_hidden(d_model: int) -> int:
    """Llama's MLP width: 2/3 of 4·d_model (SwiGLU has three matrices, not two), rounded up to 64."""
    return 64 * math.ceil(8 * d_model / 3 / 64)


@dataclass(frozen=True)
class LlamaConfig:
    d_model: int
    n_heads: int
    max_seq_len: int
    n_kv_heads: int | None = None  # None: n_heads (plain multi-head attention), filled in
    layers_per_stage: int = 1
    share_layers: bool = False
    d_ff: int | None = None  # None: swiglu_hidden(d_model), filled in so the canonical spec states it
    vocab: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0  # must be 0, for transformer-lm's reason: backward recomputes the forward

    def __post_init__(self) -> None:
        bounds = {"d_model": MAX_D_MODEL, "n_heads": MAX_HEADS, "max_seq_len": MAX_SEQ_LEN,
                  "layers_per_stage": MAX_LAYERS_PER_STAGE, "vocab": MAX_VOCAB}
        for name, most in bounds.items():
            if not 1 <= getattr(self, name) <= most:
                raise ConfigError(name, f"must be in [1, {most}]")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ConfigError("n_heads", f"must divide d_model ({self.d_model}) into heads of even "
                                         "width (rotary embeddings turn pairs of dimensions)")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        elif not 1 <= self.n_kv_heads <= self.n_heads or self.n_heads % self.n_kv_heads:
            raise ConfigError("n_kv_heads", f"must divide n_heads ({self.n_heads})")
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", swiglu_hidden(self.d_model))
        elif not 1 <= self.d_ff <= MAX_D_FF:
            raise ConfigError("d_ff", f"must be in [1, {MAX_D_FF}]")
        if not 1.0 <= self.rope_theta <= 1e9:
            raise ConfigError("rope_theta", "must be in [1, 1e9]")
        if not 0.0 < self.norm_eps <= 1.0:
            raise ConfigError("norm_eps", "must be in (0, 1]")
        if self.dropout != 0.0:
            raise ConfigError("dropout", "must be 0: backward recomputes the forward on any peer, "
                                         "so a random mask could not be reproduced")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def parse_llama_config(raw: Mapping[str, Any], seq_len: int) -> LlamaConfig:
    """Read the `[model]` table; `max_seq_len` defaults to the data's sequence length."""
    config = parse_table(LlamaConfig, {"max_seq_len": seq_len, **raw})
    if seq_len > config.max_seq_len:
        raise ConfigError("max_seq_len", f"is {config.max_seq_len}, below data.seq_len {seq_len}")
    return config


class RMSNorm(nn.Module):
    """Scale by the reciprocal root-mean-square; computed in fp32 even under autocast."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (..., C)
        return (normed * self.weight).to(x.dtype)


def rotary_tables(T: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, head_dim/2) of each position's angle for each dimension pair. Computed per
    call, not held as buffers: nothing but parameters is in a stage's state, and it is cheap."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)  # (hd/2,)
    angles = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv_freq)  # (T, hd/2)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn each (even, odd) dimension pair of x (B, H, T, hd) by its position's angle."""
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]  # 2 × (B, H, T, hd/2)
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, H, T, hd/2, 2)
    return rotated.flatten(-2).to(x.dtype)  # (B, H, T, hd)


class GroupedQueryAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.theta = config.rope_theta
        self.q = nn.Linear(config.d_model, config.n_heads * config.head_dim, bias=False)
        self.kv = nn.Linear(config.d_model, 2 * config.n_kv_heads * config.head_dim, bias=False)
        self.proj = nn.Linear(config.n_heads * config.head_dim, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hd, kvh = self.head_dim, self.n_kv_heads
        q = self.q(x).view(B, T, self.n_heads, hd).transpose(1, 2)  # (B, H, T, hd)
        k, v = self.kv(x).view(B, T, 2, kvh, hd).unbind(dim=2)  # 2 × (B, T, KV, hd)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # 2 × (B, KV, T, hd)
        cos, sin = rotary_tables(T, hd, self.theta, x.device)  # 2 × (T, hd/2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        group = self.n_heads // kvh
        k = k.repeat_interleave(group, dim=1)  # (B, H, T, hd): each kv head serves `group` query heads
        v = v.repeat_interleave(group, dim=1)  # (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_heads * hd)  # (B, T, H*hd)
        return self.proj(y)  # (B, T, C)


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(config.d_model, 2 * config.d_ff, bias=False)
        self.proj = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # 2 × (B, T, d_ff)
        return self.proj(F.silu(gate) * up)  # (B, T, C)


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.norm_attn = RMSNorm(config.d_model, config.norm_eps)
        self.attn = GroupedQueryAttention(config)
        self.norm_mlp = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_attn(x))  # (B, T, C)
        return x + self.mlp(self.norm_mlp(x))  # (B, T, C)


class LlamaStage(LanguageModelStage):
    def __init__(self, config: LlamaConfig, stage_index: int, num_stages: int) -> None:
        super().__init__(stage_index, num_stages)
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab, config.d_model) if self.is_first else None
        distinct = 1 if config.share_layers else config.layers_per_stage
        self.blocks = nn.ModuleList(LlamaBlock(config) for _ in range(distinct))
        self.norm = RMSNorm(config.d_model, config.norm_eps) if self.is_last else None
        self.head = nn.Linear(config.d_model, config.vocab, bias=False) if self.is_last else None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings alone: positions enter through the rotary turn in attention."""
        return self.tok_emb(tokens)  # (B, T, C)


def build_llama_stage(config: LlamaConfig, stage_index: int, num_stages: int, seed: int,
                      device: torch.device | str = "cpu") -> LlamaStage:
    """Stage `stage_index` of `num_stages`, initialised from (seed, stage_index) alone: built on the
    meta device (torch's initialisers never run), filled from the stage's CPU generator in
    `modules()` order, then moved to `device`."""
    with torch.device("meta"):
        stage = LlamaStage(config, stage_index, num_stages)
    stage.to_empty(device="cpu")
    residual_std = INIT_STD / math.sqrt(2 * config.layers_per_stage * num_stages)
    _initialise(stage, init_generator(seed, stage_index), residual_std)
    return stage.to(device)


@torch.no_grad()
def _initialise(stage: LlamaStage, generator: torch.Generator, residual_std: float) -> None:
    residual = {id(b.attn.proj) for b in stage.blocks} | {id(b.mlp.proj) for b in stage.blocks}
    for module in stage.modules():
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, residual_std if id(module) in residual else INIT_STD, generator=generator)
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, INIT_STD, generator=generator)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
