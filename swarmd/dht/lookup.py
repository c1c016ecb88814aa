"""An iterative Kademlia lookup that never waits in lockstep.

`alpha` workers each keep one query outstanding: when an answer (or a failure) comes back, that
worker immediately asks the closest candidate nobody has asked yet. A worker also stops waiting
for a query that is slower than `patience` and moves on, leaving the call running (its answer is
still used when it comes): otherwise three frozen peers met at once would stall the whole lookup
for a full call timeout, which is the lockstep behaviour we are avoiding. At most 3 x alpha
queries are ever out at once. Peers the node has recently seen fail, or seen outlive our
patience, are skipped outright (the `skip` predicate), so a dead contact costs a timeout (or one
patience) once, not once per lookup.

The lookup ends when the k closest candidates that did not fail have all answered, when nothing is
left to ask, or when `enough()` says the caller has what it needs (a get that reached its quorum,
or a get whose `closest_answered(get_miss_settle)` closest candidates all answered empty).
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .errors import CallFailed, DHTProtocolError
from .routing import id_int

NEW, ASKED, ANSWERED, FAILED, SUSPECT = range(5)

#: query(peer_id, address) -> contacts the peer returned, as (peer_id, address); raises on failure.
Query = Callable[[bytes, str], Awaitable[list[tuple[bytes, str]]]]


@dataclass(slots=True)
class Candidate:
    peer_id: bytes
    address: str
    hops: int
    state: int = NEW


@dataclass(frozen=True, slots=True)
class LookupResult:
    nearest: list[Candidate]  # the k closest peers that answered, closest first
    rpcs: int                 # queries sent
    hops: int                 # path length to the closest peer that answered
    failures: int             # queries that failed (timeouts, refusals, bad replies)


class Lookup:
    def __init__(self, target: bytes, own_id: bytes, k: int, alpha: int, patience: float, query: Query,
                 skip: Callable[[bytes], bool], slow: Callable[[bytes], None],
                 enough: Callable[[], bool] = lambda: False) -> None:
        self._goal = id_int(target)
        self._own_id = own_id
        self._k, self._alpha, self._patience = k, alpha, patience
        self._query, self._skip, self._slow, self._enough = query, skip, slow, enough
        self._cands: dict[bytes, Candidate] = {}
        self._order: list[tuple[int, bytes]] = []  # (distance, peer_id), sorted
        self._in_flight = 0
        self._rpcs = self._failures = 0
        self._finished = asyncio.Event()
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._tg: asyncio.TaskGroup | None = None

    def add(self, peer_id: bytes, address: str, hops: int) -> None:
        if peer_id == self._own_id or peer_id in self._cands:
            return
        cand = Candidate(peer_id, address, hops, SUSPECT if self._skip(peer_id) else NEW)
        self._cands[peer_id] = cand
        bisect.insort(self._order, (id_int(peer_id) ^ self._goal, peer_id))

    async def run(self) -> LookupResult:
        await self._round()
        if not self._enough() and not any(c.state == ANSWERED for c in self._cands.values()):
            # Nobody answered: the backed-off peers are all we have (a lossy link or a tiny swarm
            # made them look dead), so give them one more chance rather than return nothing.
            suspects = [c for c in self._cands.values() if c.state == SUSPECT]
            if suspects:
                for cand in suspects:
                    cand.state = NEW
                self._finished.clear()
                await self._round()
        nearest = [self._cands[pid] for _, pid in self._order if self._cands[pid].state == ANSWERED][: self._k]
        return LookupResult(nearest, self._rpcs, nearest[0].hops if nearest else 0, self._failures)

    async def _round(self) -> None:
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            for _ in range(self._alpha):
                self._tasks.add(tg.create_task(self._worker()))
            self._check_done()
            await self._finished.wait()
            for task in list(self._tasks):  # workers and the slow queries they left running
                task.cancel()

    def _next(self) -> Candidate | None:
        """The closest unasked candidate among the k closest that have not failed."""
        seen = 0
        for _, pid in self._order:
            cand = self._cands[pid]
            if cand.state in (FAILED, SUSPECT):
                continue
            if cand.state == NEW:
                return cand
            seen += 1
            if seen >= self._k:
                return None
        return None

    def closest_answered(self, m: int) -> bool:
        """Whether the m closest candidates have all answered (fewer than m when nothing else is
        left to ask), none of them failed or skipped: a dead node among the closest hides the
        neighbours only it would have named (with 30% of 1000 nodes killed, a miss that skipped
        them settled on live non-holders while the record's 8 closest live holders went unasked).
        An `enough` predicate reads it while the lookup runs."""
        answered = 0
        for _, pid in self._order:
            cand = self._cands[pid]
            if cand.state != ANSWERED:
                return False
            answered += 1
            if answered >= m:
                return True
        return answered > 0 and self._in_flight == 0

    def _check_done(self) -> None:
        if self._enough() or (self._in_flight == 0 and self._next() is None):
            self._finished.set()

    async def _worker(self) -> None:
        while not self._finished.is_set():
            cand = self._next()
            if cand is None:
                changed = self._changed
                await changed.wait()
                continue
            cand.state = ASKED
            self._in_flight += 1
            self._rpcs += 1
            ask = self._tg.create_task(self._ask(cand))
            self._tasks.add(ask)
            await asyncio.wait([ask], timeout=self._patience)
            if not ask.done() and self._in_flight >= 3 * self._alpha:
                # Everyone is slow (an overloaded host, or us): adding queries would only add load.
                await asyncio.wait([ask])

    async def _ask(self, cand: Candidate) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            found = await self._query(cand.peer_id, cand.address)
        except asyncio.CancelledError:
            # The lookup finished while this query was still out: if it had already outlived our
            # patience, report the peer as slow so the next lookup does not wait on it again.
            if loop.time() - started >= self._patience:
                self._slow(cand.peer_id)
            raise
        except (CallFailed, DHTProtocolError):
            cand.state = FAILED
            self._failures += 1
        else:
            cand.state = ANSWERED
            for peer_id, address in found:
                self.add(peer_id, address, cand.hops + 1)
        finally:
            self._in_flight -= 1
            self._tasks.discard(asyncio.current_task())
        self._changed.set()
        self._changed = asyncio.Event()
        self._check_done()
