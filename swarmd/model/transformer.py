"""`transformer-lm`: a Pre-LN GPT split into pipeline stages.

Read top to bottom like nanoGPT's model.py. The model knows nothing of networks: a stage is a plain
`nn.Module` whose parts that belong to other stages are simply `None`. Stage 0 embeds tokens and
positions, every stage runs `layers_per_stage` blocks (one shared block applied that many times with
`share_layers`, ALBERT-style as in the SWARM paper's large run), the last stage adds the final norm,
the LM head and the loss, so logits never cross the network. The head is not tied to the embedding:
they live on different stages.
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

INIT_STD = 0.02  # GPT-2's initialiser; residual projections are further scaled by 1/sqrt(2 * depth)


@dataclass(frozen=True)
class TransformerConfig:
    d_model: int
    n_heads: int
    max_seq_len: int
    layers_per_stage: int = 1
    share_layers: bool = False
    d_ff: int | None = None  # None: 4 * d_model, filled in so the canonical spec states it
    vocab: int = 256  # the built-in byte tokenizer's vocabulary
    # Backward recomputes the forward, possibly on another peer, so a random dropout mask could not
    # be reproduced there; the key exists so a nanoGPT-style config gets this reason, not "unknown".
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("d_model", "n_heads", "max_seq_len", "layers_per_stage", "vocab"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be at least 1")
        if self.d_model % self.n_heads:
            raise ConfigError("n_heads", f"must divide d_model ({self.d_model})")
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        elif self.d_ff < 1:
            raise ConfigError("d_ff", "must be at least 1")
        if self.dropout != 0.0:
            raise ConfigError("dropout", "must be 0: backward recomputes the forward on any peer, "
                                         "so a random mask could not be reproduced")


def parse_transformer_config(raw: Mapping[str, Any], seq_len: int) -> TransformerConfig:
    """Read the `[model]` table; `max_seq_len` defaults to the data's sequence length."""
    config = parse_table(TransformerConfig, {"max_seq_len": seq_len, **raw})
    if seq_len > config.max_seq_len:
        raise ConfigError("max_seq_len", f"is {config.max_seq_len}, below data.seq_len {seq_len}")
    return config


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 × (B, T, C)
        q = q.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, H, T, C/H)
        k = k.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, H, T, C/H)
        v = v.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, H, T, C/H)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C/H)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.d_model, config.d_ff)
        self.proj = nn.Linear(config.d_ff, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.up(x)))  # (B, T, C) -> (B, T, d_ff) -> (B, T, C)


class Block(nn.Module):
    """Pre-LN: normalise before each sublayer, add its output to the residual stream."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))  # (B, T, C)
        return x + self.mlp(self.ln_mlp(x))  # (B, T, C)


class TransformerStage(LanguageModelStage):
    def __init__(self, config: TransformerConfig, stage_index: int, num_stages: int) -> None:
        super().__init__(stage_index, num_stages)
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab, config.d_model) if self.is_first else None
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model) if self.is_first else None
        distinct = 1 if config.share_layers else config.layers_per_stage
        self.blocks = nn.ModuleList(Block(config) for _ in range(distinct))
        self.norm = nn.LayerNorm(config.d_model) if self.is_last else None
        self.head = nn.Linear(config.d_model, config.vocab, bias=False) if self.is_last else None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings plus learned position embeddings."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)  # (T,)
        return self.tok_emb(tokens) + self.pos_emb(positions)  # (B, T, C)


def build_transformer_stage(config: TransformerConfig, stage_index: int, num_stages: int, seed: int,
                            device: torch.device | str = "cpu") -> TransformerStage:
    """Stage `stage_index` of `num_stages`, initialised from (seed, stage_index) alone.

    Built on the meta device so torch's default initialisers neither run nor touch the global RNG,
    then filled from a per-stage CPU generator in `named_modules` order and moved to `device`.
    """
    with torch.device("meta"):
        stage = TransformerStage(config, stage_index, num_stages)
    stage.to_empty(device="cpu")
    depth = config.layers_per_stage * num_stages
    _initialise(stage, init_generator(seed, stage_index), residual_std=INIT_STD / math.sqrt(2 * depth))
    return stage.to(device)


@torch.no_grad()
def _initialise(stage: TransformerStage, generator: torch.Generator, residual_std: float) -> None:
    residual = {id(block.attn.proj) for block in stage.blocks} | {id(block.mlp.proj) for block in stage.blocks}
    for module in stage.modules():
        if isinstance(module, nn.Linear):
            std = residual_std if id(module) in residual else INIT_STD
            module.weight.normal_(0.0, std, generator=generator)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, INIT_STD, generator=generator)
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
