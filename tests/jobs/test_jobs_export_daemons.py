"""`swarmctl export` with real daemons: the trained model out of the swarm, from live peers and from
checkpoints, refused when a stage is nowhere to be had.

Two daemons `a` (submitter) and `b`, a two-stage `llama` job, stage 0 pinned on `a`, stage 1 on `b`,
codec `none` and plain SGD so the swarm's arithmetic is the reference's. Before training the live
export must hold the deterministic initial bits exactly; after the job ended (both stages left with
a final checkpoint) `a` alone cannot supply stage 1 and says so, and with `b`'s state dir the export
holds step STEPS. Loaded into one plain module, its loss on the batch the swarm would train next and
on held-out text equals the reference run's within 1e-4 relative (the parameters agree within 1e-5
relative as in the equivalence test; a loss is a smooth function of them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarmd.exitcodes import EXIT_FAILURE, EXIT_OK
from swarmd.job import parse_toml
from swarmd.job.data import ByteTokenizer
from swarmd.model import build_stage, load_model
from swarmd.reference import ReferenceTrainer

pytestmark = pytest.mark.slow

STEPS = 4
LLAMA = {"model": {"arch": "llama", "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "layers_per_stage": 1},
         "batch": {"global_samples": 4, "microbatch_samples": 2},
         "optim": {"name": "sgd", "momentum": 0.9, "weight_decay": 0.0, "clip_norm": 0.0},
         "wire": {"activations": "none", "gradients": "none"}, "pipeline": {"stages": 2},
         "checkpoint": {"every_steps": 0}}
HELD_OUT = Path(torch.__file__).read_bytes()[:4096]  # text the job never trains on


def export(swarmctl, daemon, job_id: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """This tree's `swarmctl export` (the venv's console script may be another checkout's)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run([sys.executable, "-m", "swarmd.ctl", "--socket", str(daemon.socket), "--json", "export",
                           job_id, "-o", str(out), *extra], capture_output=True, text=True, timeout=300, env=env)


def serving_stages(daemon) -> int:
    return len(daemon.client.status()["serving"]["stages"])


def test_export_live_then_from_checkpoints(swarm, swarm_root: Path, swarmctl, kit) -> None:
    torch.set_num_threads(1)
    data, spec_path = kit.write_job(swarm_root, "export", copies=1, seed=3, steps=STEPS, **LLAMA)
    spec = parse_toml(spec_path.read_text())
    a, b = swarm.together(["xa", "xb"])
    job_id = kit.submit_and_serve(kit.on_socket(swarmctl), spec_path, [(a, 0), (b, 1)])
    kit.wait_for(lambda: all(any(p["state"] == "serving" for p in s["peers"]) for s in a.client.job(job_id)["stages"]),
                 60, "both stages served", interval=0.5)

    check_live_export_is_initial(swarmctl, a, job_id, swarm_root / "export-live", spec)

    trained = swarmctl("--socket", str(a.socket), "train", job_id, "--data", str(data))
    assert trained.returncode == EXIT_OK, trained.stderr
    kit.wait_for(lambda: kit.finished(a, job_id), 240, "training to finish", interval=0.5)
    assert a.client.job(job_id)["state"] == "done", a.client.logs(job_id)
    for daemon in (a, b):
        kit.wait_for(lambda: serving_stages(daemon) == 0, 60, f"{daemon.name} to leave the job", interval=0.5)

    out = swarm_root / "export-done"
    check_ended_export_needs_every_stage(swarmctl, a, b, job_id, out, spec)
    check_model_matches_reference(load_model(out), spec, swarm_root)


def check_live_export_is_initial(swarmctl, a, job_id: str, out: Path, spec) -> None:
    """Live, before any step: each stage downloaded from its peer, exactly the initial bits."""
    live = export(swarmctl, a, job_id, out)
    assert live.returncode == EXIT_OK, live.stderr
    summary = json.loads(live.stdout)
    assert summary["step"] == 0 and all(s["source"].startswith("peer ") for s in summary["stages"])
    from safetensors.torch import load_file  # the file on its own, with the safetensors package alone

    tensors = load_file(str(out / "model.safetensors"))
    for stage in range(2):
        expected = build_stage(spec.model.config, stage, 2, spec.seed).state_dict()
        for name, tensor in expected.items():
            assert torch.equal(tensors[f"stages.{stage}.{name}"], tensor), name
    assert len(tensors) == sum(len(build_stage(spec.model.config, i, 2, spec.seed).state_dict()) for i in range(2))


def check_ended_export_needs_every_stage(swarmctl, a, b, job_id: str, out: Path, spec) -> None:
    """Ended: a holds stage 0's final checkpoint only; stage 1 is on b's disk. Refused from `a`
    alone (nothing written), exported to `out` with b's state dir: step STEPS from checkpoints."""
    refused = export(swarmctl, a, job_id, out)
    assert refused.returncode == EXIT_FAILURE
    assert "stage 1 is unavailable" in refused.stderr, refused.stderr
    assert not out.exists()
    done = export(swarmctl, a, job_id, out, "--state-dir", str(b.socket.parent / "state"))
    assert done.returncode == EXIT_OK, done.stderr
    summary = json.loads(done.stdout)
    assert summary["step"] == STEPS and all(s["source"].startswith("checkpoint ") for s in summary["stages"])
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == "llama" and config["job_id"] == job_id and config["job"] == spec.to_dict()
    assert [s["step"] for s in config["stages"]] == [STEPS, STEPS]


def check_model_matches_reference(model, spec, root: Path) -> None:
    """The exported model's loss on held-out text and on the batch the swarm would train next
    equals the reference run's within 1e-4 relative; it generates from a prompt."""
    reference = ReferenceTrainer.from_spec(spec, root)
    reference.train(STEPS)
    held = torch.from_numpy(ByteTokenizer().encode(HELD_OUT).astype("int64")).view(-1, 64)[:, :]
    inputs, targets = held[:, :-1], held[:, 1:]
    with torch.no_grad():
        got, want = model(inputs, targets).item(), reference.model(inputs, targets).item()
        print(f"held-out loss: export {got / len(inputs):.6f}, reference {want / len(inputs):.6f}")
        assert abs(got - want) <= 1e-4 * abs(want)
        nxt = [reference.data.microbatch(STEPS, i) for i in range(spec.batch.microbatches_per_step)]
        got = sum(model(mb.inputs, mb.targets).item() for mb in nxt)
        want = sum(reference.model(mb.inputs, mb.targets).item() for mb in nxt)
        assert abs(got - want) <= 1e-4 * abs(want)
    sample = model.generate(held[:1, :8], 16, temperature=0)
    assert sample.shape == (1, 24) and torch.equal(sample[:, :8], held[:1, :8])
