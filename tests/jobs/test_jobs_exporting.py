"""`job.export`'s tensor messages without a daemon: a stage's parameters cut into pieces that fit one
message and put back whole (the stream docs/control-api.md describes)."""

from __future__ import annotations

import pytest
import torch

from swarmd.jobs import exporting


@pytest.mark.parametrize("chunk", [4 << 20, 1000, 6])
def test_a_stages_parameters_travel_in_bounded_pieces_and_come_back_whole(monkeypatch, chunk: int) -> None:
    """Tensors of several dtypes, one larger than a message, one empty: each "tensors" message names
    its stage and a [name, offset] per tensor, carries at most `chunk` bytes unless one piece alone
    is larger (never split below one element), and the pieces put back give every tensor's bits."""
    monkeypatch.setattr(exporting, "EXPORT_CHUNK_BYTES", chunk)
    g = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(600, generator=g), "h": torch.randn(5, 4, generator=g).half(),
              "empty": torch.empty(0), "ids": torch.arange(9)}
    rebuilt = {name: torch.zeros(t.numel(), dtype=t.dtype) for name, t in params.items()}
    for message in exporting._pieces(3, params):
        assert message.meta["kind"] == "tensors" and message.meta["stage"] == 3
        sizes = [t.numel() * t.element_size() for t in message.tensors]
        assert sum(sizes) <= chunk or len(sizes) == 1
        for (name, offset), part in zip(message.meta["pieces"], message.tensors, strict=True):
            rebuilt[name][offset: offset + part.numel()] = part
    for name, tensor in params.items():
        assert torch.equal(rebuilt[name].view(tensor.shape), tensor), name
