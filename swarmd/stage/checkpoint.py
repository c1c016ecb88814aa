"""Atomic checkpoints of a stage's state in its state dir, and restoring the newest good one.

A peer can be killed at any instant, including mid-write, so a checkpoint is written to a temp
file in the same directory, flushed and fsynced, then renamed over its final name (atomic on POSIX)
and the directory fsynced: a reader sees a whole checkpoint or none. Files hold only tensors and
plain values and are read with `torch.load(weights_only=True)`, never unpickling code.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

from swarmd.optim import OptimizerState, OptimizerStateError
from swarmd.stage.state import STATE_FORMAT, Snapshot, StateError

log = logging.getLogger(__name__)

_NAME = re.compile(r"step-(\d{10})\.pt")


def checkpoint_dir(state_dir: Path, job_id: bytes, stage_index: int) -> Path:
    return Path(state_dir) / job_id.hex() / f"stage-{stage_index}"


def write_checkpoint(directory: Path, snapshot: Snapshot, stage_index: int, keep: int) -> Path:
    """Write `snapshot` atomically as step-<step>.pt, then remove all but the newest `keep`."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{snapshot.step:010d}.pt"
    temp = directory / f".{final.name}.{os.getpid()}.tmp"
    payload = {"format": STATE_FORMAT, "stage": stage_index, "step": snapshot.step,
               "params": snapshot.params, "optimizer": snapshot.optimizer.to_dict()}
    try:
        with open(temp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, final)
    finally:
        temp.unlink(missing_ok=True)
    _fsync_dir(directory)
    for old in checkpoints(directory)[keep:]:
        old.unlink(missing_ok=True)
    return final


def checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, newest first (temp files never match the name)."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _NAME.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(_NAME.fullmatch(p.name).group(1)), reverse=True)


def read_checkpoint(path: Path, stage_index: int) -> Snapshot:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for a damaged file
        raise StateError(f"{path.name}: unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
        raise StateError(f"{path.name}: not a stage checkpoint of format {STATE_FORMAT}")
    if data.get("stage") != stage_index:
        raise StateError(f"{path.name}: holds stage {data.get('stage')!r}, not {stage_index}")
    params, step = data.get("params"), data.get("step")
    if not isinstance(params, dict) or type(step) is not int:
        raise StateError(f"{path.name}: missing params or step")
    try:
        optimizer = OptimizerState.from_dict(data.get("optimizer"))
    except OptimizerStateError as exc:  # the file's optimizer part is damaged; anything else is a bug
        raise StateError(f"{path.name}: {exc}") from None
    return Snapshot(step, params, optimizer)


def newest_checkpoint(directory: Path, stage_index: int) -> Snapshot | None:
    """The newest checkpoint that reads back whole; damaged ones are logged and skipped."""
    for path in checkpoints(directory):
        try:
            return read_checkpoint(path, stage_index)
        except StateError as exc:
            log.warning("skipping checkpoint: %s", exc)
    return None


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
