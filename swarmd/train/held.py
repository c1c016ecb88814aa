"""What a trainer keeps of a finished microbatch until its step commits everywhere: on disk, not in memory.

A stage peer that dies before its all-reduce takes the gradients it held with it, and the trainer
must re-send those backward calls with the same inputs: stage i's input x_i and the gradient
grad_y_i of its output, which only the stages' parameters of that step could compute again (and
a stage below may have committed the step by then). So they are kept; but holding every stage's
fp32 tensors of every microbatch of the step makes the trainer's memory grow with
`global_samples` (64 MiB per sample per boundary at the paper's shape). Here they are written to
one file per microbatch as soon as the microbatch is done and read back only for a re-send: the
trainer's memory is bounded by the microbatches in flight, the disk holds at most the steps whose
commit is awaited (two with delayed updates), and a step's files go when every stage commits it.
Token ids and targets are not kept: they are read again from the data, which is deterministic.
Files are written and read in a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import torch

# Per stage: (x_i or None for stage 0's token ids, grad_y_i or None for the last stage).
StageTensors = dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]


class HeldTensors:
    """Per step, per microbatch id, the tensors a re-send needs. Owned by one `Trainer.run`."""

    def __init__(self, parent: str | Path | None) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="swarmd-trainer-", dir=parent))
        self.files_written = 0

    def _path(self, step: int, mb_id: int) -> Path:
        return self.root / f"step-{step}" / f"mb-{mb_id}.pt"

    async def put(self, step: int, mb_id: int, tensors: StageTensors) -> None:
        path = self._path(step, mb_id)

        def write() -> None:
            path.parent.mkdir(exist_ok=True)
            torch.save({stage: (x, g) for stage, (x, g) in tensors.items()}, path)

        await asyncio.to_thread(write)
        self.files_written += 1

    async def get(self, step: int, mb_id: int) -> StageTensors | None:
        """The tensors kept for this microbatch; None when none were (another trainer's, or dropped)."""
        path = self._path(step, mb_id)

        def read() -> StageTensors | None:
            try:
                return torch.load(path, weights_only=True)
            except FileNotFoundError:
                return None

        return await asyncio.to_thread(read)

    async def drop(self, step: int) -> None:
        await asyncio.to_thread(shutil.rmtree, self.root / f"step-{step}", True)

    async def close(self) -> None:
        await asyncio.to_thread(shutil.rmtree, self.root, True)
