"""The export format on its own: what `swarmctl export` writes, checks and refuses, without daemons
(tests/jobs/test_jobs_export_daemons.py gathers one from a real swarm)."""

import json

import pytest
import torch

from swarmd.model import ExportError, LlamaConfig, TransformerConfig, build_reference, build_stage, load_model
from swarmd.model.export import StageAssembly, StageWeights, params_digest, read_config, read_stage, write_export

torch.set_num_threads(1)

CONFIG = TransformerConfig(d_model=16, n_heads=2, max_seq_len=8)


def pieces_of(params, chunk):
    for name, t in params.items():
        flat = t.reshape(-1)
        for offset in range(0, flat.numel(), chunk):
            yield [name, offset], flat[offset: offset + chunk]


def test_assembly_takes_pieces_in_order_and_refuses_anything_else():
    stage = build_stage(CONFIG, 0, 2, seed=1)
    params = stage.state_dict()
    declared = [[n, list(t.shape), "float32"] for n, t in params.items()]
    whole = StageAssembly(stage, 0, 5, "peer x", declared)
    for piece, part in pieces_of(params, 7):
        whole.put([piece], [part])
    got = whole.finish()
    assert got.step == 5 and all(torch.equal(got.params[n], params[n]) for n in params)

    with pytest.raises(ExportError, match="differ"):
        StageAssembly(stage, 0, 5, "peer x", declared[1:])
    name = next(iter(params))
    for bad in ([[name, 3]], [params[name].reshape(-1)[:2]]), ([[name, 0]], [torch.full((2,), float("nan"))]), \
               ([[name, 0]], [params[name].reshape(-1)[:2].double()]), ([["nope", 0]], [torch.zeros(1)]):
        with pytest.raises(ExportError):
            StageAssembly(stage, 0, 5, "peer x", declared).put(*bad)
    partial = StageAssembly(stage, 0, 5, "peer x", declared)
    partial.put([[name, 0]], [params[name].reshape(-1)[:1]])
    with pytest.raises(ExportError, match="elements arrived"):
        partial.finish()


def test_written_export_is_plain_safetensors_and_loads_whole(tmp_path):
    from safetensors.torch import load_file

    ref = build_reference(CONFIG, 2, seed=3)
    stages = [StageWeights(i, 9, s.state_dict(), "test") for i, s in enumerate(ref.stages)]
    out = write_export(tmp_path / "x", CONFIG, 2, {"name": "j"}, "ab" * 32, stages)
    assert load_file(str(out / "model.safetensors")).keys() == ref.state_dict().keys()
    meta = read_config(out)
    assert meta["architecture"] == "transformer-lm" and meta["step"] == 9 and meta["num_stages"] == 2
    assert meta["stages"][1]["digest"] == params_digest(ref.stages[1].state_dict())
    assert set(read_stage(out, 1)) == set(ref.stages[1].state_dict())
    model = load_model(out)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(ids, ids), ref(ids, ids))
    assert model.generate(ids[:, :3], 10, temperature=0).shape == (2, 13)
    sampled = model.generate(ids[:, :3], 10, top_k=5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sampled, model.generate(ids[:, :3], 10, top_k=5, generator=torch.Generator().manual_seed(1)))

    with pytest.raises(ExportError, match="need stages"):
        write_export(tmp_path / "y", CONFIG, 3, {}, "", stages)
    config = json.loads((out / "config.json").read_text())
    config["stages"][0]["digest"] = "sha256:" + "0" * 64
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="stage 0"):
        load_model(out)


def test_generate_crops_to_the_context():
    model = build_reference(LlamaConfig(d_model=16, n_heads=2, max_seq_len=4), 1, seed=0)
    out = model.generate(torch.zeros(1, 2, dtype=torch.int64), 6, temperature=0)
    assert out.shape == (1, 8)
