"""`job.export`: gather every stage's latest committed parameters for `swarmctl export`.

Each stage comes from a live peer serving it (downloaded with the stage's own `stage.state` stream
and checked piece by piece against the stage's shapes, exactly as a joining mate does), else from
this daemon's newest checkpoint of it (a job that has ended: its peers left with a final
checkpoint), else it is reported missing and `swarmctl` looks in the state dirs it was given, or
refuses. Parameters only: the optimizer state stays in the swarm.

Which peer: an announced step is a claim anyone can make. Taking the highest first made a
stranger announcing a high step in a stage, and serving any state of the right shapes, the job's
exported model. So the peers that answered the probe come first, and among them those announcing
the step most of the stage's answering peers reach (the lower median of their claims), then the
ones announcing more, highest first; and a state behind the step its peer announced is refused
(announcements lag a peer's step, never lead it).

The stream the control socket carries, in order (docs/control-api.md):
    {"kind": "job", "job", "name", "spec", "stages"}
    per stage, either {"kind": "stage", "stage", "step", "source", "params": [[name, shape, dtype]]}
    then {"kind": "tensors", "stage", "pieces": [[name, offset]]} + tensors until every element came,
    or {"kind": "missing", "stage", "reason"}
    {"kind": "end"}
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import torch

from swarmd.job.spec import JobSpec
from swarmd.model import build_stage
from swarmd.optim import OptimizerState
import swarmd.stage.checkpoint as ckpt
from swarmd.stage.state import Snapshot, StateError, check_params, download, snapshot_messages
from transport.codecs import DTYPES
from transport.errors import RpcError, TransportError
from transport.rpc import Message, Pool

log = logging.getLogger(__name__)

# One message's tensors: far under the control socket's frame limits, big enough to be few.
EXPORT_CHUNK_BYTES = 4 << 20
# A stage's download from one peer; a stage of a few GB over a slow link needs minutes.
EXPORT_DOWNLOAD_TIMEOUT_S = 300.0
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


async def export_messages(job, peers: list[dict], pool: Pool, state_dir: Path | None) -> AsyncIterator[Message]:
    """The `job.export` stream for `job` (a `swarmd.jobs.Job`); `peers` is `stage_peers(job)`."""
    spec: JobSpec = job.spec
    n = spec.pipeline.stages
    yield Message({"kind": "job", "job": job.job_id.hex(), "name": spec.name, "spec": spec.to_dict(),
                   "stages": n}, codec="none")
    for index in range(n):
        module = await asyncio.to_thread(build_stage, spec.model.config, index, n, spec.seed)
        serving = [p for p in peers[index]["peers"] if p["state"] == "serving"]
        found, tried = await _from_peers(job.job_id, index, module, serving, pool)
        if found is None:
            found = await asyncio.to_thread(from_checkpoint, state_dir, job.job_id, index, module)
        if found is None:
            where = f"; no checkpoint under {state_dir}" if state_dir is not None else ""
            yield Message({"kind": "missing", "stage": index,
                           "reason": f"no serving peer answered ({tried or 'none announced'}){where}"}, codec="none")
            continue
        step, source, params = found
        yield Message({"kind": "stage", "stage": index, "step": step, "source": source,
                       "params": [[name, list(t.shape), _DTYPE_NAMES[t.dtype]] for name, t in params.items()]},
                      codec="none")
        for message in _pieces(index, params):
            yield message
    yield Message({"kind": "end"}, codec="none")


def download_order(serving: list[dict]) -> list[dict]:
    """Peers that answered before those that did not; then those announcing the stage's agreed step
    (the lower median of the answering peers' claims) or less, highest first; then the ones
    announcing more, lowest first: a lone high claim is tried last, not first."""
    answering = sorted(p["step"] for p in serving if p.get("reachable", True))
    agreed = answering[(len(answering) - 1) // 2] if answering else 0
    return sorted(serving, key=lambda p: (not p.get("reachable", True), p["step"] > agreed,
                                          -p["step"] if p["step"] <= agreed else p["step"]))


async def _from_peers(job_id: bytes, index: int, module: torch.nn.Module, serving: list[dict],
                      pool: Pool) -> tuple[tuple | None, str]:
    tried = []
    for peer in download_order(serving):
        addr = peer["address"]
        try:
            snapshot = await download(pool, addr, job_id, index, module, EXPORT_DOWNLOAD_TIMEOUT_S)
            if snapshot.step < peer["step"]:
                raise StateError(f"its state is at step {snapshot.step}, behind the step {peer['step']} it announced")
        except (TransportError, RpcError, StateError, ValueError) as exc:
            log.warning("export of stage %d: %s refused: %s", index, addr, exc)
            tried.append(f"{addr}: {exc}")
            continue
        return (snapshot.step, f"peer {addr}", snapshot.params), ""
    return None, "; ".join(tried)


def from_checkpoint(state_dir: Path | None, job_id: bytes, index: int, module: torch.nn.Module) -> tuple | None:
    """(step, source, params) of the newest good checkpoint of the stage under `state_dir`, if any
    (also what `swarmctl export --state-dir` reads, for stages of daemons that have stopped)."""
    if state_dir is None:
        return None
    directory = ckpt.checkpoint_dir(state_dir, job_id, index)
    snapshot = ckpt.newest_checkpoint(directory, index)
    if snapshot is None:
        return None
    try:
        check_params(snapshot.params, module)
    except StateError as exc:
        log.warning("export of stage %d: checkpoint in %s refused: %s", index, directory, exc)
        return None
    return snapshot.step, f"checkpoint {directory}/step-{snapshot.step:010d}.pt", snapshot.params


def _pieces(index: int, params: dict[str, torch.Tensor]) -> Iterator[Message]:
    """The stage's parameters in "tensors" messages of at most `EXPORT_CHUNK_BYTES`, a large tensor
    split: chunked by the state download's own `snapshot_messages` (a snapshot with no optimizer
    part), whose "pieces" messages name each piece [table, name, offset]; the export names it
    [name, offset] (docs/control-api.md)."""
    snapshot = Snapshot(0, params, OptimizerState({}, {}))
    for message in snapshot_messages(snapshot, EXPORT_CHUNK_BYTES):
        if message.meta["kind"] == "pieces":
            pieces = [[name, offset] for _, name, offset in message.meta["pieces"]]
            yield Message({"kind": "tensors", "stage": index, "pieces": pieces}, message.tensors, codec="none")
