"""The trained model out of the swarm, and weights into it: one `safetensors` file and a `config.json`.

Layout of an export directory (docs/models.md):

    model.safetensors   every stage's parameters, named as `ComposedModel`'s state dict
                        (`stages.<i>.<name>`), fp32, loadable with the `safetensors` package alone
    config.json         format, architecture, its config, num_stages, the job spec, the job id,
                        step, and per stage its step, digest and where it came from

A digest names a stage's parameters by content (names, dtypes, shapes and bytes), so a fine-tuning
job can record in its spec which bits it starts from and every stage peer can check its own slice
without reading the others'. Nothing here touches the network: `swarmd.jobs.exporting` gathers the
stages, `swarmctl export` assembles and writes them with these functions.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarmd.errors import SwarmdError
from swarmd.model.composed import ComposedModel
from swarmd.model.config import ConfigError, table_to_dict
from swarmd.model.registry import architecture_of, build_stage, get_architecture, UnknownArchitecture

EXPORT_FORMAT = "swarmd-export/1"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# config.json is a few kilobytes (the spec is bounded by MAX_SPEC_BYTES); a bigger one is not ours.
MAX_CONFIG_BYTES = 1 << 20


class ExportError(SwarmdError):
    """An export or init file is missing, malformed, or does not hold the bits it claims, or a live
    peer's state does not match the model: our file or their answer, so it sits under the root."""


def stage_prefix(stage_index: int) -> str:
    return f"stages.{stage_index}."


