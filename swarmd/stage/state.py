"""A stage's full state (parameters, optimizer state, step) as a consistent snapshot, streamed to
joiners in bounded messages and checked piece by piece before it replaces anything.

The snapshot is taken between two commits (under the parameter guard), so a joiner receives one
step's parameters with that same step's optimizer state. The receiver knows its own stage's
parameter names and shapes, so the sender's header is compared with them before a byte is
allocated, every piece is placed by (name, offset) into a tensor it must exactly fill, and the
whole is refused unless every element arrived once, is finite, and the optimizer state passes
`import_state`'s own checks.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from swarmd.optim import OptimizerState, StageOptimizer, export_state, import_state
from swarmd.stage.core import DIGEST_BYTES
from transport.codecs import DTYPES
from transport.rpc import Message, Pool

STATE_FORMAT = 1
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class StateError(Exception):
    """A downloaded or checkpointed state does not fit this stage; nothing was changed."""


@dataclass
class Snapshot:
    step: int
    params: dict[str, torch.Tensor]
    optimizer: OptimizerState
    # The stage core's digest of this state (swarmd.stage.core): travels with a download so the
    # joiner shows its mates the same one; None for a checkpoint read back (see content_digest).
    digest: bytes | None = None


def content_digest(snapshot: Snapshot) -> bytes:
    """A digest of the state's bytes (parameters, optimizer tensors, step), for a state restored
    from a checkpoint: peers restoring equal checkpoints agree without having met (worker thread:
    a pass over the whole state)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(b"checkpoint")
    h.update(snapshot.step.to_bytes(8, "big"))
    for table in (snapshot.params, snapshot.optimizer.tensors):
        for name in sorted(table):
            h.update(name.encode())
            h.update(table[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def take_snapshot(module: torch.nn.Module, opt: StageOptimizer) -> Snapshot:
    """Copies on CPU (call under the parameter guard, from a worker thread)."""
    params = {name: t.detach().to("cpu", copy=True) for name, t in module.state_dict().items()}
    state = export_state(opt)
    state.tensors = {k: v.detach().to("cpu", copy=True) for k, v in state.tensors.items()}
    return Snapshot(opt.step_count, params, state)


def apply_snapshot(snapshot: Snapshot, module: torch.nn.Module, opt: StageOptimizer) -> None:
    """Load parameters and optimizer state (call under the parameter guard's write side)."""
    if snapshot.optimizer.meta.get("step") != snapshot.step:
        raise StateError(f"optimizer state is for step {snapshot.optimizer.meta.get('step')}, "
                         f"parameters for step {snapshot.step}")
    check_params(snapshot.params, module)
    backup = {k: v.detach().clone() for k, v in module.state_dict().items()}
    module.load_state_dict(snapshot.params, strict=True)
    try:
        import_state(opt, snapshot.optimizer)
    except Exception:
        module.load_state_dict(backup, strict=True)
        raise


def check_params(params: dict[str, torch.Tensor], module: torch.nn.Module) -> None:
    expected = module.state_dict()
    if set(params) != set(expected):
        raise StateError(f"parameter names differ: {sorted(set(params) ^ set(expected))[:4]}")
    for name, tensor in params.items():
        if tensor.shape != expected[name].shape or tensor.dtype != expected[name].dtype:
            raise StateError(f"{name}: {tensor.dtype}{list(tensor.shape)}, this stage has "
                             f"{expected[name].dtype}{list(expected[name].shape)}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise StateError(f"{name} is not finite")


def snapshot_messages(snapshot: Snapshot, chunk_bytes: int) -> Iterator[Message]:
    """Header, then pieces of at most `chunk_bytes` each (a large tensor is split), then an end mark."""
    tables = {"p": snapshot.params, "o": snapshot.optimizer.tensors}
    yield Message({
        "kind": "header", "format": STATE_FORMAT, "step": snapshot.step, "digest": snapshot.digest,
        "params": _describe(snapshot.params), "optim_tensors": _describe(snapshot.optimizer.tensors),
        "optim_meta": snapshot.optimizer.meta,
    }, codec="none")
    pieces, tensors, size = [], [], 0
    for table, entries in tables.items():
        for name, tensor in entries.items():
            flat = tensor.reshape(-1)
            per = max(1, chunk_bytes // max(1, tensor.element_size()))
            for offset in range(0, max(flat.numel(), 1), per):
                part = flat[offset: offset + per]
                if tensors and size + part.numel() * part.element_size() > chunk_bytes:
                    yield Message({"kind": "pieces", "pieces": pieces}, tensors, codec="none")
                    pieces, tensors, size = [], [], 0
                pieces.append([table, name, offset])
                tensors.append(part)
                size += part.numel() * part.element_size()
    if tensors:
        yield Message({"kind": "pieces", "pieces": pieces}, tensors, codec="none")
    yield Message({"kind": "end", "step": snapshot.step}, codec="none")


async def download(pool: Pool, addr: str, job_id: bytes, stage_index: int, module: torch.nn.Module,
                   timeout: float) -> Snapshot:
    """Stream a mate's state and verify it against `module` (our own stage, for names and shapes)."""
    assembly: _Assembly | None = None
    request = Message({"job": job_id, "stage": stage_index}, codec="none")
    async with pool.stream(addr, "stage.state", request, timeout=timeout) as items:
        async for item in items:
            kind = item.meta.get("kind")
            if assembly is None:
                if kind != "header":
                    raise StateError("the state stream does not start with a header")
                assembly = _Assembly(item.meta, module)
            elif kind == "pieces":
                assembly.put(item.meta.get("pieces"), item.tensors)
            elif kind == "end":
                return assembly.finish(item.meta.get("step"))
            else:
                raise StateError(f"unexpected state message {kind!r}")
    raise StateError("the state stream ended before its end mark")


def _describe(entries: dict[str, torch.Tensor]) -> list:
    return [[name, list(t.shape), _DTYPE_NAMES[t.dtype]] for name, t in entries.items()]


class _Assembly:
    """Receiving tensors allocated from our own stage's shapes, filled by (name, offset)."""

    def __init__(self, header: dict, module: torch.nn.Module) -> None:
        if header.get("format") != STATE_FORMAT:
            raise StateError(f"state format {header.get('format')!r}, expected {STATE_FORMAT}")
        step = header.get("step")
        if type(step) is not int or step < 0:
            raise StateError(f"bad step {step!r}")
        self.step = step
        self.digest = header.get("digest")
        if not isinstance(self.digest, bytes) or len(self.digest) != DIGEST_BYTES:
            raise StateError("the header carries no state digest")
        own = module.state_dict()
        largest = max((t.numel() for t in own.values()), default=0)
        described = self._parse(header.get("params"), "params")
        if {n: (s, d) for n, (s, d) in described.items()} != {
                n: (list(t.shape), t.dtype) for n, t in own.items()}:
            raise StateError("the sender's parameters differ from this stage's")
        optim = self._parse(header.get("optim_tensors"), "optim_tensors")
        if len(optim) > 8 * max(1, len(own)):
            raise StateError(f"{len(optim)} optimizer tensors for {len(own)} parameters")
        for name, (shape, _) in optim.items():
            if math.prod(shape) > largest:
                raise StateError(f"optimizer tensor {name} is larger than any parameter")
        self.meta = header.get("optim_meta")
        if not isinstance(self.meta, dict):
            raise StateError("optim_meta must be a map")
        self.tables = {
            "p": {n: torch.empty(s, dtype=d) for n, (s, d) in described.items()},
            "o": {n: torch.empty(s, dtype=d) for n, (s, d) in optim.items()},
        }
        self.filled = {(t, n): 0 for t, table in self.tables.items() for n in table}

    @staticmethod
    def _parse(entries: object, what: str) -> dict[str, tuple[list[int], torch.dtype]]:
        if not isinstance(entries, list):
            raise StateError(f"{what} must be a list")
        out = {}
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                    and isinstance(entry[1], list) and all(type(d) is int and d >= 0 for d in entry[1])
                    and entry[2] in DTYPES):
                raise StateError(f"bad {what} entry {entry!r}")
            out[entry[0]] = (entry[1], DTYPES[entry[2]])
        return out

    def put(self, pieces: object, tensors: list[torch.Tensor]) -> None:
        if not isinstance(pieces, list) or len(pieces) != len(tensors):
            raise StateError("pieces and tensors do not match")
        for piece, part in zip(pieces, tensors):
            if not (isinstance(piece, list) and len(piece) == 3 and piece[0] in self.tables
                    and piece[1] in self.tables[piece[0]] and type(piece[2]) is int):
                raise StateError(f"bad piece {piece!r}")
            table, name, offset = piece
            target = self.tables[table][name].view(-1)
            # In order and contiguous: every element is then written exactly once.
            if (part.dtype != target.dtype or part.dim() != 1 or offset != self.filled[(table, name)]
                    or offset + part.numel() > target.numel()):
                raise StateError(f"piece of {name} at {offset} does not fit")
            if part.is_floating_point() and not bool(torch.isfinite(part).all()):
                raise StateError(f"{name} is not finite")
            target[offset: offset + part.numel()] = part
            self.filled[(table, name)] += part.numel()

    def finish(self, step: object) -> Snapshot:
        if step != self.step:
            raise StateError(f"end mark says step {step!r}, header said {self.step}")
        for (table, name), count in self.filled.items():
            if count != self.tables[table][name].numel():
                raise StateError(f"{name}: {count} of {self.tables[table][name].numel()} elements arrived")
        return Snapshot(self.step, self.tables["p"], OptimizerState(self.tables["o"], self.meta), self.digest)
