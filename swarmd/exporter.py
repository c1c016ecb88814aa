"""`swarmctl export JOB -o DIR`: receive a job's stages from the daemon and write the export.

The daemon (`swarmd.jobs.exporting`) sends each stage from a live peer or its own checkpoints;
stages it has no source for are looked up in the `--state-dir`s given here (the state dirs of
daemons that served them and have stopped, readable by this user); any still missing makes the
export refuse, naming the stage and why, and nothing is written. The result is checked against the
model's own shapes before a byte is written (docs/models.md has the layout).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import torch

from swarmd.client import Client
from swarmd.job.errors import SpecError
from swarmd.job.spec import JobSpec
from swarmd.jobs.exporting import EXPORT_DOWNLOAD_TIMEOUT_S, from_checkpoint
from swarmd.model import build_stage
from swarmd.model.export import ExportError, StageAssembly, StageWeights, write_export


def export_command(args: argparse.Namespace) -> dict:
    """Gather, check and write; raises ExportError (and the client's errors) with the reason."""
    torch.set_num_threads(1)
    spec, job_id, stages, missing = asyncio.run(_receive(args))
    for index, reason in sorted(missing.items()):
        module = build_stage(spec.model.config, index, spec.pipeline.stages, spec.seed)
        candidates = [from_checkpoint(d, bytes.fromhex(job_id), index, module) for d in args.state_dir]
        # The newest of them: a peer preempted early left an older checkpoint behind.
        found = max((c for c in candidates if c is not None), key=lambda c: c[0], default=None)
        if found is None:
            looked = f"; none in {', '.join(map(str, args.state_dir))}" if args.state_dir else ""
            raise ExportError(f"stage {index} is unavailable: {reason}{looked}")
        stages.append(StageWeights(index, found[0], found[2], found[1]))
    write_export(args.out, spec.model.config, spec.pipeline.stages, spec.to_dict(), job_id, stages)
    steps = sorted({s.step for s in stages})
    if len(steps) > 1:
        print(f"warning: stages are at different steps {steps}: a stage committed while the export ran",
              file=sys.stderr)
    return {"out": str(args.out), "job": job_id, "name": spec.name, "step": min(steps),
            "parameters": sum(t.numel() for s in stages for t in s.params.values()),
            "stages": [{"stage": s.stage, "step": s.step, "source": s.source} for s in sorted(stages, key=lambda s: s.stage)]}


async def _receive(args: argparse.Namespace) -> tuple[JobSpec, str, list[StageWeights], dict[int, str]]:
    spec: JobSpec | None = None
    job_id = ""
    stages: list[StageWeights] = []
    missing: dict[int, str] = {}
    current: StageAssembly | None = None
    async with Client(args.socket, timeout=args.timeout) as client:
        async for message in client.stream_messages("job.export", job=args.job,
                                                    timeout=max(args.timeout, 2 * EXPORT_DOWNLOAD_TIMEOUT_S)):
            meta, kind = message.meta, message.meta.get("kind")
            if kind == "job":
                try:
                    spec = JobSpec.from_dict(meta.get("spec"))
                except SpecError as exc:
                    raise ExportError(f"the daemon sent a spec that does not parse: {exc}") from None
                job_id = str(meta.get("job"))
                continue
            if spec is None:
                raise ExportError(f"job.export began with {kind!r}, not the job")
            if kind == "tensors":
                if current is None or meta.get("stage") != current.index:
                    raise ExportError("tensors arrived for a stage that was not announced")
                current.put(meta.get("pieces"), list(message.tensors))
                continue
            if current is not None:
                stages.append(current.finish())
                current = None
            index = meta.get("stage")
            if kind == "stage" and type(index) is int and 0 <= index < spec.pipeline.stages:
                module = build_stage(spec.model.config, index, spec.pipeline.stages, spec.seed)
                current = StageAssembly(module, index, meta.get("step"), meta.get("source"), meta.get("params"))
            elif kind == "missing" and type(index) is int and 0 <= index < spec.pipeline.stages:
                missing[index] = str(meta.get("reason"))
            elif kind == "end":
                return spec, job_id, stages, missing
            else:
                raise ExportError(f"unexpected job.export message {kind!r}")
    raise ExportError("the daemon's job.export stream ended before its end mark")
