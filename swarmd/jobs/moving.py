"""What a rebalancing move is made of, apart from the bookkeeping `Serving.move` does.

A move must not lose a sample of the step in progress. The old stage's peer stops taking work
(state `draining`: compute calls are answered `busy` and trainers reroute them, its announcement and
its progress replies say `draining`) and lets the work it already queued finish, so every answer a
trainer waits for is delivered. What it accumulated for the uncommitted step it does not hand over:
its stage-mates leave a draining peer out of their rounds, so they report the microbatch ids they saw
it hold as `missing`, and the trainers re-send those to the peers that stay (the same path that
recovers the work of a preempted peer, docs/trainer.md). That costs a recompute of at most one step's
share of this peer, and never counts a microbatch twice: the draining peer is in no round. A round
it had already joined is let finish (it commits the step with its gradients in it) before it leaves.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from swarmd.directory import StageDirectory, StagePeer
from swarmd.jobs.probing import Prober

DRAINING = "draining"
JOINING = "joining"
SERVING = "serving"

#: Moves remembered for `swarmctl status` and logs; older ones are forgotten.
MOVES_KEPT = 32


@dataclass
class Moving:
    """A move under way: what this peer's own load entry says while it happens (draining its old
    stage, then joining the new one, counted at the speed it measured on the old stage)."""

    source: int
    target: int
    speed: float
    phase: str = DRAINING
    started: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class MoveRecord:
    """One finished move, successful or not; seconds are wall time of each phase."""

    job: str
    source: int
    target: int
    drain_s: float
    join_s: float
    total_s: float
    step: int  # the step the new stage's state was downloaded at (-1 when the move failed)
    error: str = ""  # empty when the move succeeded
    at: float = field(default_factory=time.time)


async def serving_peers(directory: StageDirectory, job_id: bytes, stage: int, me: bytes,
                        prober: Prober | None = None) -> list[StagePeer]:
    """Other peers announcing `stage` as serving, from the DHT's membership; with a `prober`, only
    those that answered a call as themselves and said they serve it.

    Why probe: an announcement is a claim anyone can store. Counting one that points at nothing as
    the peer that "stays" would let a stranger move a stage's only real peer away."""
    announced = [p for p in await directory.peers(job_id, stage) if p.peer_id != me and p.state == SERVING]
    if prober is None:
        return announced
    probes = await asyncio.gather(*(prober.check(job_id, p) for p in announced))
    return [p for p, probe in zip(announced, probes) if probe.serving]

