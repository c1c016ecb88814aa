"""The job most daemon tests train, written as TOML: three one-layer stages of a 32-wide transformer,
plain SGD, small enough that a step takes well under a second on a busy box. `job_spec` merges a test's
own settings over it (every test's job spec is written by it; only a test whose point is a malformed
spec writes its text by hand); `write_job` puts a real corpus (the stdlib's json module source) beside it."""

from __future__ import annotations

import json
from pathlib import Path

TINY_JOB: dict[str, dict] = {
    "model": {"arch": "transformer-lm", "d_model": 32, "n_heads": 2, "layers_per_stage": 1, "vocab": 256},
    "data": {"seq_len": 16},
    "batch": {"global_samples": 4, "microbatch_samples": 2},
    "optim": {"name": "sgd", "lr": 0.05, "schedule": "constant"},
    "pipeline": {"stages": 3},
}


def job_spec(name: str, *, seed: int, steps: int, corpus: Path | None = None, files: list[str] | None = None,
             **sections: dict | None) -> str:
    """TOML of TINY_JOB training on `corpus` (or on the `files` patterns, written as given: a relative
    pattern is read beside the spec, `{stdlib}` is the daemon's standard library), each of `sections`
    merged key by key over its section (or added, when TINY_JOB has no such section). A section given
    as None is left out, and so is a key given as None: the spec then takes swarmd's default."""
    if (corpus is None) == (files is None):
        raise TypeError("job_spec takes one of corpus= and files=")
    merged = {section: dict(values) for section, values in TINY_JOB.items()}
    for section, values in sections.items():
        if values is None:
            merged.pop(section, None)
        else:
            merged.setdefault(section, {}).update(values)
    merged.setdefault("data", {})["files"] = [str(corpus)] if files is None else list(files)
    lines = [f"name = {toml_value(name)}", f"seed = {seed}", f"steps = {steps}"]
    for section, values in merged.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in values.items() if value is not None]
    return "\n".join(lines) + "\n"


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(map(toml_value, value)) + "]"
    raise TypeError(f"no TOML form for {value!r} in a test job spec")


def write_job(where: Path, name: str, *, copies: int = 4, file: str | None = None, **spec) -> tuple[Path, Path]:
    """Write a corpus (the stdlib's json module source, `copies` times: real text, always there)
    and the job's spec under `where`, both named `file` (default: the job's name); return both."""
    stem = file or name
    data, spec_path = where / f"{stem}.txt", where / f"{stem}.toml"
    data.write_text(Path(json.__file__).read_text() * copies)
    spec_path.write_text(job_spec(name, corpus=data, **spec))
    return data, spec_path
