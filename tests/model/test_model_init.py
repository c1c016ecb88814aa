"""Pretrained weights in (`[model] init`): each stage loads and verifies only its slice, the spec's
digest names the bits, and fine-tuning from an export continues its loss curve."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from swarmd.job import JobSpec, SpecError
from swarmd.model import ExportError, LlamaConfig, build_stage, load_model, write_export
from swarmd.model.export import StageWeights, read_config
from swarmd.model.init import build_initial_stage, main, model_digest, stage_digests
from swarmd.reference import ReferenceTrainer

torch.set_num_threads(1)

CONFIG = LlamaConfig(d_model=32, n_heads=4, n_kv_heads=2, max_seq_len=16)
CORPUS = Path(json.__file__).read_text() * 3


def export_of(tmp_path: Path, seed: int = 1, stages: int = 2, **spec) -> Path:
    weights = [StageWeights(i, 7, build_stage(CONFIG, i, stages, seed).state_dict(), "test") for i in range(stages)]
    return write_export(tmp_path / f"export-{seed}-{stages}", CONFIG, stages, spec, "00" * 32, weights)


def test_export_round_trip_and_slice_loading(tmp_path):
    out = export_of(tmp_path)
    meta = read_config(out)
    assert meta["digest"] == model_digest(out) == model_digest(out / "model.safetensors")
    model = load_model(out)
    for i in range(2):
        expected = build_stage(CONFIG, i, 2, seed=1).state_dict()
        got = build_initial_stage(CONFIG, i, 2, seed=99, init=str(out), init_digest=meta["digest"]).state_dict()
        assert all(torch.equal(got[k], expected[k]) for k in expected)
        assert all(torch.equal(model.stages[i].state_dict()[k], expected[k]) for k in expected)


def test_a_file_without_recorded_digests_is_hashed_per_stage(tmp_path):
    from safetensors.torch import load_file, save_file

    out = export_of(tmp_path)
    bare = tmp_path / "bare.safetensors"
    save_file(load_file(str(out / "model.safetensors")), str(bare))  # no header metadata
    assert stage_digests(bare) == [s["digest"] for s in read_config(out)["stages"]]
    assert model_digest(bare) == read_config(out)["digest"]


def test_wrong_bits_stage_count_or_shape_are_refused(tmp_path):
    out = export_of(tmp_path)
    digest = read_config(out)["digest"]
    other = export_of(tmp_path, seed=2)
    with pytest.raises(ExportError, match="init_digest"):
        build_initial_stage(CONFIG, 0, 2, seed=1, init=str(other), init_digest=digest)
    with pytest.raises(ExportError, match="holds 2 stages, the job has 3"):
        build_initial_stage(CONFIG, 0, 3, seed=1, init=str(out), init_digest=digest)
    wider = dataclasses.replace(CONFIG, d_ff=96)
    with pytest.raises(ExportError, match="model has"):
        build_initial_stage(wider, 0, 2, seed=1, init=str(out), init_digest=digest)
    with pytest.raises(ExportError, match="cannot (read|open)"):
        build_initial_stage(CONFIG, 0, 2, seed=1, init=str(tmp_path / "nothing"), init_digest=digest)


def test_tampered_slice_is_refused(tmp_path):
    """The header's digests match the spec, but a stage's tensors were changed after: refused."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = export_of(tmp_path)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["stages.1.head.weight"][0, 0] += 1
    save_file(tensors, str(out / "model.safetensors"), metadata=header)
    digest = read_config(out)["digest"]
    build_initial_stage(CONFIG, 0, 2, seed=1, init=str(out), init_digest=digest)  # its own slice is intact
    with pytest.raises(ExportError, match="stage 1's tensors do not hash"):
        build_initial_stage(CONFIG, 1, 2, seed=1, init=str(out), init_digest=digest)


def test_spec_fields(tmp_path, capsys):
    base = {"name": "f", "steps": 1, "model": {"arch": "llama", "d_model": 32, "n_heads": 4},
            "data": {"files": ["x"], "seq_len": 8}, "batch": {"global_samples": 2, "microbatch_samples": 1}}
    digest = "sha256:" + "ab" * 32
    spec = JobSpec.from_dict({**base, "model": {**base["model"], "init": "/w/export", "init_digest": digest}})
    assert (spec.model.init, spec.model.init_digest) == ("/w/export", digest)
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert "init" not in JobSpec.from_dict(base).to_dict()["model"]  # job ids of specs without init unchanged
    for model, field in [({"init": "rel/path", "init_digest": digest}, "model.init"),
                         ({"init": "/w/export"}, "model.init_digest"),
                         ({"init": "/w/export", "init_digest": "sha256:xyz"}, "model.init_digest"),
                         ({"init_digest": digest}, "model.init_digest"),
                         ({"init": "/" + "a" * 5000, "init_digest": digest}, "model.init")]:
        with pytest.raises(SpecError) as info:
            JobSpec.from_dict({**base, "model": {**base["model"], **model}})
        assert info.value.field == field
    out = export_of(tmp_path)
    assert main([str(out)]) == 0
    assert capsys.readouterr().out.strip() == read_config(out)["digest"]


def finetune_spec(corpus: Path, steps: int, init: Path | None = None) -> JobSpec:
    model = {"arch": "llama", "d_model": 32, "n_heads": 4, "n_kv_heads": 2}
    if init is not None:
        model |= {"init": str(init), "init_digest": model_digest(init)}
    return JobSpec.from_dict({
        "name": "ft", "seed": 3, "steps": steps, "model": model, "data": {"files": [str(corpus)], "seq_len": 32},
        "batch": {"global_samples": 64, "microbatch_samples": 32}, "pipeline": {"stages": 2},
        "optim": {"name": "adamw", "lr": 3e-3, "schedule": "constant"}})


def test_finetuning_from_an_export_continues_the_loss_curve(tmp_path):
    """Trained N steps, exported, then a new job from the export: its first loss is within 1% of
    the loss the first job logs next (same weights; only the batch differs), where a fresh start
    is far above it."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    first = ReferenceTrainer.from_spec(finetune_spec(corpus, 61), tmp_path)
    losses = [r.loss for r in first.train(60)]
    weights = [StageWeights(i, 60, stage.state_dict(), "reference") for i, stage in enumerate(first.model.stages)]
    out = write_export(tmp_path / "export", first.spec.model.config, 2, first.spec.to_dict(), "00" * 32, weights)
    last = first.train_step().loss  # the export's own last point of the curve: step 60, pre-update
    tuned = ReferenceTrainer.from_spec(finetune_spec(corpus, 5, init=out), tmp_path)
    start = tuned.train_step().loss
    print(f"first job: {losses[0]:.4f} -> {losses[-1]:.4f}, {last:.4f} at step 60; fine-tune starts at {start:.4f}")
    assert abs(start - last) <= 0.01 * last
    assert losses[0] > 1.5 * last
