"""Reading the stages' `stage.info` answers about one step: committed yet, what they lost, what is undone.

Pure: every function takes the answers (already received, untrusted: anything malformed counts as
absent) and, where time matters, the caller's clock. The trainer acts on what they return.

No one answer decides for a stage (docs/security.md, "Progress lies"): a stage's step is the lower
median of its peers' claims (`agreed_step`), so a peer claiming a far step, or the step of a stage
that lost its state, moves it only by being most of the answers; an id is uncovered when at least
half of the answers at the step say so (`uncovered_everywhere`), so one peer answering
`uncovered: []` hides nothing. Which answers vote is the caller's choice (`voters`: the trainer
prefers peers that served it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Info = dict[str, Any]


def as_int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def as_ints(value: Any) -> list[int]:
    return [v for v in value if isinstance(v, int) and not isinstance(v, bool)] if isinstance(value, list) else []


def lower_median(values: list[int]) -> int | None:
    """The value at least half of `values` reach or exceed, the smaller of two middles (None: no
    values). One value far above or below the others does not move it; only most of them do."""
    return sorted(values)[(len(values) - 1) // 2] if values else None


def voters(answers: dict[bytes, Info], trusted: set[bytes]) -> list[Info]:
    """The answers that decide for a stage: the serving peers' when any (a joining peer, e.g. one
    downloading its mates' state, or a draining one says nothing about the stage's step), and of
    those the `trusted` peers' when any answered, else all of them. A peer `behind` (idle, it
    catches up with its mates only every so often: docs/stage-rpc.md) never votes: its step is
    older than its stage's by design, and counted it would hold the stage's step back (every id
    then looks uncovered and is re-sent) or, as the lower median, stand for a commit."""
    shown = {peer: info for peer, info in answers.items() if info.get("state") != "behind"}
    serving = {peer: info for peer, info in shown.items() if info.get("state") == "serving"} or shown
    return [info for peer, info in serving.items() if peer in trusted] or list(serving.values())


def agreed_step(infos: list[Info]) -> int | None:
    """The stage's step by its peers' answers: the lower median of their claims (None: no answer)."""
    return lower_median([as_int(info.get("step")) for info in infos])


def committed(infos: list[Info], step: int) -> list[Info]:
    """The answers of peers that have committed `step` (their step count is past it), when the
    stage has (its agreed step is past it); otherwise none, whatever single peers claim."""
    agreed = agreed_step(infos)
    if agreed is None or agreed <= step:
        return []
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
    """Those of `ids` the stage's peers say no live peer holds: listed in `uncovered` by at least
    half of the answers at `step` (a vote, so neither one peer answering `uncovered: []` nor one
    listing everything decides; ties count as uncovered, since a lost id stalls the step while a
    re-sent one a peer does hold is summed once, I1). When the stage's agreed step is below `step`,
    its peers hold nothing of it (their progress is about an older step: the stage lost its
    state, e.g. restored an older checkpoint after all its peers died), so everything is
    uncovered. No answer at all proves nothing: the empty set."""
    agreed = agreed_step(infos)
    if agreed is None:
        return set()
    if agreed < step:
        return set(ids)
    at_step = [set(as_ints(info.get("uncovered"))) for info in infos if as_int(info.get("step")) == step]
    return {mb for mb in ids if 2 * sum(mb in listed for listed in at_step) >= len(at_step) > 0}


@dataclass
class LossWatch:
    """Which of this trainer's microbatch ids one stage has lost, with the grace `uncovered` needs.

    `missing` (a peer held them, then left), from any one of `reports` (every answer), is
    believed at once: a peer lists only what its mates held, and a spurious re-send is summed once
    (I1). `uncovered` (no live peer holds them) can merely lag a backward that just completed
    (stage-mates see each other's ids once a progress poll), so an id counts only once the voting
    answers `infos` have said so (`uncovered_everywhere`) for `grace_s`."""

    grace_s: float
    _since: dict[int, float] = field(default_factory=dict)

    def lost(self, infos: list[Info], step: int, mine: set[int], now: float,
             reports: list[Info] | None = None) -> dict[int, str]:
        missing = {mb for info in (infos if reports is None else reports) for mb in as_ints(info.get("missing"))}
        missing &= mine
        uncovered = uncovered_everywhere(infos, step, mine)
        for mb in [mb for mb in self._since if mb not in uncovered]:
            del self._since[mb]
        for mb in uncovered:
            self._since.setdefault(mb, now)
        lost = {mb: "uncovered" for mb in uncovered if now - self._since[mb] >= self.grace_s}
        return lost | {mb: "missing" for mb in missing}


@dataclass
class InfoSkips:
    """Peers of one stage not asked `stage.info` for a while: each that did not answer in time (a
    hung or overloaded peer) is skipped for `initial_s`, doubling with each further miss up to
    `max_s`; one answer clears its record. Without this a hung peer costs every poll its timeout."""

    initial_s: float
    max_s: float
    _until: dict[bytes, float] = field(default_factory=dict)
    _misses: dict[bytes, int] = field(default_factory=dict)

    def missed(self, peer: bytes, now: float) -> None:
        misses = self._misses.get(peer, 0)
        self._misses[peer] = misses + 1
        self._until[peer] = now + min(self.initial_s * 2 ** min(misses, 30), self.max_s)

    def answered(self, peer: bytes) -> None:
        self._until.pop(peer, None)
        self._misses.pop(peer, None)

    def skipped(self, now: float) -> set[bytes]:
        """The peers not to ask now."""
        for peer in [p for p, until in self._until.items() if now >= until]:
            del self._until[peer]  # its record stays: the next miss skips it for longer
        return set(self._until)
