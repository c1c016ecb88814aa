"""All stages of a model in one process: the single-process baseline that swarm training must match.

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


def build_reference(config: Any, num_stages: int, seed: int, device: torch.device | str = "cpu") -> ComposedModel:
    return ComposedModel([build_stage(config, i, num_stages, seed, device) for i in range(num_stages)])
