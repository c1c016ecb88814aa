"""`swarmctl export` fed a stranger's parameters, over real loopback sockets.

`job.export` downloaded each stage from "the highest announced step first": a stranger that
announced itself in a stage with a high step and served a state of the right shapes (any values)
became the job's exported model, whatever the honest peers held. Now the peers announcing the
step most of the stage's answering serving peers reach (the lower median of their claims) are
tried first, one announcing more only after those, and a downloaded state must be at least at the
step its peer announced.
"""

from __future__ import annotations

import hashlib

import torch
from adversary_kit import SPEC, STAGE, spec, start_peer

from swarmd.directory import StaticDirectory
from swarmd.job import parse_toml
from swarmd.jobs.exporting import export_messages
from swarmd.jobs.registry import Job
from transport.identity import Identity
from transport.rpc import Pool, RpcConfig

JOB = hashlib.sha256(b"adversary-test-job").digest()


def announced(peer, step: int) -> dict:
    return {"peer_id": peer.peer_id.hex(), "address": peer.addr, "samples_per_s": 1.0, "queue": 0, "step": step,
            "state": "serving", "reachable": True, "serves": True}


async def exported_stage(job_spec, stages: list[dict], pool: Pool) -> tuple[str, dict[str, torch.Tensor]]:
    """The source and parameters `job.export` gives for the served stage."""
    job = Job(JOB, job_spec, b"s" * 32, local=True)
    source, params, pending = None, {}, {}
    async for message in export_messages(job, stages, pool, None):
        meta = message.meta
        if meta.get("kind") == "stage" and meta["stage"] == STAGE:
            source = meta["source"]
            pending = {name: [] for name, _, _ in meta["params"]}
        elif meta.get("kind") == "tensors" and meta["stage"] == STAGE:
            for (name, _), tensor in zip(meta["pieces"], message.tensors):
                pending[name].append(tensor)
    params = {name: torch.cat(parts) for name, parts in pending.items()}
    return source, params


async def test_a_stranger_announcing_a_higher_step_is_not_the_exported_model():
    """Stage 1: two honest peers at step 0, and a stranger's peer (a stage of another init seed:
    same shapes, other values) announcing step 50. Expected: the export's stage 1 comes from an
    honest peer and holds its parameters (before: from the stranger)."""
    job_spec = spec()
    directory = StaticDirectory()
    honest = [await start_peer(job_spec, STAGE, directory) for _ in range(2)]
    stranger = await start_peer(parse_toml(SPEC.replace("seed = 5", "seed = 6")), STAGE, StaticDirectory())
    pool = Pool(RpcConfig(identity=Identity.generate()))
    try:
        stages = [{"stage": i, "peers": []} for i in range(job_spec.pipeline.stages)]
        stages[STAGE]["peers"] = [announced(stranger, 50), *(announced(p, 0) for p in honest)]
        source, params = await exported_stage(job_spec, stages, pool)
        assert source in {f"peer {p.addr}" for p in honest}, source
        live = {n: t.detach().reshape(-1) for n, t in honest[0].service.stage.state_dict().items()}
        assert all(torch.equal(params[n], live[n]) for n in live)
    finally:
        await pool.close()
        for peer in [*honest, stranger]:
            await peer.close()


async def test_a_peer_serving_a_step_behind_its_claim_is_refused():
    """The stage's only announced peer claims step 3 and serves the state of step 0 (an honest
    peer's state is never behind what it announced: announcements lag, steps only grow).
    Expected: refused, the stage reported missing (before: exported as the stage's model)."""
    job_spec = spec()
    stranger = await start_peer(parse_toml(SPEC.replace("seed = 5", "seed = 6")), STAGE, StaticDirectory())
    pool = Pool(RpcConfig(identity=Identity.generate()))
    try:
        stages = [{"stage": i, "peers": []} for i in range(job_spec.pipeline.stages)]
        stages[STAGE]["peers"] = [announced(stranger, 3)]
        source, _ = await exported_stage(job_spec, stages, pool)
        assert source is None, source
    finally:
        await pool.close()
        await stranger.close()
