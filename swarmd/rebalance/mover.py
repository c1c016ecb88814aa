"""When to move: the policy's check on its own jittered clock, and the hand-off to whoever moves.

The simulator showed that re-planning on every view change multiplies moves and lowers throughput
(docs/rebalancing.md): a gap must outlive part of a period before it is worth a state download. So
this loop calls `policy.plan` only at the times `plan` itself schedules (`Decision.next_check_at`),
never on gossip merges, and hands a confirmed decision to an injected `move(to_stage)`: the daemon
implements the move (drain, download the new stage's state, announce, withdraw); this module only
decides when to ask for one and measures how long it took.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable

from swarmd.clock import Clock, RealClock
from swarmd.rebalance.policy import Decision, PolicyConfig, PolicyState, jitter_factor, plan
from swarmd.rebalance.table import StageTable
from swarmd.rebalance.view import RebalanceError
from swarmd.supervisor import Supervisor
from transport.tasks import TaskSet

log = logging.getLogger(__name__)

#: Decisions kept for status and logs: a day of checks at the default period is ~300.
DECISIONS_KEPT = 256


class MoveFailed(RebalanceError):
    """Raised by a `move` callback for an expected failure (no live peer to download from, the
    download broke): the loop logs it, forgets the pending decision and checks again next period."""


TableSource = Callable[[], Awaitable[StageTable]]
MoveCallback = Callable[[int], Awaitable[None]]


class RebalanceLoop:
    """This peer's periodic check of the policy; `check()` is one step, `start()` runs them forever."""

    def __init__(self, me: bytes, table: TableSource, move: MoveCallback, config: PolicyConfig = PolicyConfig(),
                 clock: Clock = RealClock(), supervisor: Supervisor | None = None, name: str = "checks") -> None:
        self.me, self.table, self.move, self.config, self.clock = me, table, move, config, clock
        self.state = PolicyState()
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=DECISIONS_KEPT)
        self.moves = 0
        self.failed_moves = 0
        self.moving_s = 0.0  # wall time spent inside `move`, successful or not
        self.last_check_at: float | None = None  # clock time of the last check (for status)
        self._tasks = TaskSet("rebalance")
        self._supervisor = supervisor or Supervisor("rebalancing")
        self._name = name

    def start(self) -> None:
        """Run the checks; an unexpected error in one is logged, shown and the checks restarted."""
        self._tasks.spawn(self._supervisor.run(self._name, self.run), "checks")

    async def stop(self) -> None:
        """Cancel the loop, a move in progress included (the daemon's move must undo on cancel)."""
        await self._tasks.aclose("rebalancer stopping")

    async def run(self) -> None:
        """Forever: wait for the next check, check. The first check is one jittered period after start:
        a peer that just joined went to the bottleneck already (`choose_join_stage`)."""
        next_at = self._after_period(self.clock.time())
        while True:
            await asyncio.sleep(max(0.0, next_at - self.clock.time()))
            next_at = await self.check()

    async def check(self) -> float:
        """One check: plan, and move if the plan confirmed this peer. Returns when to check next."""
        now = self.last_check_at = self.clock.time()
        decision = plan(await self.table(), self.me, now, self.state, self.config)
        self.state = decision.state
        self.decisions.append(decision)
        if decision.move_to is None:
            return decision.next_check_at
        log.info("rebalancing: moving to stage %d (%s)", decision.move_to, decision.reason)
        started = self.clock.monotonic()
        try:
            await self.move(decision.move_to)
        except MoveFailed as exc:
            self.failed_moves += 1
            log.warning("rebalancing: the move to stage %d failed: %s", decision.move_to, exc)
        else:
            self.moves += 1
        finally:
            self.moving_s += self.clock.monotonic() - started
        # The move took a while and changed the swarm: the next check is a full period from now.
        self.state = PolicyState()
        return self._after_period(self.clock.time())

    def _after_period(self, now: float) -> float:
        return now + self.config.period_s * jitter_factor(self.me, now, self.config.jitter)
