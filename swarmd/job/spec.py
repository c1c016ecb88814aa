"""The job spec: one TOML file says what to train, on what data, how, and how to ship tensors.

Its canonical form (every default filled in, keys sorted, msgpack) is what gets published in the DHT
and hashed, with the submitter's public key, into the job id: two submitters of the same file get
two jobs, and no field can change without the id changing.
"""

from __future__ import annotations

import hashlib
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import msgpack

from swarmd.job.errors import SpecError
from swarmd.model.config import ConfigError, parse_table, parse_value, table_to_dict
from swarmd.model.precision import GROWTH_INTERVAL, INITIAL_SCALE, MAX_SCALE, MIN_SCALE
from swarmd.model.registry import UnknownArchitecture, get_architecture
from swarmd.tokenfile import TokenDtype, vocab_problem

# A spec is a few hundred bytes; this bounds what a DHT record or a file can make us parse.
MAX_SPEC_BYTES = 64 * 1024
JOB_ID_DOMAIN = b"swarmd/job/v1\0"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_MAX_SEED = 2**63 - 1  # msgpack and torch generators both take it
# Each CenteredClip iteration is a pass over every gradient part a reducer holds, on every step;
# a spec from the DHT must not make serving daemons spin. A handful already converge (robust.py).
MAX_CLIP_ITERATIONS = 100

@dataclass(frozen=True)
class Limit:
    """An upper bound on one spec field: its constant's name, value, and why it is there."""

    name: str
    value: int | float
    why: str


#: Upper bounds on every numeric field, checked once a spec has parsed (`check_limits`). A spec may
#: come from any peer of the swarm, and every daemon reading it loops over some counts, sizes tensors
#: by others and keeps state for the rest, so each is bounded well above any real run and far below
#: what would exhaust a daemon. What a stage costs in memory is bounded separately, per daemon
#: (`jobs.max_stage_memory`, swarmd.job.budget): these limits only keep every number sane.
LIMITS: dict[str, Limit] = {
    "steps": Limit("MAX_STEPS", 100_000_000, "three years at a step a second; keeps step x microbatch ids "
                                             "below 2^53, exact in every number type they cross"),
    "data.seq_len": Limit("MAX_SEQ_LEN", 65_536, "tokens per sample; attention scores grow with its square"),
    "data.files": Limit("MAX_DATA_PATTERNS", 64, "patterns one spec lists; each is walked on the submitter's daemon"),
    "batch.global_samples": Limit("MAX_GLOBAL_SAMPLES", 1 << 20, "samples per step; a trainer permutes "
                                                                "the dataset in units of it"),
    "batch.microbatch_samples": Limit("MAX_MICROBATCH_SAMPLES", 4096, "samples one forward/backward call carries"),
    "batch.microbatches_per_step": Limit("MAX_MICROBATCHES_PER_STEP", 65_536, "a trainer loops over a step's "
                                                                           "microbatches; stages track their ids"),
    "model.d_model": Limit("MAX_D_MODEL", 32_768, "twice the widest public language models"),
    "model.n_heads": Limit("MAX_HEADS", 1024, "attention heads per layer"),
    "model.d_ff": Limit("MAX_D_FF", 131_072, "4 x MAX_D_MODEL"),
    "model.layers_per_stage": Limit("MAX_LAYERS_PER_STAGE", 1024, "blocks a stage's forward loops over"),
    "model.vocab": Limit("MAX_VOCAB", 1 << 22, "embedding rows one stage allocates; uint16 token files hold ids "
                                              "below 65,536 (checked per data.token_dtype), uint32 files more"),
    "model.max_seq_len": Limit("MAX_SEQ_LEN", 65_536, "rows of the position embedding"),
    "optim.lr": Limit("MAX_LR", 10.0, "past any rate that trains; a typo here wastes every stage's steps"),
    "optim.eps": Limit("MAX_EPS", 1.0, "Adam's denominator floor; larger disables the adaptive step"),
    "optim.weight_decay": Limit("MAX_WEIGHT_DECAY", 10.0, "decay per unit of lr; larger erases the weights"),
    "optim.warmup_steps": Limit("MAX_STEPS", 100_000_000, "as steps"),
    "optim.clip_norm": Limit("MAX_CLIP_NORM", 1e9, "finite; 0 turns clipping off"),
    "optim.clip_tau": Limit("MAX_CLIP_TAU", 1e9, "finite"),
    "optim.outlier_factor": Limit("MAX_OUTLIER_FACTOR", 1e9, "finite"),
    "pipeline.stages": Limit("MAX_STAGES", 64, "every job.get, status and joining tick reads one DHT key per "
                                               "stage; deeper than any SWARM run"),
    "pipeline.microbatches_in_flight": Limit("MAX_IN_FLIGHT", 256, "a trainer holds each one's tensors until "
                                                                   "its backward returns"),
    "checkpoint.every_steps": Limit("MAX_STEPS", 100_000_000, "as steps"),
    "eval.every_steps": Limit("MAX_STEPS", 100_000_000, "as steps"),
    "eval.samples": Limit("MAX_EVAL_SAMPLES", 65_536, "held-out samples one evaluation pushes forward through "
                                                      "every stage; a trainer holds their losses, the data "
                                                      "their windows"),
    "eval.files": Limit("MAX_DATA_PATTERNS", 64, "as data.files"),
    "eval.holdout": Limit("MAX_HOLDOUT", 0.5, "a fraction of the data never trained on; past half, the "
                                              "job would train on the smaller part"),
}
# How much forward work evaluation may add to training's, a spec from the DHT being what sets it:
# eval.samples over eval.every_steps steps of batch.global_samples samples each. At 1, evaluation's
# forwards are at most the forwards training makes between two evaluations (and a training sample
# also costs a backward: twice a forward), so a spec cannot turn serving daemons into evaluators.
MAX_EVAL_SHARE = 1


