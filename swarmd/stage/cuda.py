"""The CUDA lane: each served stage computes on its own stream, with host-to-device and
device-to-host copies on two more streams, from and into pinned host buffers, ordered by events.

Copies on their own streams overlap with another batch's kernels instead of queueing behind them,
and pinned (page-locked) buffers are what lets a copy run asynchronously at all. Events order the
three streams without blocking the host; the compute thread waits only for the final download, so
the answer it returns is complete. Selected only when the stage's device is CUDA; on CPU the lane
is the identity (`compute.Lane`).
"""

from __future__ import annotations

import torch

from swarmd.stage.compute import Lane


def cuda_lane(device: torch.device) -> Lane:
    compute = torch.cuda.Stream(device)
    h2d = torch.cuda.Stream(device)
    d2h = torch.cuda.Stream(device)

    def upload(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.cuda.stream(h2d):
            on_device = [_pinned(t).to(device, non_blocking=True) for t in tensors]
        copied = torch.cuda.Event()
        copied.record(h2d)
        compute.wait_event(copied)
        for t in on_device:
            t.record_stream(compute)  # allocated on h2d, used on compute: keep it until compute is done
        return on_device

    def download(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        computed = torch.cuda.Event()
        computed.record(compute)
        d2h.wait_event(computed)
        hosts = []
        with torch.cuda.stream(d2h):
            for t in tensors:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t.record_stream(d2h)
                hosts.append(host)
        downloaded = torch.cuda.Event()
        downloaded.record(d2h)
        downloaded.synchronize()
        return hosts

    def finish() -> None:
        # Gradients were added into the accumulator on the compute stream; the all-reduce reads them
        # from another thread on the default stream, so the batch is complete before we answer.
        done = torch.cuda.Event()
        done.record(compute)
        done.synchronize()

    return Lane(upload, download, lambda: torch.cuda.stream(compute), finish)


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A page-locked copy (the caching host allocator recycles it once the copy has finished)."""
    return tensor if tensor.is_pinned() else tensor.pin_memory()
