"""Reading the stages' `stage.info` answers about one step: committed yet, what they lost, what is undone.

Pure: every function takes the answers (already received, untrusted: anything malformed counts as
absent) and, where time matters, the caller's clock. The trainer acts on what they return.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Info = dict[str, Any]


def as_int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def as_ints(value: Any) -> list[int]:
    return [v for v in value if isinstance(v, int) and not isinstance(v, bool)] if isinstance(value, list) else []


def committed(infos: list[Info], step: int) -> list[Info]:
    """The answers of peers that have committed `step` (their step count is past it)."""
    return [info for info in infos if as_int(info.get("step")) > step]


def step_record(infos: list[Info], step: int) -> tuple[int, int]:
    """(samples, summed_duplicates) of `step` from the `last_step` record of peers that just committed
    it (-1, -1 when none shows it): the microbatches summed twice are what `samples` exceeds
    global_samples by."""
    for info in infos:
        record = info.get("last_step")
        if isinstance(record, dict) and as_int(record.get("step"), -1) == step:
            return as_int(record.get("samples"), -1), as_int(record.get("summed_duplicates"), -1)
    return -1, -1


def uncovered_everywhere(infos: list[Info], step: int, ids: set[int]) -> set[int]:
    """Those of `ids` that no answering peer of the stage holds. Peers that have all committed
    fewer than `step` steps hold nothing of it (their progress is about an older step: the stage
    lost its state, e.g. restored an older checkpoint after all its peers died), so everything is
    uncovered there. No answer at all proves nothing: the empty set."""
    if not infos:
        return set()
    uncovered = set(ids)
    if any(as_int(info.get("step")) >= step for info in infos):
        for info in infos:
            uncovered &= set(as_ints(info.get("uncovered")))
    return uncovered


@dataclass
class LossWatch:
    """Which of this trainer's microbatch ids one stage has lost, with the grace `uncovered` needs.

    `missing` (a peer held them, then left) is believed at once. `uncovered` (no live peer holds
    them) can merely lag a backward that just completed (stage-mates see each other's ids once a
    progress poll), so an id counts only once every answering peer has said so for `grace_s`."""

    grace_s: float
    _since: dict[int, float] = field(default_factory=dict)

    def lost(self, infos: list[Info], step: int, mine: set[int], now: float) -> dict[int, str]:
        missing = {mb for info in infos for mb in as_ints(info.get("missing"))} & mine
        uncovered = uncovered_everywhere(infos, step, mine)
        for mb in [mb for mb in self._since if mb not in uncovered]:
            del self._since[mb]
        for mb in uncovered:
            self._since.setdefault(mb, now)
        lost = {mb: "uncovered" for mb in uncovered if now - self._since[mb] >= self.grace_s}
        return lost | {mb: "missing" for mb in missing}
