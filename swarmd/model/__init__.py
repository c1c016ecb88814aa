"""Architecture registry, stage split and deterministic init; no parallelism and no networking here."""

from swarmd.model.composed import ComposedModel, build_reference
from swarmd.model.config import ConfigError
from swarmd.model.registry import (
    ENTRY_POINT_GROUP,
    Architecture,
    UnknownArchitecture,
    architecture_of,
    available,
    build_stage,
    get_architecture,
)
from swarmd.model.export import ExportError, load_model, write_export
from swarmd.model.llama import LlamaConfig
from swarmd.model.stage import Stage, TensorSpec, derive_seed, init_generator
from swarmd.model.transformer import TransformerConfig

__all__ = [
    "ENTRY_POINT_GROUP", "Architecture", "ComposedModel", "ConfigError", "ExportError", "LlamaConfig", "Stage", "TensorSpec",
    "TransformerConfig", "UnknownArchitecture", "architecture_of", "available", "build_reference",
    "build_stage", "derive_seed", "get_architecture", "init_generator", "load_model", "write_export",
]