def params_digest(params: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor in name order."""
    h = hashlib.sha256()
    for name in sorted(params):
        t = params[name].detach().to("cpu").contiguous()
        h.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()


def combined_digest(stage_digests: list[str]) -> str:
    """The digest of a whole model: of its stages' digests in stage order."""
    return "sha256:" + hashlib.sha256("\n".join(stage_digests).encode()).hexdigest()


@dataclass
class StageWeights:
    stage: int
    step: int
    params: dict[str, torch.Tensor]  # the stage's own names (`blocks.0.attn.q.weight`)
    source: str  # "peer <addr>" or "checkpoint <path>": for the record


def write_export(directory: str | Path, config: Any, num_stages: int, job: dict[str, Any], job_id: str,
                 stages: list[StageWeights]) -> Path:
    """Write model.safetensors and config.json into `directory` (created), each atomically."""
    from safetensors.torch import save_file

    if sorted(s.stage for s in stages) != list(range(num_stages)):
        raise ExportError(f"need stages 0..{num_stages - 1}, got {sorted(s.stage for s in stages)}")
    stages = sorted(stages, key=lambda s: s.stage)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {stage_prefix(s.stage) + name: t.detach().to("cpu").contiguous()
               for s in stages for name, t in s.params.items()}
    digests = [params_digest(s.params) for s in stages]
    meta = {"format": EXPORT_FORMAT, "architecture": architecture_of(config).name,
            "config": table_to_dict(config), "num_stages": num_stages, "job": job, "job_id": job_id,
            "step": min(s.step for s in stages), "digest": combined_digest(digests),
            "stages": [{"stage": s.stage, "step": s.step, "digest": d, "source": s.source}
                       for s, d in zip(stages, digests)]}
    header = {"format": EXPORT_FORMAT, "stage_digests": json.dumps(digests)}  # swarmd.model.init reads these
    _atomic(directory / WEIGHTS_FILE, lambda path: save_file(tensors, str(path), metadata=header))
    _atomic(directory / CONFIG_FILE, lambda path: path.write_text(json.dumps(meta, indent=1) + "\n"))
    return directory


def _atomic(final: Path, write) -> None:
    temp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        write(temp)
        os.replace(temp, final)
    finally:
        temp.unlink(missing_ok=True)


def read_config(directory: str | Path) -> dict[str, Any]:
    """config.json of an export, checked for the fields the loaders use."""
    path = Path(directory) / CONFIG_FILE
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ExportError(f"{path} is over {MAX_CONFIG_BYTES} bytes")
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read {path}: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{path} is not a {EXPORT_FORMAT} config")
    stages = meta.get("stages")
    n = meta.get("num_stages")
    if type(n) is not int or n < 1 or not isinstance(stages, list) or len(stages) != n or not all(
            isinstance(s, dict) and isinstance(s.get("digest"), str) for s in stages):
        raise ExportError(f"{path}: num_stages and stages do not agree")
    return meta


MAX_WEIGHTS_BYTES = 1 << 40
"""1 TiB: past any model a swarm of this kind trains; a weights file named by a job spec (which a
stranger may publish) is refused past it before anything of it is read."""


def weights_path(init: str | Path) -> Path:
    """An export directory's weights file, or the file itself when `init` names one; refused
    (ExportError) unless it is a regular file within `MAX_WEIGHTS_BYTES`. `[model] init` comes from
    a job spec, possibly a stranger's: a FIFO would block the reading thread for ever and a device
    (`/dev/zero`) would be read without end, so the kind is checked on a descriptor opened without
    blocking before the safetensors reader opens the path."""
    path = Path(init)
    path = path / WEIGHTS_FILE if path.is_dir() else path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ExportError(f"cannot open {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(info.st_mode):
        raise ExportError(f"{path} is not a regular file")
    if info.st_size > MAX_WEIGHTS_BYTES:
        raise ExportError(f"{path} is {info.st_size} bytes, over MAX_WEIGHTS_BYTES ({MAX_WEIGHTS_BYTES})")
    return path


def model_config(meta: dict[str, Any]) -> Any:
    """The architecture config an export's config.json describes."""
    try:
        arch = get_architecture(str(meta.get("architecture")))
        seq_len = meta.get("job", {}).get("data", {}).get("seq_len", 1)
        return arch.parse_config(meta.get("config") or {}, seq_len)
    except (UnknownArchitecture, ConfigError, AttributeError) as exc:
        raise ExportError(f"config.json: {exc}") from None


def read_stage(init: str | Path, stage_index: int) -> dict[str, torch.Tensor]:
    """Stage `stage_index`'s parameters alone (its own names), read from the file without the
    other stages' tensors ever being loaded."""
    from safetensors import SafetensorError, safe_open

    path, prefix = weights_path(init), stage_prefix(stage_index)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {key[len(prefix):]: f.get_tensor(key) for key in f.keys() if key.startswith(prefix)}
    except (OSError, SafetensorError) as exc:
        raise ExportError(f"cannot read {path}: {exc}") from None


def load_stage_weights(stage: torch.nn.Module, params: dict[str, torch.Tensor], what: str) -> None:
    """Copy `params` into `stage`, refusing any difference of names, shapes or dtypes."""
    own = stage.state_dict()
    if set(own) != set(params):
        raise ExportError(f"{what}: parameter names differ from the model's: "
                          f"{sorted(set(own) ^ set(params))[:4]}")
    for name, tensor in params.items():
        if tensor.shape != own[name].shape or tensor.dtype != own[name].dtype:
            raise ExportError(f"{what}: {name} is {tensor.dtype}{list(tensor.shape)}, the model has "
                              f"{own[name].dtype}{list(own[name].shape)}")
    stage.load_state_dict(params, strict=True)


def load_model(directory: str | Path, device: torch.device | str = "cpu") -> ComposedModel:
    """The whole exported model as one plain module (no swarm), each stage checked against its
    recorded digest; `model.generate(...)` samples from it."""
    meta = read_config(directory)
    config = model_config(meta)
    n = meta["num_stages"]
    stages = []
    for i in range(n):
        params = read_stage(directory, i)
        if params_digest(params) != meta["stages"][i]["digest"]:
            raise ExportError(f"stage {i}: the weights' digest is not the one config.json records")
        stage = build_stage(config, i, n, seed=0)
        load_stage_weights(stage, params, f"stage {i}")
        stages.append(stage)
    return ComposedModel(stages).to(device).eval()


class StageAssembly:
    """A stage's parameters arriving in pieces (`job.export`), written into tensors allocated from
    the stage's own shapes, in order and exactly once each, refused unless whole and finite."""

    def __init__(self, stage: torch.nn.Module, stage_index: int, step: Any, source: Any, declared: Any) -> None:
        if type(step) is not int or step < 0 or not isinstance(source, str):
            raise ExportError(f"stage {stage_index}: bad step {step!r} or source")
        own = stage.state_dict()
        described = {e[0]: e[1] for e in declared if isinstance(e, list) and len(e) == 3} \
            if isinstance(declared, list) else None
        if described != {name: list(t.shape) for name, t in own.items()}:
            raise ExportError(f"stage {stage_index}: the daemon's parameters differ from the model's")
        self.index, self.step, self.source = stage_index, step, source
        self.params = {name: torch.empty_like(t) for name, t in own.items()}
        self.filled = dict.fromkeys(own, 0)

    def put(self, pieces: Any, tensors: list[torch.Tensor]) -> None:
        if not isinstance(pieces, list) or len(pieces) != len(tensors):
            raise ExportError(f"stage {self.index}: pieces and tensors do not match")
        for piece, part in zip(pieces, tensors):
            if not (isinstance(piece, list) and len(piece) == 2 and piece[0] in self.params):
                raise ExportError(f"stage {self.index}: bad piece {piece!r}")
            name, offset = piece
            target = self.params[name].view(-1)
            if (part.dtype != target.dtype or part.dim() != 1 or offset != self.filled[name]
                    or offset + part.numel() > target.numel()):
                raise ExportError(f"stage {self.index}: piece of {name} at {offset} does not fit")
            if part.is_floating_point() and not bool(torch.isfinite(part).all()):
                raise ExportError(f"stage {self.index}: {name} is not finite")
            target[offset: offset + part.numel()] = part
            self.filled[name] += part.numel()

    def finish(self) -> StageWeights:
        for name, count in self.filled.items():
            if count != self.params[name].numel():
                raise ExportError(f"stage {self.index}: {name}: {count} of {self.params[name].numel()} elements arrived")
        return StageWeights(self.index, self.step, self.params, self.source)
