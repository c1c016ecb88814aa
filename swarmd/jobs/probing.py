"""Claims checked before they are trusted: a stage peer counts once it answered, and its announced
rate only up to what its stage-mates' answered claims make believable.

Why: a stage announcement is a claim anyone can store. A fake stage-0 record claiming 10^12
samples/s (pointing at nothing) made every honest daemon join stage 1, and `status` said every
stage had peers while stage 0 held only the fake. So before a daemon counts a peer's capacity to
decide where to join, or counts it as serving in `swarmctl job`, it calls the announced address:
the connection must prove the announced peer id (so a record cannot point at someone else's
server) and the peer must answer `stage.info` for that job and stage. An answer is believed for
`PROBE_TTL_S`; the answers are cached per (job, stage, peer, address), at most `MAX_PROBES_KEPT`.

A peer that answers can still lie about its speed; nothing here measures it (trainers do, for
routing). So the join rule counts an announced rate at most `swarmd.rebalance.table.CLAIM_FACTOR`
times the lower median of the answering peers' claims in the job (`bounded_speeds`): one liar
among honest peers moves that median nowhere. Answering peers that all lie together can still
mislead: docs/security.md lists it as open.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Iterable

from swarmd.directory import StagePeer
from swarmd.values import MAX_STEP, StageAnnouncement
from transport.errors import RemoteError, TransportError
from transport.message import Message

log = logging.getLogger(__name__)

#: One probe, dial and handshake included: a live peer answers `stage.info` in milliseconds.
PROBE_TIMEOUT_S = 2.0
#: How long an answer (or its absence) is believed: a few join ticks, far below a record's life.
PROBE_TTL_S = 10.0
#: Probe results kept (oldest first out): bounds what announcements can make this cache hold.
MAX_PROBES_KEPT = 4096
#: Probes run at once per question: the DHT bounds the records per key, this bounds the dials.
MAX_PROBES_AT_ONCE = 32


@dataclass(frozen=True)
class Probe:
    answered: bool  # the announced address proved the announced peer id and answered
    serving: bool  # ...and `stage.info` said it serves that stage
    # What it answered of its step and rate (None: not answered, or out of schema). Fresher than
    # its announcement, which is re-stored every DHT refresh (30 s): `swarmctl job` on any host
    # showed `step 0, 0.0/s` for peers at step 18. Still the peer's own claims.
    step: int | None = None
    samples_per_s: float | None = None


UNANSWERED = Probe(False, False)


def answered(meta: Any) -> Probe:
    """A `stage.info` answer, checked at this edge: a field out of the announcement's schema is dropped."""
    meta = meta if isinstance(meta, dict) else {}
    step, rate = meta.get("step"), meta.get("samples_per_s")
    # `behind`: a serving peer, idle, whose parameters lag its mates' (StageCore.behind): it serves.
    return Probe(True, meta.get("state") in ("serving", "behind"),
                 step if type(step) is int and 0 <= step <= MAX_STEP else None,
                 float(rate) if type(rate) in (int, float) and math.isfinite(rate) and rate >= 0 else None)


class Prober:
    """Probes stage peers through `pool`; `me` (this daemon's peer id) is believed without a call."""

    def __init__(self, pool: Any, me: bytes, *, timeout_s: float = PROBE_TIMEOUT_S, ttl_s: float = PROBE_TTL_S,
                 max_kept: int = MAX_PROBES_KEPT) -> None:
        self.pool, self.me = pool, me
        self.timeout_s, self.ttl_s, self.max_kept = timeout_s, ttl_s, max_kept
        self._known: collections.OrderedDict[tuple, tuple[float, Probe]] = collections.OrderedDict()
        self._gate = asyncio.Semaphore(MAX_PROBES_AT_ONCE)
        self.probes_sent = 0  # for tests and logs: calls made, cache hits excluded

    async def check_all(self, job_id: bytes, announcements: Iterable[StageAnnouncement]) -> dict[tuple[bytes, int], Probe]:
        """(peer id, stage) -> what it answered, probing every announcement not already known."""
        found = list(announcements)
        probes = await asyncio.gather(*(self.check(job_id, a) for a in found))
        return {(a.peer_id, a.stage): p for a, p in zip(found, probes)}

    async def check(self, job_id: bytes, announced: StageAnnouncement | StagePeer) -> Probe:
        if announced.peer_id == self.me:
            return Probe(True, announced.state == "serving")
        key = (job_id, announced.stage, announced.peer_id, announced.addr)
        now = time.monotonic()
        held = self._known.get(key)
        if held is not None and held[0] > now:
            return held[1]
        async with self._gate:
            probe = await self._call(job_id, announced)
        self._known[key] = (time.monotonic() + self.ttl_s, probe)
        self._known.move_to_end(key)
        while len(self._known) > self.max_kept:
            self._known.popitem(last=False)
        return probe

    async def _call(self, job_id: bytes, announced: StageAnnouncement | StagePeer) -> Probe:
        self.probes_sent += 1
        request = Message({"job": job_id, "stage": announced.stage}, codec="none")
        try:
            async with asyncio.timeout(self.timeout_s):
                conn = await self.pool.connect(announced.addr)
                if conn.remote is None or conn.remote.peer_id != announced.peer_id:
                    log.debug("stage %d peer %s: %s proved another identity", announced.stage,
                              announced.peer_id.hex()[:16], announced.addr)
                    return UNANSWERED
                reply = await conn.call("stage.info", request, timeout=self.timeout_s)
        except RemoteError:
            return Probe(True, False)  # it answered, as itself, that it does not serve the stage
        except (TransportError, OSError, TimeoutError) as exc:
            log.debug("stage %d peer %s at %s did not answer: %s", announced.stage, announced.peer_id.hex()[:16],
                      announced.addr, exc)
            return UNANSWERED
        return answered(reply.meta)
