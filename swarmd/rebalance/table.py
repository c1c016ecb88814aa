"""Per-stage load table: what the policy reads, built from a gossip view or kept live by the simulator.

The policy must be cheap enough to run at every check of hundreds of simulated peers, so stage sums
are kept incrementally here and every change bumps `version`; whatever the policy derives from one
version (the shared move plan) is memoised in `memo` and dropped on the next change.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable
from dataclasses import dataclass

SERVING = "serving"
JOINING = "joining"
DRAINING = "draining"
STATES = (SERVING, JOINING, DRAINING)
#: A peer's announced or gossiped speed counts at most this multiple of the job's lower-median
#: speed. Honest swarms mix devices (a GPU peer may run ten times a CPU peer), so the cap is loose;
#: what it stops is one claim of 10^12 samples/s outweighing every honest peer (docs/security.md).
CLAIM_FACTOR = 16.0


@dataclass(frozen=True)
class PeerLoad:
    """One peer as the policy sees it; `speed` is its measured samples/s."""

    peer_id: bytes
    stage: int
    speed: float
    state: str = SERVING


class StageTable:
    """Peers grouped by stage with two running sums per stage.

    `serving[s]` is what stage s processes now; `expected[s]` adds the peers downloading state to join
    it (`serving_count[s]` and `expected_count[s]` count the peers behind each sum). Decisions use `expected` so that peers already on their way fill a gap only once; draining
    peers are counted nowhere, since they take no new work for any stage.
    """

    def __init__(self, num_stages: int, peers: list[PeerLoad] = ()):
        if num_stages < 1:
            raise ValueError(f"a pipeline has at least one stage, got {num_stages}")
        self.num_stages = num_stages
        self.members: list[dict[bytes, PeerLoad]] = [{} for _ in range(num_stages)]
        self.serving = [0.0] * num_stages
        self.expected = [0.0] * num_stages
        self.serving_count = [0] * num_stages
        self.expected_count = [0] * num_stages
        self.by_id: dict[bytes, PeerLoad] = {}
        self.version = 0
        self.memo: dict = {}
        for peer in peers:
            self.put(peer)

    def put(self, peer: PeerLoad) -> None:
        """Insert or replace a peer's row."""
        if not 0 <= peer.stage < self.num_stages:
            raise ValueError(f"stage {peer.stage} outside 0..{self.num_stages - 1}")
        if peer.state not in STATES:
            raise ValueError(f"unknown peer state {peer.state!r}")
        if peer.peer_id in self.by_id:
            self._drop(self.by_id[peer.peer_id])
        self.by_id[peer.peer_id] = peer
        self.members[peer.stage][peer.peer_id] = peer
        if peer.state == SERVING:
            self.serving[peer.stage] += peer.speed
            self.serving_count[peer.stage] += 1
        if peer.state != DRAINING:
            self.expected[peer.stage] += peer.speed
            self.expected_count[peer.stage] += 1
        self._changed()

    def remove(self, peer_id: bytes) -> None:
        peer = self.by_id.pop(peer_id)
        self._drop(peer)
        self._changed()

    def _drop(self, peer: PeerLoad) -> None:
        del self.members[peer.stage][peer.peer_id]
        if peer.state == SERVING:
            self.serving[peer.stage] -= peer.speed
            self.serving_count[peer.stage] -= 1
            if self.serving_count[peer.stage] == 0:
                self.serving[peer.stage] = 0.0  # no float residue on an empty stage
        if peer.state != DRAINING:
            self.expected[peer.stage] -= peer.speed
            self.expected_count[peer.stage] -= 1
            if self.expected_count[peer.stage] == 0:
                self.expected[peer.stage] = 0.0

    def _changed(self) -> None:
        self.version += 1
        if self.memo:
            self.memo = {}

    def throughput(self) -> float:
        """Samples/s of the pipeline now: its weakest stage."""
        return min(self.serving)


def bounded_speeds(speeds: dict[Hashable, float], factor: float = CLAIM_FACTOR) -> dict[Hashable, float]:
    """Each positive speed cut to `factor` times the lower median of the positive ones: with one
    honest peer and one liar the cap is the honest peer's speed's multiple, not the liar's."""
    positive = [v for v in speeds.values() if v > 0]
    if not positive:
        return dict(speeds)
    cap = factor * statistics.median_low(positive)
    return {key: min(value, cap) for key, value in speeds.items()}
