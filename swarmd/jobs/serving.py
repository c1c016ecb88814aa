"""The stages this daemon serves: one `StageService` per (job, stage), announced in the DHT.

The announcement is refreshed by the DHT node's announce loop (well inside its expiry) with the
service's live fields, and withdrawn before the service stops, so trainers stop routing to a
draining peer at their next directory refresh rather than at the record's expiry.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmd.jobs.directory import announcement_value, stage_key
from swarmd.stage.limits import StageLimits
from swarmd.stage.service import StageService


@dataclass
class Served:
    service: StageService
    announcement: Any


class Serving:
    def __init__(self, dht: Any, router: Any, pool: Any, directory: Any, *, peer_id: bytes, address: str,
                 device: str, state_dir: Path, limits: StageLimits, max_stages: int) -> None:
        self.dht, self.router, self.pool, self.directory = dht, router, pool, directory
        self.peer_id, self.address, self.device = peer_id, address, device
        self.state_dir, self.limits, self.max_stages = state_dir, limits, max_stages
        self.served: dict[tuple[bytes, int], Served] = {}

    async def serve(self, spec: Any, job_id: bytes, stage: int) -> StageService:
        """Join `stage` of the job (download state from a mate, else a checkpoint, else fresh init)."""
        if (job_id, stage) in self.served:
            return self.served[(job_id, stage)].service
        if len(self.served) >= self.max_stages:
            raise ValueError(f"already serving {len(self.served)} stages (jobs.max_stages = {self.max_stages})")
        service = StageService(spec, job_id, stage, self.peer_id, self.router, self.pool, self.directory,
                               address=self.address, device=self.device, limits=self.limits,
                               state_dir=self.state_dir)
        await service.start()
        ann = self.dht.announce(stage_key(job_id, stage),
                                lambda: announcement_value(self.address, service.announcement()))
        self.served[(job_id, stage)] = Served(service, ann)
        return service

    def stages(self) -> list[str]:
        return [f"{job_id.hex()[:16]}/{stage}" for job_id, stage in sorted(self.served)]

    async def close(self) -> None:
        """Drain: withdraw every announcement first, then stop the services."""
        served, self.served = list(self.served.values()), {}
        for item in served:
            await self.dht.withdraw(item.announcement)
        for item in served:
            await item.service.stop()
