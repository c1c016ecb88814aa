"""Architectures by name: `transformer-lm` and `llama` built in, more from the `swarmd.architectures` entry points.

A job spec names its architecture as a string so that it can be published in the DHT and rebuilt by
any daemon; a plugin package adds one with an entry point whose object is an `Architecture`:

    [project.entry-points."swarmd.architectures"]
    my-arch = "my_package.arch:ARCHITECTURE"
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable, Mapping

import torch

from swarmd.errors import LocalError
from swarmd.model.llama import LlamaConfig, build_llama_stage, parse_llama_config
from swarmd.model.stage import Stage
from swarmd.model.transformer import TransformerConfig, build_transformer_stage, parse_transformer_config

ENTRY_POINT_GROUP = "swarmd.architectures"


class UnknownArchitecture(LocalError, LookupError):
    """No built-in architecture and no installed entry point has this name."""


@dataclass(frozen=True)
class Architecture:
    """How to read an architecture's config and build any of its stages.

    `parse_config(raw_model_table_without_arch, data_seq_len)` returns a frozen config dataclass (read
    it with `swarmd.model.config.parse_table`, raise `ConfigError` naming the key); the config must
    have a `vocab` field and no `arch` field (that key names the architecture in the spec).
    `build_stage(config, stage_index, num_stages, seed, device)` must initialise deterministically
    from (seed, stage_index), e.g. with `swarmd.model.stage.init_generator`.
    """

    name: str
    config_type: type
    parse_config: Callable[[Mapping[str, Any], int], Any]
    build_stage: Callable[..., Stage]


TRANSFORMER_LM = Architecture("transformer-lm", TransformerConfig, parse_transformer_config,
                              build_transformer_stage)
LLAMA = Architecture("llama", LlamaConfig, parse_llama_config, build_llama_stage)
_BUILTIN = {arch.name: arch for arch in (TRANSFORMER_LM, LLAMA)}


def available() -> list[str]:
    """Every architecture name that `get_architecture` can resolve, without importing plugins."""
    return sorted(set(_BUILTIN) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def get_architecture(name: str) -> Architecture:
    if name in _BUILTIN:
        return _BUILTIN[name]
    for ep in entry_points(group=ENTRY_POINT_GROUP, name=name):
        try:
            arch = ep.load()
        except Exception as exc:  # a plugin's import error is its own; report it as this lookup's failure
            raise UnknownArchitecture(f"entry point {ep.value!r} for {name!r} failed to load: {exc!r}") from exc
        if not isinstance(arch, Architecture) or arch.name != name:
            raise UnknownArchitecture(f"entry point {ep.value!r} for {name!r} is not an Architecture named {name!r}")
        return arch
    raise UnknownArchitecture(f"unknown architecture {name!r} (available: {', '.join(available())})")


def architecture_of(config: Any) -> Architecture:
    """The architecture whose config type `config` is: configs carry their architecture with them."""
    for arch in _BUILTIN.values():
        if isinstance(config, arch.config_type):
            return arch
    for name in available():
        try:
            arch = get_architecture(name)
        except UnknownArchitecture:
            continue  # a broken plugin cannot be the owner of a config that exists
        if isinstance(config, arch.config_type):
            return arch
    raise UnknownArchitecture(f"no architecture takes a {type(config).__name__}")


def build_stage(config: Any, stage_index: int, num_stages: int, seed: int,
                device: torch.device | str = "cpu") -> Stage:
    """Stage `stage_index` of `num_stages`; every caller with the same arguments gets identical bits."""
    return architecture_of(config).build_stage(config, stage_index, num_stages, seed, device)