Codec = Literal["none", "fp16", "lz4", "fp16+lz4", "int8"]
# The stage all-reduce's codecs (swarmd.stage.packing.ALLREDUCE_CODECS): no int8, whose rounding of
# a sum without error feedback biases every step.
AllreduceCodec = Literal["none", "lz4", "fp16", "fp16+lz4"]
# How each stage's all-reduce combines its members' gradients (swarmd/stage/robust.py); the names
# are swarmd.stage.robust.AGGREGATES.
Aggregate = Literal["mean", "centered_clip"]


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    config: Any  # the architecture's frozen config dataclass
    init: str | None = None  # pretrained weights every stage starts from (swarmd.model.init)
    init_digest: str | None = None  # their combined digest, which every stage peer verifies


@dataclass(frozen=True)
class DataSpec:
    """Either text `files` (globs; `{stdlib}` is Python's stdlib dir; relative to the spec file)
    read as bytes, or a `.bin` file of little-endian uint16 (nanoGPT's) or uint32 `tokens`."""

    seq_len: int
    files: tuple[str, ...] | None = None
    tokens: str | None = None
    token_dtype: TokenDtype = "uint16"  # the width of the ids in `tokens` (swarmd/tokenfile.py)

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ConfigError("seq_len", "must be at least 1")
        if (self.files is None) == (self.tokens is None):
            raise ConfigError("files", "give exactly one of data.files and data.tokens")
        if self.files is not None and not self.files:
            raise ConfigError("files", "must list at least one pattern")
        if self.token_dtype != "uint16" and self.tokens is None:
            raise ConfigError("token_dtype", "is only meaningful with data.tokens")


@dataclass(frozen=True)
class BatchSpec:
    global_samples: int
    microbatch_samples: int

    def __post_init__(self) -> None:
        for name in ("global_samples", "microbatch_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be at least 1")
        if self.global_samples % self.microbatch_samples:
            raise ConfigError("global_samples", f"{self.global_samples} is not a multiple of "
                                                f"batch.microbatch_samples ({self.microbatch_samples})")

    @property
    def microbatches_per_step(self) -> int:
        return self.global_samples // self.microbatch_samples


