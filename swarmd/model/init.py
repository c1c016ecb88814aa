"""Pretrained weights in: a stage starts from its slice of an export instead of random init.

`[model] init` names an export directory (or its `model.safetensors`, or any file in that layout),
and `[model] init_digest` the digest of the whole model, `combined_digest` of the per-stage
digests. The weights file carries the per-stage digests in its header (`write_export` puts them
there; a file without them has them computed from its tensors), so a stage peer checks that the
stage digests combine to the spec's digest and that its own slice hashes to its stage's digest
while reading only its own slice's tensors: every peer of the job provably started from the same
bits, and a peer given another file refuses to start rather than train from it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from swarmd.model.export import (
    ExportError,
    combined_digest,
    load_stage_weights,
    params_digest,
    read_stage,
    stage_prefix,
    weights_path,
)
from swarmd.model.registry import build_stage

DIGESTS_KEY = "stage_digests"  # safetensors header metadata: a JSON list of per-stage digests


def stage_digests(init: str | Path) -> list[str]:
    """The per-stage digests of a weights file: from its header, else computed stage by stage."""
    from safetensors import SafetensorError, safe_open

    path = weights_path(init)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            recorded = (f.metadata() or {}).get(DIGESTS_KEY)
            keys = list(f.keys())
    except (OSError, SafetensorError) as exc:
        raise ExportError(f"cannot read {path}: {exc}") from None
    if recorded is not None:
        try:
            digests = json.loads(recorded)
        except ValueError:
            digests = None
        if not (isinstance(digests, list) and all(isinstance(d, str) for d in digests)):
            raise ExportError(f"{path}: header {DIGESTS_KEY} is not a list of digests")
        return digests
    count = 0
    while any(k.startswith(stage_prefix(count)) for k in keys):
        count += 1
    if count == 0:
        raise ExportError(f"{path} holds no stages.<i>.* tensors")
    return [params_digest(read_stage(path, i)) for i in range(count)]


def model_digest(init: str | Path) -> str:
    """What `[model] init_digest` must say for this weights file."""
    return combined_digest(stage_digests(init))


def build_initial_stage(config: Any, stage_index: int, num_stages: int, seed: int,
                        device: torch.device | str = "cpu", init: str | None = None,
                        init_digest: str | None = None) -> torch.nn.Module:
    """`build_stage`, then with `init` its slice of the weights file, verified against
    `init_digest`; raises ExportError naming what does not match."""
    stage = build_stage(config, stage_index, num_stages, seed, "cpu")
    if init is not None:
        digests = stage_digests(init)
        if len(digests) != num_stages:
            raise ExportError(f"{init} holds {len(digests)} stages, the job has {num_stages}: "
                              "weights are split per stage and cannot be re-split")
        if combined_digest(digests) != init_digest:
            raise ExportError(f"{init} is not the model.init_digest the job names "
                              f"({combined_digest(digests)} != {init_digest})")
        params = read_stage(init, stage_index)
        if params_digest(params) != digests[stage_index]:
            raise ExportError(f"{init}: stage {stage_index}'s tensors do not hash to its recorded digest")
        load_stage_weights(stage, params, f"{init} stage {stage_index}")
    return stage.to(device)


def main(argv: list[str] | None = None) -> int:
    """python -m swarmd.model.init PATH: print the digest `[model] init_digest` takes."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m swarmd.model.init", description=main.__doc__)
    parser.add_argument("path", help="an export directory or a weights file in its layout")
    args = parser.parse_args(argv)
    try:
        print(model_digest(args.path))
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
