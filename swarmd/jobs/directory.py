"""`StageDirectory` answered from the DHT's stage announcements, with a short cache.

Why a cache: every trainer asks for every stage every refresh, and stage-mates ask during each
all-reduce; one DHT lookup per (job, stage) per `ttl_s` is plenty, since announcements only change
at their own refresh period. The announcements come through `swarmd.values`, so a malformed one is
dropped (and counted) there and never reaches the stage sync, the trainers or the gossip.
"""

from __future__ import annotations

import time
from typing import Any

from swarmd.directory import StagePeer
from swarmd.values import DHTValues, announcement_value, stage_key

__all__ = ["DHTStageDirectory", "announcement_value", "stage_key"]


class DHTStageDirectory:
    def __init__(self, dht: Any, ttl_s: float = 1.0, values: DHTValues | None = None) -> None:
        self.values = values or DHTValues(dht)
        self.ttl_s = ttl_s
        self._cache: dict[tuple[bytes, int], tuple[float, list[StagePeer]]] = {}

    async def peers(self, job_id: bytes, stage: int) -> list[StagePeer]:
        now = time.monotonic()
        hit = self._cache.get((job_id, stage))
        if hit is not None and hit[0] > now:
            return list(hit[1])
        peers = [StagePeer(a.peer_id, a.addr, stage, a.step, a.state, a.expires)
                 for a in await self.values.announcements(job_id, stage)]
        self._cache[(job_id, stage)] = (now + self.ttl_s, peers)
        return list(peers)