@dataclass(frozen=True)
class OptimSpec:
    name: Literal["adamw", "lamb", "sgd"] = "adamw"
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    momentum: float = 0.9  # sgd only
    weight_decay: float = 0.1  # never applied to norms and biases
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 0
    min_lr: float = 0.0  # where cosine and linear decay end, at the job's last step
    clip_norm: float = 1.0  # on each stage's averaged gradient; 0 turns clipping off
    # The stage all-reduce's combination. Every member of a round must combine alike (they must
    # reach the same verdicts), so it is the job's choice, not a daemon's; the defaults are
    # StageLimits' (swarmd/stage/limits.py says what each bounds).
    aggregate: Aggregate = "mean"
    clip_tau: float = 10.0  # centered_clip: bound on a peer's per-sample distance from the aggregate
    clip_iterations: int = 3  # centered_clip
    outlier_factor: float = 2.0  # centered_clip: reported past this many clip_tau

    def __post_init__(self) -> None:
        checks = [
            ("lr", 0 < self.lr < math.inf, "must be positive and finite"),
            ("betas", all(0 <= b < 1 for b in self.betas), "must each be in [0, 1)"),
            ("eps", self.eps > 0, "must be positive"),
            ("momentum", 0 <= self.momentum < 1, "must be in [0, 1)"),
            ("weight_decay", self.weight_decay >= 0, "must not be negative"),
            ("warmup_steps", self.warmup_steps >= 0, "must not be negative"),
            ("min_lr", 0 <= self.min_lr <= self.lr, "must be in [0, optim.lr]"),
            ("clip_norm", self.clip_norm >= 0, "must not be negative (0 turns clipping off)"),
            ("clip_tau", 0 < self.clip_tau < math.inf, "must be positive and finite"),
            ("clip_iterations", 1 <= self.clip_iterations <= MAX_CLIP_ITERATIONS,
             f"must be in [1, {MAX_CLIP_ITERATIONS}]"),
            ("outlier_factor", 0 < self.outlier_factor < math.inf, "must be positive and finite"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise ConfigError(name, message)


@dataclass(frozen=True)
class WireSpec:
    """Codecs for the activations (forward) and gradients (backward) that cross the network, and
    for the gradient sums stage-mates all-reduce. `allreduce` is the job's choice, not a daemon's:
    the numbers every stage steps on depend on it (fp16: within 2^-11 of the exact sum; "none":
    bit-for-bit the single-process fp32 reference), and every member of a round steps alike
    either way (swarmd/stage/packing.py)."""

    activations: Codec = "fp16+lz4"
    gradients: Codec = "fp16+lz4"
    allreduce: AllreduceCodec = "fp16"


@dataclass(frozen=True)
class PipelineSpec:
    stages: int = 1
    microbatches_in_flight: int = 4  # per trainer: enough to keep every stage busy
    delayed_updates: bool = False

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ConfigError("stages", "must be at least 1")
        if self.microbatches_in_flight < 1:
            raise ConfigError("microbatches_in_flight", "must be at least 1")


@dataclass(frozen=True)
class CheckpointSpec:
    every_steps: int = 100  # 0: never

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ConfigError("every_steps", "must not be negative (0: never)")


@dataclass(frozen=True)
class ComputeSpec:
    """[compute]: the precision policy every stage and the reference follow (swarmd/model/precision.py).
    Bounds: the loss scale's are the scaler's own; growth past a million clean steps is never."""

    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scale: float = INITIAL_SCALE  # fp16 only: each stage's starting scale
    growth_interval: int = GROWTH_INTERVAL  # fp16 only: clean steps before a stage doubles its scale
    # The optimizer's state in host memory (pinned on a GPU), stepped there (StageOptimizer's
    # `offload`): the same arithmetic, device memory for a bigger stage. The job's choice, so every
    # peer of a stage steps its optimizer on the same kind of device.
    optimizer_offload: bool = False

    def __post_init__(self) -> None:
        if not MIN_SCALE <= self.loss_scale <= MAX_SCALE:
            raise ConfigError("loss_scale", f"must be in [{MIN_SCALE:g}, {MAX_SCALE:g}]")
        if not 1 <= self.growth_interval <= MAX_GROWTH_INTERVAL:
            raise ConfigError("growth_interval", f"must be in [1, {MAX_GROWTH_INTERVAL}]")


MAX_GROWTH_INTERVAL = 1_000_000


@dataclass(frozen=True)
class EvalSpec:
    """[eval]: held-out evaluation (docs/jobs.md, "Held-out evaluation"). After every `every_steps`
    commits (and after the last step) a trainer pushes the same `samples` held-out samples forward
    through the swarm and reports their mean loss. They come either from a `holdout` fraction of
    the data's samples, drawn from the job's seed and never sampled by training, or from `files`
    of their own (globs as `data.files`, read as `[data]` is: text bytes, or with `data.tokens`
    one token file of `data.token_dtype`). `every_steps = 0` (the default, and the only value an
    absent table gives) evaluates never."""

    every_steps: int = 0
    samples: int = 0
    holdout: float = 0.0
    files: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ConfigError("every_steps", "must not be negative (0: never)")
        if self.every_steps == 0:
            if self.samples or self.holdout or self.files is not None:
                raise ConfigError("every_steps", "must be at least 1 when eval.samples, eval.holdout or "
                                                 "eval.files is set")
            return
        if self.samples < 1:
            raise ConfigError("samples", "must be at least 1 (held-out samples per evaluation)")
        if self.files is not None:
            if self.holdout:
                raise ConfigError("files", "give exactly one of eval.holdout and eval.files")
            if not self.files:
                raise ConfigError("files", "must list at least one pattern")
        elif not self.holdout > 0:  # NaN too; the upper bound is LIMITS' MAX_HOLDOUT
            raise ConfigError("holdout", "must be a positive fraction of the data's samples (or give eval.files)")

    @property
    def enabled(self) -> bool:
        return self.every_steps > 0

    def due(self, committed: int, steps: int) -> bool:
        """Is an evaluation due once `committed` steps are committed (of the job's `steps`)?"""
        return self.enabled and committed > 0 and (committed % self.every_steps == 0 or committed == steps)

_SECTIONS: dict[str, type] = {"data": DataSpec, "batch": BatchSpec, "optim": OptimSpec, "wire": WireSpec,
                              "pipeline": PipelineSpec, "checkpoint": CheckpointSpec}
_REQUIRED = ("name", "steps", "model", "data", "batch")


@dataclass(frozen=True)
class JobSpec:
    name: str
    steps: int
    model: ModelSpec
    data: DataSpec
    batch: BatchSpec
    seed: int = 0
    optim: OptimSpec = field(default_factory=OptimSpec)
    wire: WireSpec = field(default_factory=WireSpec)
    pipeline: PipelineSpec = field(default_factory=PipelineSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    compute: ComputeSpec = field(default_factory=ComputeSpec)
    eval: EvalSpec = field(default_factory=EvalSpec)

    @classmethod
    def from_dict(cls, raw: Any) -> "JobSpec":
        """Validate a spec table (from TOML or from `to_dict`); raises `SpecError` naming the field."""
        try:
            return _parse(raw)
        except SpecError:
            raise
        except ConfigError as exc:
            raise SpecError(exc.field, exc.message) from None

    @classmethod
    def from_msgpack(cls, data: bytes) -> "JobSpec":
        if len(data) > MAX_SPEC_BYTES:
            raise SpecError("<spec>", f"{len(data)} bytes exceeds MAX_SPEC_BYTES ({MAX_SPEC_BYTES})")
        try:
            raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except (ValueError, msgpack.UnpackException) as exc:
            raise SpecError("<spec>", f"not a msgpack spec: {exc}") from None
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        """The canonical form: every default filled in, keys sorted, only msgpack-able values."""
        out = table_to_dict({name: getattr(self, name) for name in ("name", "seed", "steps", *_SECTIONS)})
        if self.data.token_dtype == "uint16":
            del out["data"]["token_dtype"]  # nanoGPT's width, left out as [compute] is: ids unchanged
        if self.wire.allreduce == WireSpec.allreduce:
            del out["wire"]["allreduce"]  # likewise: a job that keeps the default keeps its id
        if self.compute != ComputeSpec():
            # Only when set: a default job's canonical form (and id) stays what daemons that
            # predate [compute] publish and accept.
            out["compute"] = table_to_dict(self.compute)
        if self.eval.enabled:  # likewise: a job without [eval] keeps the id it had before [eval] existed
            out["eval"] = {k: v for k, v in table_to_dict(self.eval).items() if v is not None}
        init = {k: v for k, v in (("init", self.model.init), ("init_digest", self.model.init_digest)) if v is not None}
        out["model"] = dict(sorted({"arch": self.model.arch, **table_to_dict(self.model.config), **init}.items()))
        return dict(sorted(out.items()))

    def to_msgpack(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    def job_id(self, submitter_public_key: bytes) -> bytes:
        """32 bytes naming this job of this submitter; a hex form is what users type."""
        return hashlib.sha256(JOB_ID_DOMAIN + self.to_msgpack() + bytes(submitter_public_key)).digest()


def parse_toml(text: str) -> JobSpec:
    try:
        raw = tomllib.loads(text)
    except ValueError as exc:  # TOMLDecodeError, or one of tomllib's limits (an int of over 4300 digits)
        raise SpecError("<toml>", str(exc)) from None
    return JobSpec.from_dict(raw)


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a spec file. Its data is not looked for: parsing never walks the
    filesystem (`swarmd.job.sources.resolve_sources(spec.data, path.parent)` does)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_SPEC_BYTES:
            raise SpecError("<spec>", f"{path} is {size} bytes, over MAX_SPEC_BYTES ({MAX_SPEC_BYTES})")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError("<spec>", f"cannot read {path}: {exc}") from None
    return parse_toml(text)


def _parse(raw: Any) -> JobSpec:
    if not isinstance(raw, Mapping):
        raise SpecError("<spec>", "must be a table")
    known = {"name", "seed", "steps", "model", "compute", "eval", *_SECTIONS}
    for key in raw:
        if key not in known:
            raise SpecError(str(key), f"unknown key (known: {', '.join(sorted(known))})")
    for key in _REQUIRED:
        if key not in raw:
            raise SpecError(key, "is required")
    name = parse_value(raw["name"], str, "name")
    if not _NAME.fullmatch(name):
        raise SpecError("name", "must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    seed = parse_value(raw.get("seed", 0), int, "seed")
    if not 0 <= seed <= _MAX_SEED:
        raise SpecError("seed", f"must be in [0, {_MAX_SEED}]")
    steps = parse_value(raw["steps"], int, "steps")
    if steps < 1:
        raise SpecError("steps", "must be at least 1")
    sections = {key: parse_table(cls, raw.get(key, {}), key) for key, cls in _SECTIONS.items()}
    model = _parse_model(raw["model"], sections["data"])
    compute = parse_table(ComputeSpec, raw.get("compute", {}), "compute")
    evaluation = parse_table(EvalSpec, raw.get("eval", {}), "eval")
    if evaluation.files is not None and sections["data"].tokens is not None and len(evaluation.files) != 1:
        raise SpecError("eval.files", "with data.tokens, names one token file (of data.token_dtype)")
    spec = JobSpec(name=name, seed=seed, steps=steps, model=model, compute=compute, eval=evaluation, **sections)
    check_limits(spec)
    _check_eval_share(spec)
    return spec


def _check_eval_share(spec: JobSpec) -> None:
    """eval.samples within MAX_EVAL_SHARE of the samples trained between two evaluations."""
    allowed = MAX_EVAL_SHARE * spec.eval.every_steps * spec.batch.global_samples
    if spec.eval.enabled and spec.eval.samples > allowed:
        raise SpecError("eval.samples", f"is {spec.eval.samples}, over MAX_EVAL_SHARE ({MAX_EVAL_SHARE}) x "
                                        f"eval.every_steps ({spec.eval.every_steps}) x batch.global_samples "
                                        f"({spec.batch.global_samples}) = {allowed}: evaluation may not make "
                                        "more forward work than the training between two evaluations")


def eval_data_spec(data: DataSpec, evaluation: EvalSpec) -> DataSpec:
    """The `[data]` table `eval.files` stands for: the same seq_len and kind of file."""
    files = evaluation.files
    if files is None:
        raise ValueError("this [eval] has no files")
    if data.tokens is not None:
        return DataSpec(seq_len=data.seq_len, tokens=files[0], token_dtype=data.token_dtype)
    return DataSpec(seq_len=data.seq_len, files=files)


def check_limits(spec: JobSpec) -> None:
    """Raise `SpecError` naming the first field past its `LIMITS` entry. A model field is checked
    when the architecture's config has it (transformer-lm has them all; a plugin's own fields are
    its own to bound)."""
    for dotted, limit in LIMITS.items():
        value = _field_value(spec, dotted)
        if value is not None and value > limit.value:
            raise SpecError(dotted, f"is {value}, over {limit.name} ({limit.value}): {limit.why}")


def _field_value(spec: JobSpec, dotted: str) -> int | float | None:
    section, _, name = dotted.rpartition(".")
    holder = spec.model.config if section == "model" else getattr(spec, section) if section else spec
    value = getattr(holder, name, None)
    if isinstance(value, tuple):  # data.files: the count of patterns
        return len(value)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _parse_model(raw: Any, data: DataSpec) -> ModelSpec:
    if not isinstance(raw, Mapping):
        raise SpecError("model", "must be a table")
    if "arch" not in raw:
        raise SpecError("model.arch", "is required")
    arch_name = parse_value(raw["arch"], str, "model.arch")
    try:
        arch = get_architecture(arch_name)
    except UnknownArchitecture as exc:
        raise SpecError("model.arch", str(exc)) from None
    init, init_digest = _parse_model_init(raw)
    try:
        config = arch.parse_config({k: v for k, v in raw.items() if k not in ("arch", *_INIT_KEYS)}, data.seq_len)
    except ConfigError as exc:
        raise SpecError(f"model.{exc.field}", exc.message) from None
    if data.files is not None and config.vocab < 256:
        raise SpecError("model.vocab", f"is {config.vocab}, but byte-level text needs at least 256")
    if data.tokens is not None and (problem := vocab_problem(data.token_dtype, config.vocab)):
        raise SpecError("model.vocab", problem)
    return ModelSpec(arch_name, config, init, init_digest)


# ---------------------------------------------------------------------------------------- [model] init
# Pretrained weights (docs/models.md). Every stage peer opens `init` itself, so it is an absolute
# path (a relative one would mean a different file on each daemon); the digest is what makes those
# files provably the same bits, so it is required with `init`.
_INIT_KEYS = ("init", "init_digest")
MAX_INIT_PATH_BYTES = 4096  # Linux's PATH_MAX: no longer path can be opened anyway
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def _parse_model_init(raw: Mapping[str, Any]) -> tuple[str | None, str | None]:
    init = parse_value(raw.get("init"), str | None, "model.init")
    digest = parse_value(raw.get("init_digest"), str | None, "model.init_digest")
    if init is None:
        if digest is not None:
            raise SpecError("model.init_digest", "is only meaningful with model.init")
        return None, None
    if len(init.encode()) > MAX_INIT_PATH_BYTES or "\0" in init or not init.startswith("/"):
        raise SpecError("model.init", f"must be an absolute path of at most {MAX_INIT_PATH_BYTES} bytes: "
                                      "every stage peer opens it where it runs")
    if digest is None or not _DIGEST.fullmatch(digest):
        raise SpecError("model.init_digest", "is required with model.init: 'sha256:' and 64 hex digits, "
                                             "as `python -m swarmd.model.init PATH` prints it")
    return init, digest
