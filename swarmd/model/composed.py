"""All stages of a model in one process: the single-process baseline that swarm training must match,
and the whole model an export loads into (`swarmd.model.export.load_model`).

It is built from the very `build_stage` calls the stage peers make, so its parameters equal theirs
bit for bit, and its forward is the stages' forwards in order, so any difference between the two is
the swarm's doing, never the model's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from swarmd.model.registry import build_stage


class ComposedModel(nn.Module):
    def __init__(self, stages: list[nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The sample-summed loss of a microbatch of token ids (B, T) and targets (B, T)."""
        x = idx
        for stage in self.stages[:-1]:
            x = stage(x)  # (B, T, C)
        return self.stages[-1](x, targets)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token logits (B, T, vocab) of token ids (B, T)."""
        x = idx
        for stage in self.stages[:-1]:
            x = stage(x)  # (B, T, C)
        return self.stages[-1].logits(x)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Extend token ids (B, T) by `max_new_tokens` sampled tokens, the context cropped to the
        model's `max_seq_len`; temperature 0 takes the most likely token."""
        limit = self.stages[0].config.max_seq_len
        for _ in range(max_new_tokens):
            logits = self.logits(idx[:, -limit:])[:, -1, :].float()  # (B, vocab)
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]  # (B, 1)
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)  # (B, 1)
            idx = torch.cat([idx, nxt], dim=1)  # (B, T+1)
        return idx


def build_reference(config: Any, num_stages: int, seed: int, device: torch.device | str = "cpu") -> ComposedModel:
    return ComposedModel([build_stage(config, i, num_stages, seed, device) for i in range(num_stages)])
