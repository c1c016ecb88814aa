"""Who serves which stage of which job: the one question trainers and stage-mates ask the swarm.

Both the trainer (to wire microbatches) and a stage peer (to find its mates for the stage-wide
all-reduce) depend only on this small protocol. The daemon answers it from the DHT's stage
announcements; tests answer it from a static table, so neither side needs a DHT to be exercised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class StagePeer:
    """One peer's announcement for one stage, as read from the swarm (never trusted for speed:
    trainers measure throughput themselves)."""

    peer_id: bytes
    addr: str  # "host:port" to dial
    stage: int
    step: int = 0  # the optimizer step the peer has committed
    state: str = "serving"  # serving | joining | draining
    expires: float = float("inf")  # wall-clock time the announcement lapses


class StageDirectory(Protocol):
    async def peers(self, job_id: bytes, stage: int) -> list[StagePeer]:
        """Live peers announced for `stage` of `job_id` (possibly stale by one refresh period)."""
        ...


class StaticDirectory:
    """A fixed table, for tests and single-host tools; `set` replaces a stage's peers."""

    def __init__(self, table: dict[tuple[bytes, int], list[StagePeer]] | None = None) -> None:
        self._table = dict(table or {})

    def set(self, job_id: bytes, stage: int, peers: list[StagePeer]) -> None:
        self._table[(job_id, stage)] = list(peers)

    async def peers(self, job_id: bytes, stage: int) -> list[StagePeer]:
        return list(self._table.get((job_id, stage), []))
