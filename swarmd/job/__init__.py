"""Job spec and data: what to train and the exact order of samples; pure, no networking."""

from swarmd.job.data import (
    MAX_TEXT_BYTES,
    BatchSampler,
    ByteTokenizer,
    Microbatch,
    Sources,
    TokenDataset,
    TrainingData,
    open_training_data,
    read_tokens,
    resolve_sources,
)
from swarmd.job.errors import DataError, SpecError
from swarmd.job.spec import (
    MAX_SPEC_BYTES,
    BatchSpec,
    CheckpointSpec,
    DataSpec,
    JobSpec,
    ModelSpec,
    OptimSpec,
    PipelineSpec,
    WireSpec,
    load_spec,
    parse_toml,
)

__all__ = [
    "MAX_SPEC_BYTES", "MAX_TEXT_BYTES", "BatchSampler", "BatchSpec", "ByteTokenizer", "CheckpointSpec",
    "DataError", "DataSpec", "JobSpec", "Microbatch", "ModelSpec", "OptimSpec", "PipelineSpec", "SpecError",
    "Sources", "TokenDataset", "TrainingData", "WireSpec", "load_spec", "open_training_data", "parse_toml",
    "read_tokens", "resolve_sources",
]
