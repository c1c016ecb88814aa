"""The single-process reference trainer, and the contract stage peers rely on to match it."""

import json

import torch
from jobspec import job_spec

from swarmd.job import load_spec
from swarmd.model import build_stage
from swarmd.optim import StageOptimizer
from swarmd.reference import ReferenceTrainer, main

torch.set_num_threads(1)

def write_spec(tmp_path, steps=6, optim="adamw", lr=3e-3, stages=2, file="tiny.toml"):
    """TINY_JOB's model at width 64 on the stdlib's json package, with samples of 64 tokens."""
    path = tmp_path / file
    path.write_text(job_spec("tiny", seed=3, steps=steps, files=["{stdlib}/json/*.py"],
                             model={"d_model": 64, "n_heads": 4}, data={"seq_len": 64},
                             batch={"global_samples": 8, "microbatch_samples": 4},
                             optim={"name": optim, "lr": lr, "momentum": 0.9, "clip_norm": 1.0},
                             pipeline={"stages": stages}))
    return path


def test_loss_decreases_on_stdlib_source(tmp_path):
    path = write_spec(tmp_path)
    trainer = ReferenceTrainer.from_spec(load_spec(path), tmp_path)
    losses = [r.loss for r in trainer.train(6)]
    assert 5.0 < losses[0] < 6.0  # about ln(256) at a random init
    assert losses[-1] < losses[0] - 0.5, losses


def test_two_runs_are_identical(tmp_path):
    spec = load_spec(write_spec(tmp_path, steps=2))
    a, b = ReferenceTrainer.from_spec(spec, tmp_path), ReferenceTrainer.from_spec(spec, tmp_path)
    assert [r.loss for r in a.train(2)] == [r.loss for r in b.train(2)]
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)


def test_stage_peers_following_the_contract_match_the_reference(tmp_path):
    """Swarm training in miniature, in one process: 3 stages with 2 peers each built by `build_stage`;
    microbatches alternate between peers; forward without grad, backward recomputes from the saved
    input on the *other* peer; each peer sums its gradients; the peers' sums are added (the
    all-reduce) and every peer calls `StageOptimizer.step(global_samples)`. After 3 SGD-with-momentum
    steps every peer's parameters equal the reference's within 1e-5 relative."""
    spec = load_spec(write_spec(tmp_path, steps=3, optim="sgd", lr=0.1, stages=3))
    ref = ReferenceTrainer.from_spec(spec, tmp_path)
    cfg, n = spec.model.config, spec.pipeline.stages
    peers = [[build_stage(cfg, i, n, spec.seed) for _ in range(2)] for i in range(n)]
    opts = [[StageOptimizer(p, spec.optim, spec.steps) for p in stage] for stage in peers]
    for step in range(3):
        ref_loss = ref.train_step().loss
        loss_sum = 0.0
        for index in range(spec.batch.microbatches_per_step):
            mb = ref.data.microbatch(step, index)
            inputs = [mb.inputs]
            with torch.no_grad():
                for i in range(n - 1):
                    inputs.append(peers[i][index % 2](inputs[-1]))
            grad = None
            for i in reversed(range(n)):
                peer = peers[i][(index + 1) % 2]
                x = inputs[i] if i == 0 else inputs[i].clone().requires_grad_()
                out = peer(x, mb.targets) if i == n - 1 else peer(x)
                if i == n - 1:
                    loss_sum += out.item()
                out.backward(grad if grad is not None else torch.ones_like(out))
                grad = None if i == 0 else x.grad
        for i in range(n):
            for pa, pb in zip(peers[i][0].parameters(), peers[i][1].parameters()):
                total = pa.grad + pb.grad
                pa.grad, pb.grad = total.clone(), total.clone()
            for opt in opts[i]:
                opt.step(spec.batch.global_samples)
        assert abs(loss_sum / spec.batch.global_samples - ref_loss) <= 1e-5 * abs(ref_loss)
    worst = 0.0
    for i in range(n):
        for peer in peers[i]:
            for p, q in zip(peer.parameters(), ref.model.stages[i].parameters()):
                worst = max(worst, ((p - q).abs().max() / q.abs().max().clamp_min(1e-12)).item())
    print(f"max relative difference to the reference: {worst:.2e}")
    assert worst <= 1e-5


def test_cli_writes_losses(tmp_path, capsys):
    path = write_spec(tmp_path, steps=2)
    assert main([str(path), "--steps", "2", "--out", str(tmp_path / "losses.json")]) == 0
    summary = json.loads((tmp_path / "losses.json").read_text())
    assert summary["job"] == "tiny" and len(summary["losses"]) == 2 and len(summary["lrs"]) == 2
    assert "step 1 loss" in capsys.readouterr().out


def test_cli_reports_a_bad_spec(tmp_path, capsys):
    path = write_spec(tmp_path, steps=2, lr=1e-3, stages=0, file="bad.toml")
    assert main([str(path)]) == 2
    assert "pipeline.stages" in capsys.readouterr().err
