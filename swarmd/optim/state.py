"""Optimizer state as tensors plus plain values, never pickle.

A peer joining a stage streams this from a live stage-mate (tensors through the transport's codecs,
`meta` as msgpack) and checkpoints hold it via `torch.save(state.to_dict())`, read back with
`torch.load(..., weights_only=True)`. Everything is checked against the receiving optimizer before
it is loaded, so a state from another stage, optimizer or model is refused and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from swarmd.errors import SwarmdError
from swarmd.model.precision import LossScaler
from swarmd.optim.stage_optimizer import StageOptimizer

STATE_FORMAT = 1


class OptimizerStateError(SwarmdError, ValueError):
    """The state does not belong to this optimizer (name, groups, or tensor shapes differ)."""


@dataclass
class OptimizerState:
    tensors: dict[str, torch.Tensor]  # "<param index>/<state key>" -> tensor
    meta: dict[str, Any]  # msgpack-able: format, optimizer, stage, step, scalars, param_groups

    def to_dict(self) -> dict[str, Any]:
        return {"tensors": self.tensors, "meta": self.meta}

    @classmethod
    def from_dict(cls, data: Any) -> "OptimizerState":
        if not (isinstance(data, dict) and isinstance(data.get("tensors"), dict) and isinstance(data.get("meta"), dict)):
            raise OptimizerStateError("expected a dict with 'tensors' and 'meta' dicts")
        if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data["tensors"].items()):
            raise OptimizerStateError("'tensors' must map str keys to tensors")
        return cls(dict(data["tensors"]), dict(data["meta"]))


def export_state(opt: StageOptimizer) -> OptimizerState:
    sd = opt.optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, entries in sd["state"].items():
        for key, value in entries.items():
            target = tensors if isinstance(value, torch.Tensor) else scalars
            target[f"{index}/{key}"] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in sd["param_groups"]]
    meta = {"format": STATE_FORMAT, "optimizer": opt.spec.name, "stage": _stage_of(opt), "step": opt.step_count,
            "scalars": scalars, "param_groups": groups}
    if opt.scaler is not None:
        meta["loss_scale"] = opt.scaler.state()
    return OptimizerState(tensors, meta)


def import_state(opt: StageOptimizer, state: OptimizerState) -> None:
    """Load `state` into `opt` (and its step count, hence its LR), or raise without touching it."""
    meta = state.meta
    if meta.get("format") != STATE_FORMAT:
        raise OptimizerStateError(f"state format {meta.get('format')!r}, expected {STATE_FORMAT}")
    if meta.get("optimizer") != opt.spec.name:
        raise OptimizerStateError(f"state is for {meta.get('optimizer')!r}, this stage runs {opt.spec.name!r}")
    if meta.get("stage") != _stage_of(opt):
        raise OptimizerStateError(f"state is for stage {meta.get('stage')!r}, this is stage {_stage_of(opt)!r}")
    step = meta.get("step")
    if not isinstance(step, int) or step < 0:
        raise OptimizerStateError(f"bad step {step!r}")
    current = opt.optimizer.state_dict()["param_groups"]
    groups = meta.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise OptimizerStateError("'param_groups' must be a list of dicts")
    if [g.get("params") for g in groups] != [g["params"] for g in current]:
        raise OptimizerStateError("parameter groups differ from this stage's")
    shapes = {i: p.shape for i, p in enumerate(p for g in opt.optimizer.param_groups for p in g["params"])}
    scalars = meta.get("scalars", {})
    if not isinstance(scalars, dict):
        raise OptimizerStateError("'scalars' must be a dict")
    per_param: dict[int, dict[str, Any]] = {}
    for index, key, value in _entries(state.tensors, shapes) + _entries(scalars, shapes):
        per_param.setdefault(index, {})[key] = value
    restored = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()} for g in groups]
    scaler = None
    if opt.scaler is not None:  # checked before anything is loaded: a bad scale changes nothing
        scaler = LossScaler(growth_interval=opt.scaler.growth_interval)
        try:
            scaler.load(meta.get("loss_scale"))
        except ValueError as exc:
            raise OptimizerStateError(f"loss_scale: {exc}") from None
    opt.optimizer.load_state_dict({"state": per_param, "param_groups": restored})
    opt.step_count = step
    if scaler is not None:
        opt.scaler.load(scaler.state())


def _stage_of(opt: StageOptimizer) -> int | None:
    """Middle stages share their shapes, so only the index tells their states apart."""
    return getattr(opt.module, "stage_index", None)


def _entries(entries: dict[str, Any], shapes: dict[int, torch.Size]) -> list[tuple[int, str, Any]]:
    out = []
    for name, value in entries.items():
        index_text, _, key = str(name).partition("/")
        if not index_text.isdigit() or int(index_text) not in shapes or not key:
            raise OptimizerStateError(f"state entry {name!r} names no parameter of this stage")
        index = int(index_text)
        if isinstance(value, torch.Tensor) and value.dim() and value.shape != shapes[index]:
            raise OptimizerStateError(f"{name}: shape {list(value.shape)}, parameter is {list(shapes[index])}")
        out.append((index, key, value))
    return out
