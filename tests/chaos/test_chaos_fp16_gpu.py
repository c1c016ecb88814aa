"""An fp16 job trained by real `swarmd` daemons whose stages compute on CUDA: loss scaling per
stage between processes, against the fp16 reference on the same GPU. Needs a GPU: skipped with the
reason elsewhere; scripts/gpu-check.sh runs it (`-m cuda`). Run on an H200 on 2026-12-04
(docs/models.md, "On a GPU"): done, exact, 5.56 -> 2.99 against the reference's 3.01."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import chaos_harness as ch  # noqa: E402

from swarmd.job import JobSpec  # noqa: E402
from swarmd.reference import ReferenceTrainer  # noqa: E402
from swarmd.swarmproc import LocalSwarm, SwarmSettings  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device, none here (scripts/gpu-check.sh runs it on a GPU)")]

STEPS = 30
#: From 2^20 the scaled gradients overflow at first: the stages must back off on their own.
LOSS_SCALE = 2.0 ** 20


def test_an_fp16_job_backs_off_its_scales_and_trains_exactly_on_cuda_daemons(tmp_path: Path) -> None:
    """1. Five daemons on cuda: peer0 trains, peer1+peer2 serve stage 0, peer3+peer4 stage 1; an
          fp16 job (AdamW, the chaos spec) starting at S = 2^20 with no regrowth.
       Expected: the job finishes, every step's records hold global_samples once and the loss falls
       (the chaos checks); some stage logged a skipped update while its scale backed off; the mean
       loss of the last five steps within 10% of the fp16 reference's on the same GPU (per step
       they part where an overflow verdict near the edge differs: rounding depends on how
       microbatches are batched, and a skip spikes AdamW's loss for a step or two)."""
    data = ch.write_corpus(tmp_path)
    raw = ch.spec("fp16-cuda", STEPS, 2, data)
    raw["compute"] = {"dtype": "fp16", "loss_scale": LOSS_SCALE, "growth_interval": 1000}
    swarm = LocalSwarm(tmp_path / "swarm", SwarmSettings(log_level="info", device="cuda", env=ch.CHAOS_ENV))
    try:
        trainer, p1, p2, p3, p4 = swarm.start(5)
        run = ch.Run(swarm, trainer, ch.submit(swarm, trainer, raw, data), STEPS)
        for peer, stage in ((p1, 0), (p2, 0), (p3, 1), (p4, 1)):
            run.serve(peer, stage)
        final = run.wait("the job to finish", lambda v: v["state"] == "done", timeout=240)
        assert final["step"] == STEPS
        events = ch.check_steps(run, raw)
        logs = "".join(p.log_path.read_text(errors="replace") for p in (p1, p2, p3, p4))
        assert "update skipped, loss scale now" in logs
        reference = ReferenceTrainer.from_spec(JobSpec.from_dict(raw), tmp_path, device="cuda")
        want = sum(r.loss for r in reference.train(STEPS)[-5:]) / 5
        got = sum(e["loss"] for e in events[-5:]) / 5
        print(f"swarm {[round(e['loss'], 4) for e in events]}: last five {got:.4f}, reference's {want:.4f}")
        assert abs(got - want) <= 0.1 * want
        ch.drain_all(swarm)
    finally:
        swarm.close()
    assert ch.processes_mentioning(str(tmp_path)) == []
