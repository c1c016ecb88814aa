"""`StageDirectory` answered from the DHT's stage announcements, with a short cache.

Why a cache: every trainer asks for every stage every refresh, and stage-mates ask during each
all-reduce; one DHT lookup per (job, stage) per `ttl_s` is plenty, since announcements only change
at their own refresh period.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack

from swarmd.dht import dht_key
from swarmd.directory import StagePeer


def stage_key(job_id: bytes, stage: int) -> bytes:
    return dht_key("job", job_id, "stage", stage)


def announcement_value(addr: str, fields: dict[str, Any]) -> bytes:
    """The value a stage peer announces: `{addr, samples_per_s, queue, step, state}`."""
    return msgpack.packb({"addr": addr, **fields}, use_bin_type=True)


def decode_announcement(value: bytes) -> dict[str, Any] | None:
    try:
        fields = msgpack.unpackb(value, raw=False)
    except (ValueError, msgpack.UnpackException):
        return None
    if not isinstance(fields, dict) or not isinstance(fields.get("addr"), str):
        return None
    return fields


class DHTStageDirectory:
    def __init__(self, dht: Any, ttl_s: float = 1.0) -> None:
        self.dht, self.ttl_s = dht, ttl_s
        self._cache: dict[tuple[bytes, int], tuple[float, list[StagePeer]]] = {}

    async def peers(self, job_id: bytes, stage: int) -> list[StagePeer]:
        now = time.monotonic()
        hit = self._cache.get((job_id, stage))
        if hit is not None and hit[0] > now:
            return list(hit[1])
        records = await self.dht.get(stage_key(job_id, stage), latest=True)
        peers = []
        for record in records.values():
            fields = decode_announcement(record.value)
            if fields is None:
                continue
            peers.append(StagePeer(record.subkey, fields["addr"], stage, int(fields.get("step", 0)),
                                   str(fields.get("state", "serving")), record.expiration))
        self._cache[(job_id, stage)] = (now + self.ttl_s, peers)
        return list(peers)
