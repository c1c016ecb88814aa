"""Job spec and data: what to train, on which files, and the exact order of samples; no networking.

Layers inside: `spec` (parsing, no filesystem), `data` (token streams and sample order),
`opening` (opening a path as a given user would), `sources` (finding and reading a spec's files).
"""

from swarmd.job.data import MAX_TEXT_BYTES, BatchSampler, ByteTokenizer, Microbatch, TokenDataset, TrainingData
from swarmd.job.errors import DataError, SpecError
from swarmd.job.opening import AccessDenied, Reader
from swarmd.job.sources import GlobLimits, Sources, named_sources, open_training_data, read_tokens, resolve_sources
from swarmd.job.spec import (
    MAX_SPEC_BYTES,
    BatchSpec,
    CheckpointSpec,
    DataSpec,
    EvalSpec,
    JobSpec,
    ModelSpec,
    OptimSpec,
    PipelineSpec,
    WireSpec,
    load_spec,
    parse_toml,
)

__all__ = [
    "MAX_SPEC_BYTES", "MAX_TEXT_BYTES", "AccessDenied", "BatchSampler", "BatchSpec", "ByteTokenizer",
    "CheckpointSpec", "DataError", "DataSpec", "EvalSpec", "GlobLimits", "JobSpec", "Microbatch", "ModelSpec", "OptimSpec",
    "PipelineSpec", "Reader", "SpecError", "Sources", "TokenDataset", "TrainingData", "WireSpec", "load_spec",
    "named_sources", "open_training_data", "parse_toml", "read_tokens", "resolve_sources",
]
