"""The `llama` architecture through a real swarm with a kill: exact against its reference.

Two daemons each serve all three stages of a `llama` job (grouped-query attention, two query heads
per key/value head), codec `none` on every wire (the stage all-reduce too: `[wire] allreduce`, whose
default fp16 would put the stages ~5e-4 off), plain SGD with momentum. Daemon `b` is SIGKILLed
mid-training; `a` alone carries every stage to the end. Every step must still sum the whole global batch once
(the chaos tests' check), and the final parameters, from `a`'s final checkpoints, must equal the
single-process reference's within 1e-5 relative (the equivalence test's bound)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from swarmd.exitcodes import EXIT_OK
from swarmd.job import parse_toml
from swarmd.reference import ReferenceTrainer
from swarmd.stage.checkpoint import checkpoint_dir, read_checkpoint

pytestmark = pytest.mark.slow

STEPS = 10
GLOBAL, MICRO = 8, 2
LLAMA = {"model": {"arch": "llama", "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "layers_per_stage": 1},
         "batch": {"global_samples": GLOBAL, "microbatch_samples": MICRO},
         "optim": {"name": "sgd", "momentum": 0.9, "weight_decay": 0.0, "clip_norm": 0.0},
         "wire": {"activations": "none", "gradients": "none", "allreduce": "none"},
         "pipeline": {"stages": 3, "delayed_updates": False},
         "checkpoint": {"every_steps": 0}}


def test_llama_three_stages_through_a_kill_match_the_reference(swarm, swarm_root: Path, swarmctl, kit) -> None:
    torch.set_num_threads(1)
    data, spec_path = kit.write_job(swarm_root, "llama", seed=13, steps=STEPS, **LLAMA)
    a, b = swarm.together(["la", "lb"])
    job_id = kit.submit_and_serve(kit.on_socket(swarmctl), spec_path,
                                  [(daemon, stage) for daemon in (a, b) for stage in range(3)])
    kit.wait_for(lambda: all(len(s["peers"]) == 2 for s in a.client.job(job_id)["stages"]), 30, "two peers per stage",
                 interval=0.5)
    assert swarmctl("--socket", str(a.socket), "train", job_id, "--data", str(data)).returncode == EXIT_OK

    kit.wait_for(lambda: a.client.job(job_id)["step"] >= 2, 120, "two steps before the kill")
    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait(timeout=30)
    print(f"killed b after step {a.client.job(job_id)['step']}")
    kit.wait_for(lambda: kit.finished(a, job_id), 240, "training to finish", interval=0.5)
    assert a.client.job(job_id)["state"] == "done", a.client.logs(job_id)
    events = kit.step_events(a, job_id)
    assert [e["step"] for e in events] == list(range(1, STEPS + 1))
    kit.whole_steps(events, GLOBAL, MICRO)

    reference = ReferenceTrainer.from_spec(parse_toml(spec_path.read_text()), swarm_root)
    reference.train(STEPS)
    worst = 0.0
    for stage, module in enumerate(reference.model.stages):
        final = checkpoint_dir(a.socket.parent / "state", bytes.fromhex(job_id), stage) / f"step-{STEPS:010d}.pt"
        kit.wait_for(final.exists, 60, f"a's final checkpoint of stage {stage}")
        got = read_checkpoint(final, stage)
        for name, tensor in module.state_dict().items():
            diff = (got.params[name] - tensor).abs().max().item() / max(tensor.abs().max().item(), 1e-12)
            worst = max(worst, diff)
    print(f"max relative parameter difference after {STEPS} steps through a kill: {worst:.3g}")
    assert worst <= 1e-5
