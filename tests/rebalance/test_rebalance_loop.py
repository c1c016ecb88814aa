"""The rebalancing loop on virtual time: when it checks, when it moves, and what it does on failure.

The table source and the move are plain coroutines (the loop's only collaborators); time is a
VirtualClock driving the event loop, so an hour of 300 s periods runs in milliseconds.
"""

import asyncio

import pytest

from swarmd.clock import VirtualClock, run_virtual
from swarmd.rebalance.mover import MoveFailed, RebalanceLoop
from swarmd.rebalance.policy import PolicyConfig
from swarmd.rebalance.table import PeerLoad, StageTable

CONFIG = PolicyConfig(period_s=300.0, jitter=0.5, confirm_after_s=10.0, margin=0.01)
HOUR = 3600.0


def table_of(sizes):
    """sizes[s] serving peers of speed 1 on stage s; peer ids b"s<stage>p<i>"."""
    return StageTable(len(sizes), [PeerLoad(f"s{s}p{i}".encode(), s, 1.0) for s, n in enumerate(sizes)
                                   for i in range(n)])


class Swarm:
    """A view that changes when this peer moves, and a record of every check and move."""

    def __init__(self, clock: VirtualClock, sizes: list[int], me: bytes, move_s: float = 60.0):
        self.clock, self.sizes, self.me, self.move_s = clock, list(sizes), me, move_s
        self.checks: list[float] = []
        self.moves: list[tuple[float, int]] = []
        self.fail_next = False

    async def table(self) -> StageTable:
        self.checks.append(self.clock.time())
        return table_of(self.sizes)

    async def move(self, to_stage: int) -> None:
        await asyncio.sleep(self.move_s)  # the state download
        if self.fail_next:
            self.fail_next = False
            raise MoveFailed("no live peer of the target stage answered")
        self.moves.append((self.clock.time(), to_stage))
        self.sizes[int(self.me[1:2])] -= 1
        self.sizes[to_stage] += 1


def run_for(seconds: float, swarm: Swarm, clock: VirtualClock) -> RebalanceLoop:
    loop = RebalanceLoop(swarm.me, swarm.table, swarm.move, CONFIG, clock)

    async def main():
        loop.start()
        await asyncio.sleep(seconds)
        await loop.stop()

    run_virtual(main(), clock)
    return loop


def test_the_named_peer_moves_once_after_a_confirming_check_then_stays():
    """Stages 3/1/2: the plan names s0p0 for stage 1. Its first check (one jittered period in) only
    marks the move pending; the confirming check 10 s later moves it; the 2/2/2 swarm then stays put
    for the rest of the hour."""
    clock = VirtualClock()
    swarm = Swarm(clock, [3, 1, 2], b"s0p0")
    loop = run_for(HOUR, swarm, clock)
    start = clock.epoch
    assert [stage for _, stage in swarm.moves] == [1]
    assert swarm.checks[1] - swarm.checks[0] == pytest.approx(CONFIG.confirm_after_s)
    assert 150.0 <= swarm.checks[0] - start <= 450.0
    assert swarm.moves[0][0] == pytest.approx(swarm.checks[1] + 60.0)
    assert loop.moves == 1 and loop.moving_s == pytest.approx(60.0)
    assert [d.reason for d in loop.decisions][:2] == ["pending", "confirmed"]
    assert all(d.reason == "balanced" for d in list(loop.decisions)[2:])


def test_checks_follow_the_jittered_period_not_view_changes():
    """On a balanced view an hour holds 3600 / 300 = 12 checks on average; every gap is a period scaled
    by a factor in [0.5, 1.5], and no confirming checks happen."""
    clock = VirtualClock()
    swarm = Swarm(clock, [2, 2, 2], b"s0p0")
    run_for(HOUR, swarm, clock)
    gaps = [b - a for a, b in zip(swarm.checks, swarm.checks[1:])]
    assert 7 <= len(swarm.checks) <= 24
    assert all(150.0 <= gap <= 450.0 for gap in gaps)
    assert len(set(round(g, 6) for g in gaps)) > 1  # jittered, not a fixed period
    assert swarm.moves == []


def test_a_peer_the_plan_does_not_name_never_moves():
    clock = VirtualClock()
    swarm = Swarm(clock, [3, 1, 2], b"s0p2")  # s0p0 is the one named; s0p2's view never changes
    loop = run_for(HOUR, swarm, clock)
    assert swarm.moves == [] and loop.moves == 0
    assert {d.reason for d in loop.decisions} == {"not chosen"}


def test_a_flapping_view_never_moves_anyone():
    """The bottleneck alternates between stage 1 and stage 2 at every look: the confirming check always
    names another target than the first, so nothing is ever confirmed."""
    clock = VirtualClock()
    swarm = Swarm(clock, [4, 1, 2], b"s0p0")
    views = [[4, 1, 2], [4, 2, 1]]

    async def flapping() -> StageTable:
        swarm.checks.append(clock.time())
        return table_of(views[len(swarm.checks) % 2])

    loop = RebalanceLoop(swarm.me, flapping, swarm.move, CONFIG, clock)

    async def main():
        loop.start()
        await asyncio.sleep(HOUR)
        await loop.stop()

    run_virtual(main(), clock)
    assert len(swarm.checks) >= 10 and swarm.moves == [] and loop.moves == 0


def test_a_failed_move_is_counted_and_retried_a_period_later():
    clock = VirtualClock()
    swarm = Swarm(clock, [3, 1, 2], b"s0p0")
    swarm.fail_next = True
    loop = run_for(HOUR, swarm, clock)
    assert loop.failed_moves == 1 and loop.moves == 1
    assert [stage for _, stage in swarm.moves] == [1]
    assert loop.moving_s == pytest.approx(120.0)


def test_an_unexpected_error_from_the_table_propagates_out_of_check():
    clock = VirtualClock()

    async def broken() -> StageTable:
        raise RuntimeError("the gossip service is not running")

    async def never(to_stage: int) -> None:
        raise AssertionError("no move without a table")

    with pytest.raises(RuntimeError):
        run_virtual(RebalanceLoop(b"me", broken, never, CONFIG, clock).check(), clock)


def test_stop_cancels_a_move_in_progress():
    """stop() during the (here endless) state download cancels it: the move sees CancelledError, so the
    daemon's move can undo a half-done switch, and stop() returns."""
    clock = VirtualClock()
    swarm = Swarm(clock, [3, 1, 2], b"s0p0", move_s=10 * HOUR)
    cancelled = []

    async def move(to_stage: int) -> None:
        try:
            await swarm.move(to_stage)
        except asyncio.CancelledError:
            cancelled.append(to_stage)
            raise

    loop = RebalanceLoop(swarm.me, swarm.table, move, CONFIG, clock)

    async def main():
        loop.start()
        await asyncio.sleep(HOUR)
        await loop.stop()

    run_virtual(main(), clock)
    assert cancelled == [1] and swarm.moves == [] and loop.moves == 0
