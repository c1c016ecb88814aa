"""Stage-mates step together: the shell that carries out the stage core's round decisions.

Every `sync_interval_s` a peer polls its mates' progress (`stage.sync.progress`: step, state,
digest, and the microbatch ids it holds and computes, as ranges), hands the answers to the stage
core (`StageCore.observe`) and does what `StageCore.decide` says: download a mate's state (a mate
is ahead, or the visible peers at this step agree on another digest), or lead a round. A round
(`stage.sync.round`, with the members, sorted by peer id, and the digest they share) runs the
butterfly all-reduce (allreduce.py); every member sees every member's ids and samples with its
first part, so every member computes the same `plan_round`: only the kept members' parts are
summed, the others are left out (a microbatch is summed exactly once), and if the kept ones do not
cover the step the round fails and the left-out members clear their sums. A round that fails on a
member (a mate vanished or straggled, an abort) is put back; failing members tell the others
(`stage.sync.abort`) and stop sending at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from swarmd.directory import StageDirectory
from swarmd.errors import PeerError
from swarmd.stage.accumulator import Accumulator
from swarmd.stage.allreduce import Contribution, Mailbox, RoundBox, choose_owners, phase_deadlines
from swarmd.stage.core import (DIGEST_BYTES, Download, Lead, MateView, Phase, RoundPlan, StageCore, every_member,
                               plan_round)
from swarmd.stage.errors import RoundFailed, bad_input, busy, protocol_mismatch
from swarmd.stage.idsets import decode_ranges, encode_ranges
from swarmd.stage.limits import StageLimits
from swarmd.stage.packing import Piece, message_codec, pack, round_trip, unpack
from swarmd.stage.robust import CENTERED_CLIP, centered_clip
from transport.errors import DeadlineExceeded, RpcError, TransportError
from transport.rpc import Message, Pool, Request

log = logging.getLogger(__name__)

RATE_EMA = 0.3  # weight of the newest part in the send-rate estimate: a few rounds to settle
MIN_MEASURED_BYTES = 64 * 1024  # smaller parts measure latency, not the link's rate
#: The round RPCs' wire format (invitation, parts, aborts), shown with a peer's progress and
#: carried by its invitations and parts. A peer refuses a round of another version
#: (`protocol_mismatch`) and leaves mates of another version out of its rounds: peers whose rounds
#: cannot interoperate fail clearly instead of obscurely. A peer that shows none predates the
#: versioning: version 1. Version 2: owners in invitations and parts, plans (`kept`) in gathers,
#: `member`/`leaving`/`left_out` in aborts, fp16 pieces scaled by a power of two (`exp`).
ROUND_PROTOCOL = 2
UNVERSIONED = 1


class StageHost(Protocol):
    """What the sync shell needs from the service that owns it (StageService implements it)."""

    core: StageCore
    accumulator: Accumulator
    limits: StageLimits
    pool: Pool
    directory: StageDirectory
    job_id: bytes
    stage_index: int
    numel: int

    def meta(self) -> dict[str, Any]: ...

    async def in_aux(self, fn: Callable, *args: Any) -> Any: ...

    def flatten(self, grads: list[torch.Tensor | None]) -> torch.Tensor: ...

    async def commit(self, step: int, round_id: bytes, flat: torch.Tensor, members: list[bytes],
                     plan: RoundPlan, outliers: tuple[str, ...]) -> None: ...

    async def catch_up(self, download: Download) -> None: ...

    def spawn(self, coro: Coroutine, name: str) -> asyncio.Task: ...


@dataclass
class _RoundRun:
    """One round as this member runs it: what its phases share, and what its failure, abort and
    settling read."""

    round_id: bytes
    step: int
    members: list[tuple[bytes, str]]
    owners: tuple[bool, ...]
    me: int  # this peer's member index
    box: RoundBox | None = None  # None until the mailbox opened (or marked joined) the round's box
    outcome: str = "failed"  # "committed"; "left out" clears this peer's sum; "failed" puts it back
    late: list[bytes] = field(default_factory=list)  # members late here, noted late when the round settles
    sending: bool = False  # this peer's own parts are leaving: a timeout then makes it the straggler
    abort: bool = True  # tell the others the round failed here (False: left out alike by every owner)
    cleared: tuple[int, ...] = ()  # the members this peer's plan left out, named in its abort

    @property
    def ids(self) -> list[bytes]:
        return [p for p, _ in self.members]


class StageSync:
    def __init__(self, host: StageHost) -> None:
        self.host = host
        self.core = host.core
        limits = host.limits
        # A round lasts two phases of at most round_timeout_s each; a join lags its round's first
        # part by at most the leader's join call (progress_timeout_s);
        # twice that before a box nobody joined here counts as an orphan.
        self.mailbox = Mailbox(limits.max_open_rounds, 2 * limits.round_timeout_s,
                               2 * limits.progress_timeout_s, limits.closed_rounds_kept)
        self.last_failure: str | None = None
        self.rate = 0.0  # EMA of this peer's all-reduce send rate, bytes/s (shown to mates)
        self._authenticated = host.pool.config.identity is not None
        self._mismatched: set[bytes] = set()  # announced mates of another round protocol (warned once)

    @property
    def in_round(self) -> bool:
        return self.core.round_id is not None

    @property
    def missing(self) -> list[int]:
        return self.core.missing

    @property
    def uncovered(self) -> list[int]:
        return self.core.uncovered

    # ----------------------------------------------------------------------------- polling

    async def run(self) -> None:
        """Every `sync_interval_s`: poll (`polled_mates` of) the mates, then decide. A poll waits for
        its slowest mate's answer (up to progress_timeout_s), so it runs beside the decisions: a
        tick waits one interval for it, then decides on the views at hand, and the next poll starts
        once it is over. A step this peer and the mates it needs cover must not wait on a mate that
        holds nothing of it (a stopped or overloaded one)."""
        interval = self.host.limits.sync_interval_s
        polling: asyncio.Task | None = None
        try:
            while True:
                await asyncio.sleep(interval)
                if polling is None or polling.done():
                    if polling is not None:
                        _poll_outcome(polling, self.host.stage_index)
                    polling = asyncio.create_task(self.poll(full=False), name="stage sync poll")
                    await asyncio.wait({polling}, timeout=interval)
                try:
                    await self.act()
                except (TransportError, RpcError, TimeoutError) as exc:
                    log.debug("stage %d sync: %s", self.host.stage_index, exc)
        finally:
            if polling is not None:
                polling.cancel()
                await asyncio.gather(polling, return_exceptions=True)

    async def act(self) -> None:
        """Do what the core decides on the views at hand: download, lead a round, or nothing."""
        held = self.host.accumulator.progress(self.core.step).ids
        action = self.core.decide(_now(), held)
        if isinstance(action, Download):
            await self.host.catch_up(action)
        elif isinstance(action, Lead):
            await self.lead(action)

    async def poll(self, full: bool = True) -> list[MateView]:
        """Ask announced mates for their progress (every one, or `polled_mates` of them round robin)
        and tell the core what came back."""
        peers = await self.host.directory.peers(self.host.job_id, self.host.stage_index)
        announced = [p for p in peers if p.peer_id != self.core.peer_id]
        mates = announced
        if not full:
            chosen = set(self.core.to_poll([p.peer_id for p in announced], self.host.limits.polled_mates))
            mates = [p for p in announced if p.peer_id in chosen]
        results = await asyncio.gather(*(self._progress(p.peer_id, p.addr) for p in mates), return_exceptions=True)
        views, slow = [], []
        self._mismatched &= {p.peer_id for p in announced}
        for mate, result in zip(mates, results):
            if isinstance(result, MateView):
                views.append(result)
                self._mismatched.discard(mate.peer_id)
            elif isinstance(result, DeadlineExceeded):
                slow.append(mate.peer_id)  # alive but slow, maybe: the core shields what it held
            elif isinstance(result, ProtocolMismatch):
                # Never a round member: treated as a mate that refused the poll (what it holds
                # is lost to this peer's rounds, and re-sent). Said once while it stays announced.
                if mate.peer_id not in self._mismatched:
                    self._mismatched.add(mate.peer_id)
                    log.warning("stage %d: %s; it is left out of this peer's rounds", self.host.stage_index, result)
            elif not isinstance(result, (TransportError, RpcError, TimeoutError, ValueError)):
                raise result
        self.core.observe(_now(), views, slow, [m.peer_id for m in announced], [m.peer_id for m in mates])
        return views

    async def _progress(self, peer_id: bytes, addr: str) -> MateView:
        reply = await self.host.pool.call(addr, "stage.sync.progress", Message(self.host.meta(), codec="none"),
                                          timeout=self.host.limits.progress_timeout_s)
        meta = reply.meta
        step, state, digest = meta.get("step"), meta.get("state"), meta.get("digest")
        if (meta.get("peer_id") != peer_id or type(step) is not int or step < 0 or not isinstance(state, str)
                or not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES):
            raise ValueError(f"bad progress reply from {addr}")
        span = self.core.step_ids(step)
        ids = decode_ranges(meta.get("held"), span)
        claimed = decode_ranges(meta.get("claimed"), span)
        rate = meta.get("rate", 0.0)
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < float("inf"):
            raise ValueError(f"bad rate in the progress reply from {addr}")
        protocol = meta.get("protocol", UNVERSIONED)
        if protocol != ROUND_PROTOCOL:
            raise ProtocolMismatch(peer_id, addr, protocol)
        return MateView(peer_id, addr, step, state, digest, ids, claimed, float(rate))

    def progress_reply(self) -> Message:
        step = self.core.step
        progress = self.host.accumulator.progress(step)
        return Message({"peer_id": self.core.peer_id, "step": step, "state": str(self.core.phase),
                        "digest": self.core.digest, "held": encode_ranges(progress.ids),
                        "claimed": encode_ranges(self.core.claimed(step) - progress.ids),
                        "samples": progress.samples, "in_round": self.in_round, "rate": self.rate,
                        "protocol": ROUND_PROTOCOL}, codec="none")

    # ----------------------------------------------------------------------------- rounds

    async def lead(self, lead: Lead) -> None:
        round_id = os.urandom(16)
        ids = [p for p, _ in lead.members]
        owners = choose_owners([self.rate if p == self.core.peer_id else self.core.rate_of(p) for p in ids],
                               [self.core.suspect(p) for p in ids], self.host.limits.owner_min_rate_fraction)
        if not all(owners):
            log.info("stage %d step %d: %d of %d round members own no shard (slow send rate or late lately): %s",
                     self.host.stage_index, lead.step, owners.count(False), len(ids),
                     [p.hex()[:8] for p, owns in zip(ids, owners) if not owns])
        meta = {**self.host.meta(), "protocol": ROUND_PROTOCOL, "step": lead.step, "round": round_id,
                "digest": lead.digest, "members": ids, "addrs": [a for _, a in lead.members],
                "owners": _indices(owners)}
        others = [(p, a) for p, a in lead.members if p != self.core.peer_id]
        calls = [self.host.pool.call(a, "stage.sync.round", Message(meta, codec="none"),
                                     timeout=self.host.limits.progress_timeout_s) for _, a in others]
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        for r in failed:
            if not isinstance(r, (TransportError, RpcError, TimeoutError)):
                raise r
        silent = [p for (p, _), r in zip(others, results) if isinstance(r, (DeadlineExceeded, TimeoutError))]
        if silent:  # a member that cannot answer an invitation in time is late, like late parts
            self.core.round_failed(_now(), round_id, self.core.peer_id, silent)
        reason = self.core.invited(_now(), self.core.peer_id, lead.step, lead.digest) if not failed else "refused"
        if reason is not None:
            await self._abort(round_id, others)
            return
        self.start(round_id, lead.step, list(lead.members), owners)

    def start(self, round_id: bytes, step: int, members: list[tuple[bytes, str]], owners: tuple[bool, ...]) -> None:
        # Opened (or marked joined) now, so a closed round or a full mailbox refuses the join itself.
        self.mailbox.box(round_id, step, [p for p, _ in members], self.core.peer_id, self.host.numel, join=True,
                         owners=owners)
        self.core.round_started(round_id)
        try:
            self.host.spawn(self._round(round_id, step, members, owners), f"round {round_id.hex()[:8]}")
        except BaseException:
            self.core.round_failed(_now(), round_id, members[0][0])
            raise

    def join(self, req: Request) -> Message:
        """`stage.sync.round` from a leader: only the leader itself (members[0], proven by the
        connection) may invite, and every member's address is the one this peer polled it at (its
        announcement), never one the invitation names (see `_check_caller` for peers without ids)."""
        meta = req.meta
        _check_protocol(meta, "round")
        round_id, step, digest = meta.get("round"), meta.get("step"), meta.get("digest")
        members, addrs = meta.get("members"), meta.get("addrs")
        if not (isinstance(round_id, bytes) and type(step) is int and isinstance(digest, bytes)
                and isinstance(members, list) and isinstance(addrs, list) and 0 < len(members) == len(addrs)
                and len(members) <= self.host.limits.max_round_members
                and all(isinstance(p, bytes) for p in members) and all(isinstance(a, str) for a in addrs)):
            raise bad_input("stage.sync.round needs round, step, digest, members and addrs")
        if self.core.peer_id not in members or members != sorted(members):
            raise bad_input("this peer is not a member of that round, or the members are not sorted")
        self._check_caller(req, members[0], "the round's leader")
        owners = _owner_flags(meta.get("owners"), len(members))
        if self._authenticated:
            addrs = [self.core.address if p == self.core.peer_id else self.core.mate_addr(p) for p in members]
            if None in addrs:
                raise busy(f"{addrs.count(None)} of the round's members are no announced mates this peer polled")
        reason = self.core.invited(_now(), members[0], step, digest)
        if reason is not None:
            raise busy(reason)
        self.start(round_id, step, list(zip(members, addrs)), owners)
        return Message({}, codec="none")

    def _check_caller(self, req: Request, member: bytes, what: str) -> None:
        """Round RPCs act for one member (the leader, a part's sender): the connection must have
        proven that member's id. A peer whose pool proves no identity (in-process tests only: a
        daemon always has one) cannot tell its mates apart by id at all; it checks nothing, and
        takes member addresses from the invitation."""
        if self._authenticated and req.peer.peer_id != member:
            raise bad_input(f"the caller has not proven the id of {what}")

    async def _round(self, round_id: bytes, step: int, members: list[tuple[bytes, str]],
                     owners: tuple[bool, ...]) -> None:
        """This member's part of one round: reduce-scatter, plan, all-gather, commit. A failure is
        told to the others (`_round_failed`); whatever happened, what the round took is settled."""
        ids = [p for p, _ in members]
        run = _RoundRun(round_id, step, members, owners, ids.index(self.core.peer_id))
        host, limits = self.host, self.host.limits
        taken = await host.in_aux(host.accumulator.take, step)
        try:
            run.box = box = self.mailbox.box(round_id, step, ids, self.core.peer_id, host.numel, join=True,
                                             owners=owners)
            flat = await host.in_aux(host.flatten, taken.grads)
            mine = Contribution(frozenset(taken.ids), taken.samples)
            rates = [self.rate if p == self.core.peer_id else self.core.rate_of(p) for p in ids]
            reduce_s, gather_s = phase_deadlines(host.numel, limits.allreduce_codec, owners, rates,
                                                 limits.round_timeout_floor_s, limits.round_timeout_s,
                                                 limits.round_time_margin)
            await self._reduce_scatter(run, box, flat, mine, reduce_s)
            prompt, plan = self._covering_plan(run, box)
            await self._all_gather(run, box, plan, gather_s)
            self._check_owners_plans(run, box, plan)
            await self._commit(run, box, prompt, plan)
        except (RoundFailed, TransportError, RpcError, TimeoutError) as exc:
            await self._round_failed(run, exc)
        finally:
            self.mailbox.drop(round_id)
            await asyncio.shield(self._settle(round_id, step, ids, run.late, run.outcome))

    async def _reduce_scatter(self, run: _RoundRun, box: RoundBox, flat: torch.Tensor, mine: Contribution,
                              seconds: float) -> None:
        """Reduce-scatter: every member's copy of this member's shard, until its deadline."""
        lo, hi = box.bounds[run.me]
        box.put_part(run.me, 0, flat[lo:hi], mine)
        head = {"ids": encode_ranges(mine.ids), "samples": mine.samples}
        try:
            async with asyncio.timeout(seconds):
                run.sending = True
                await _unless_failed(box, self._send(run.round_id, run.step, run.members, "stage.sync.reduce",
                                                     self._packer(flat, box), head))
                run.sending = False
                await box.wait(box.reduced_ready)
        except TimeoutError:
            if run.sending:
                raise
            # Late members are left out: the round goes on without them if none owns a shard
            # and the prompt members' sums cover the step (their own plans then differ from
            # every owner's, and they do not commit).
            run.late = [run.ids[i] for i in box.late_members()]
            if any(run.owners[i] for i in box.late_members()):
                raise RoundFailed(f"members {box.late_members()} own shards and were late") from None

    def _covering_plan(self, run: _RoundRun, box: RoundBox) -> tuple[list[int], RoundPlan]:
        """The prompt members and the plan over their sums, which must cover the step."""
        step = run.step
        prompt = box.prompt()
        plan = self._plan(box, prompt, step)
        if not plan.covered:
            if run.me in plan.left_out:
                run.outcome = "left out"
            # The abort names the members the plan left out: one that has not seen every sum
            # yet (a slow member's part still on its way) clears its own all the same, or the
            # same conflict would come back every round.
            run.cleared = plan.left_out
            raise RoundFailed(f"the kept sums of {len(prompt)} prompt members cover {_covered(box, plan)} of "
                              f"{len(self.core.step_ids(step))} microbatches ({len(plan.left_out)} members' "
                              f"sums overlap)")
        box.kept = plan.kept
        return prompt, plan

    async def _all_gather(self, run: _RoundRun, box: RoundBox, plan: RoundPlan, seconds: float) -> None:
        """All-gather: every owner's reduced shard, and its plan, until its deadline."""
        limits = self.host.limits
        reduced, pieces, outliers = await self.host.in_aux(_reduce_shard, box, limits, plan.kept)
        box.put_gather(run.me, 0, reduced, outliers, plan.kept)
        async with asyncio.timeout(seconds):
            if run.owners[run.me]:  # a member that owns no shard has nothing to send: nobody waits for it
                run.sending = True
                await _unless_failed(box, self._send(run.round_id, run.step, run.members, "stage.sync.gather",
                                                     _to_everyone(pieces),
                                                     {"outliers": outliers, "kept": list(plan.kept)}))
                run.sending = False
            await box.wait(box.gathered_ready)

    def _check_owners_plans(self, run: _RoundRun, box: RoundBox, plan: RoundPlan) -> None:
        """Every owner's plan must be this member's, or the round fails here."""
        plans = {box.plans[i] for i in range(len(run.ids)) if run.owners[i]}
        if plans != {plan.kept}:
            # The owners saw other members as prompt. Left out by all of them alike (late
            # here), this member only leaves: they commit, and it downloads their state.
            run.abort = not (len(plans) == 1 and run.me not in next(iter(plans)))
            raise RoundFailed(f"the owners' plans differ from this member's ({sorted(plans)} vs {plan.kept})")

    async def _commit(self, run: _RoundRun, box: RoundBox, prompt: list[int], plan: RoundPlan) -> None:
        """Step on the gathered sum; the late members the round went on without are noted late."""
        host, ids, step = self.host, run.ids, run.step
        flagged = tuple(sorted(ids[i].hex() for i in box.outliers))
        if flagged:
            log.warning("stage %d step %d: outlier gradients from %s", host.stage_index, step, flagged)
        await host.commit(step, run.round_id, box.full, [ids[i] for i in prompt], plan, flagged)
        run.outcome = "committed"
        if run.late:
            self.core.note_late(_now(), run.late)
            log.info("stage %d step %d committed without %d late members", host.stage_index, step, len(run.late))

    async def _round_failed(self, run: _RoundRun, exc: RoundFailed | TransportError | RpcError | TimeoutError) -> None:
        """Record the failure, find the stragglers and this peer's outcome, and tell the others."""
        box = run.box
        self.last_failure = f"step {run.step}: {type(exc).__name__}: {exc}"
        timed_out = isinstance(exc, TimeoutError)
        if timed_out and box is not None and not run.sending:
            run.late = [run.ids[i] for i in box.late_members()]  # stragglers: left out of this peer's next rounds
        log.info("stage %d round %s failed: %s", self.host.stage_index, run.round_id.hex()[:8], exc)
        if box is not None and box.cleared and run.outcome == "failed":
            run.outcome = "left out"  # a mate's plan left this member's sum out (its abort said so)
        if run.abort:  # only a deadline makes a member leave: a plan that cannot commit fails on every member
            # Timed out while its own parts were still leaving: this peer is the straggler, and says so.
            straggler = timed_out and run.sending
            await self._abort(run.round_id, [m for m in run.members if m[0] != self.core.peer_id], straggler,
                              leaving=timed_out, cleared=run.cleared)

    def _plan(self, box: RoundBox, prompt: list[int], step: int) -> RoundPlan:
        """The round's plan over the `prompt` members' sums, in member indices."""
        contributions = [(box.contributions[i].ids, box.contributions[i].samples) for i in prompt]
        if self.host.limits.aggregate == CENTERED_CLIP:
            plan = every_member(contributions, self.core.step_ids(step))
        else:
            plan = plan_round(contributions, self.core.step_ids(step))
        return RoundPlan(tuple(prompt[k] for k in plan.kept), tuple(prompt[k] for k in plan.left_out), plan.covered,
                         plan.samples)

    async def _settle(self, round_id: bytes, step: int, ids: list[bytes], late: list[bytes], outcome: str) -> None:
        """Put back (or, left out of a conflicting round, clear) what the round took, and tell the core."""
        host = self.host
        try:
            if outcome == "left out":
                dropped = await host.in_aux(host.accumulator.discard_taken, step)
                self.core.left_out(step, dropped)
                log.info("stage %d step %d: this peer's sum overlapped a kept member's; %d microbatches "
                         "cleared for re-sending", host.stage_index, step, len(dropped))
            elif outcome != "committed":
                await host.in_aux(host.accumulator.restore, step)
        finally:
            if outcome != "committed":
                self.core.round_failed(_now(), round_id, ids[0], late)

    def _packer(self, flat: torch.Tensor, box: RoundBox) -> Callable[[int], AsyncIterator[Piece]]:
        """Member j's copy of its shard, packed for the wire one piece at a time, as it leaves (so
        no more than a piece per member is held packed), in the auxiliary thread (scaling and
        rounding are a pass over the piece: not on the event loop)."""
        limits = self.host.limits
        per, codec = _piece_elements(limits), limits.allreduce_codec

        async def packed(j: int) -> AsyncIterator[Piece]:
            lo, hi = box.bounds[j]
            for offset in range(0, max(hi - lo, 1), per):
                yield await self.host.in_aux(pack, offset, flat[lo + offset: min(hi, lo + offset + per)], codec)

        return packed

    async def _send(self, round_id: bytes, step: int, members: list[tuple[bytes, str]], method: str,
                    payload: Callable[[int], AsyncIterator[Piece]], head: dict) -> None:
        """Send every other member j its part, `payload(j)`'s pieces, one message each in order."""
        me = [p for p, _ in members].index(self.core.peer_id)
        box = self.mailbox.get(round_id)
        owners = box.owners if box is not None else (True,) * len(members)
        meta = {**self.host.meta(), "protocol": ROUND_PROTOCOL, "round": round_id, "step": step,
                "members": [p for p, _ in members], "src": me, "owners": _indices(owners)}
        codec = message_codec(self.host.limits.allreduce_codec)

        async def to(j: int, addr: str) -> None:
            async for piece in payload(j):
                extra = head if piece.offset == 0 else {}
                message = Message({**meta, **extra, **piece.meta()}, [piece.tensor], codec=codec)
                began = time.perf_counter()
                await self.host.pool.call(addr, method, message, timeout=self.host.limits.round_timeout_s)
                self._measure(piece.wire_bytes, time.perf_counter() - began)

        try:
            async with asyncio.TaskGroup() as group:
                for j, (_, addr) in enumerate(members):
                    if j != me:
                        group.create_task(to(j, addr))
        except* (TransportError, RpcError) as failed:
            first = failed.exceptions[0]
            raise RoundFailed(f"{method} to a member failed: {type(first).__name__}: {first}") from None

    def _measure(self, sent: int, seconds: float) -> None:
        """Fold one part's send into the rate estimate (tiny parts say nothing about a link)."""
        if sent < MIN_MEASURED_BYTES:
            return
        rate = sent / max(seconds, 1e-6)
        self.rate = rate if self.rate == 0.0 else (1 - RATE_EMA) * self.rate + RATE_EMA * rate

    async def _abort(self, round_id: bytes, others: list[tuple[bytes, str]], straggler: bool = False,
                     leaving: bool = False, cleared: tuple[int, ...] = ()) -> None:
        """Tell the others the round is over here: `leaving` at a deadline (a member that owns no
        shard then only leaves it); `cleared`: the members this peer's plan left out."""
        # Closed here first: parts members already sent must not open a box for it (allreduce.Mailbox).
        self.mailbox.drop(round_id, "this peer aborted the round")
        meta = {**self.host.meta(), "round": round_id, "member": self.core.peer_id, "leaving": leaving,
                "left_out": list(cleared)}
        if straggler:
            meta["straggler"] = self.core.peer_id
        message = Message(meta, codec="none")
        await asyncio.gather(*(self.host.pool.call(a, "stage.sync.abort", message,
                                                   timeout=self.host.limits.progress_timeout_s) for _, a in others),
                             return_exceptions=True)

    # ------------------------------------------------------------------------ mate handlers

    def receive(self, req: Request, gather: bool) -> Message:
        meta = req.meta
        _check_protocol(meta, "all-reduce part")
        round_id, step, members, src, offset = (meta.get(k) for k in ("round", "step", "members", "src", "offset"))
        if not (isinstance(round_id, bytes) and type(step) is int and isinstance(members, list)
                and len(members) <= self.host.limits.max_round_members
                and all(isinstance(p, bytes) for p in members) and type(src) is int
                and 0 <= src < len(members) and type(offset) is int and len(req.tensors) == 1):
            raise bad_input("an all-reduce part needs round, step, members, src, offset and one tensor")
        self._check_caller(req, members[src], f"member {src} of the round")  # before a box is opened for it
        if step != self.core.step:
            raise busy(f"part for step {step}, this peer is at step {self.core.step}")
        owners = _owner_flags(meta.get("owners"), len(members))
        part = unpack(req.tensors[0], meta.get("exp"))
        box = self.mailbox.box(round_id, step, members, self.core.peer_id, self.host.numel, owners=owners)
        if gather:
            outliers, kept = (meta.get("outliers", []), meta.get("kept")) if offset == 0 else ([], None)
            if not (isinstance(outliers, list) and all(type(i) is int for i in outliers)):
                raise bad_input("outliers must be a list of member indices")
            if offset == 0 and not (isinstance(kept, list) and all(type(i) is int for i in kept)):
                raise bad_input("the first gathered part carries the plan's kept members")
            box.put_gather(src, offset, part, outliers, kept)
        else:
            contribution = None
            if offset == 0:
                samples = meta.get("samples")
                try:
                    ids = decode_ranges(meta.get("ids"), self.core.step_ids(step))
                except ValueError as exc:
                    raise bad_input(f"the first part's ids: {exc}") from None
                if type(samples) is not int or samples < 0:
                    raise bad_input("the first part carries the sender's ids and samples")
                contribution = Contribution(ids, samples)
            box.put_part(src, offset, part, contribution)
        return Message({}, codec="none")

    def abort(self, req: Request) -> Message:
        """`stage.sync.abort {round, member, leaving, left_out}`: a member left the round. At its
        deadline (`leaving`), one that owns no shard and whose sum this peer has not planned to add
        only leaves (the others may still commit); otherwise the round fails here, and the members
        whose parts this peer still lacks count as late here too. A member named in `left_out` (the
        sender's plan left its sum out) clears its sum. One that timed out while its own parts
        were still leaving names itself (`straggler`): it is benched here like a late member (it
        can only bench itself, and only in rounds it is a member of here). Only a member of the
        round may abort it (the connection's proven id; a round this peer has no box for yet is
        closed for whoever proved an id: its id is random, so only a member knows it)."""
        meta = req.meta
        round_id, member, straggler = meta.get("round"), meta.get("member"), meta.get("straggler")
        if not isinstance(round_id, bytes):
            return Message({}, codec="none")
        if self._authenticated and req.peer.peer_id is None:
            raise bad_input("an abort needs a caller with a proven id")
        box = self.mailbox.get(round_id)
        if box is not None and isinstance(member, bytes) and member in box.members:
            self._check_caller(req, member, "the member it names")
            if straggler == member:
                self.core.note_late(_now(), [member])
            sender = box.members.index(member)
            if box.joined and meta.get("leaving") is True:
                if box.withdraw(sender):  # it owns no shard and no planned sum: it only leaves
                    return Message({}, codec="none")
                # It left at its deadline: what is still missing here is late here too (else a
                # member whose abort comes first leaves the leader benching nobody).
                self.core.note_late(_now(), [box.members[i] for i in box.late_members() if i != sender])
            left_out = meta.get("left_out")
            if isinstance(left_out, list) and box.me in left_out:
                # Its plan left this member's sum out (an overlap): cleared as if it had seen all
                # the sums itself (a member could as well have sent an overlapping sum; no more).
                box.cleared = True
        elif box is not None and self._authenticated:
            raise bad_input("the caller is not a member of that round")
        self.mailbox.drop(round_id, "a member aborted the round")
        return Message({}, codec="none")


def _indices(flags: tuple[bool, ...]) -> list[int]:
    return [i for i, f in enumerate(flags) if f]


def _owner_flags(owners: Any, members: int) -> tuple[bool, ...]:
    """A round's owners from the wire (member indices; absent: every member owns a shard)."""
    if owners is None:
        return (True,) * members
    if not (isinstance(owners, list) and all(type(i) is int and 0 <= i < members for i in owners)
            and owners == sorted(set(owners)) and owners):
        raise bad_input("owners must be a non-empty sorted list of member indices")
    return tuple(i in owners for i in range(members))


def _poll_outcome(poll: asyncio.Task, stage: int) -> None:
    """A finished poll's outcome: a mate's transport trouble is only logged, anything else raised."""
    if poll.cancelled():
        return
    exc = poll.exception()
    if isinstance(exc, (TransportError, RpcError, TimeoutError)):
        log.debug("stage %d sync poll: %s", stage, exc)
    elif exc is not None:
        raise exc


def _now() -> float:
    return asyncio.get_running_loop().time()


def _covered(box: RoundBox, plan: RoundPlan) -> int:
    return sum(len(box.contributions[i].ids) for i in plan.kept)


async def _unless_failed(box: RoundBox, sending: Coroutine) -> None:
    """Send a round's parts, but give up as soon as the round fails meanwhile (a member aborted
    it): a send to a hung member would otherwise hold this peer in a dead round, refusing every
    other round of its stage, for up to round_timeout_s."""
    try:
        async with asyncio.TaskGroup() as group:
            sent = group.create_task(sending)
            sent.add_done_callback(lambda _: box.changed.set())
            group.create_task(box.wait(sent.done))
    except* RoundFailed as failed:
        raise failed.exceptions[0] from None


def _reduce_shard(box: RoundBox, limits: StageLimits,
                  kept: tuple[int, ...]) -> tuple[torch.Tensor, list[Piece], list[int]]:
    """This member's shard of the step's gradient sum over the kept members, the pieces that carry
    it to the others, and the members it found outliers. `mean` sums in member order, the same on
    every peer: the reduced shard is then one well-defined value. With a lossy codec the owner
    keeps what its mates will decode (`packing.round_trip`), not its exact sum, so every member
    steps on bit-identical gradients (I2). A round of one sends nothing and rounds nothing."""
    outliers: list[int] = []
    if limits.aggregate == CENTERED_CLIP:
        robust = centered_clip([box.parts[i] for i in kept], [box.contributions[i].samples for i in kept],
                               box.numel, limits.clip_tau, limits.clip_iterations, limits.outlier_factor)
        total, outliers = robust.total, sorted(kept[i] for i in robust.outliers)
    else:
        total = box.parts[kept[0]].clone()
        for src in kept[1:]:
            total += box.parts[src]
    if len(box.members) == 1:
        return total, [], outliers
    reduced, pieces = round_trip(total, _piece_elements(limits), limits.allreduce_codec)
    return reduced, pieces, outliers


def _to_everyone(pieces: list[Piece]) -> Callable[[int], AsyncIterator[Piece]]:
    """The all-gather's payload: the owner's packed shard (packed whole: the owner keeps what it
    unpacks to), the same pieces for every member."""
    async def same(j: int) -> AsyncIterator[Piece]:
        for piece in pieces:
            yield piece

    return same


def _piece_elements(limits: StageLimits) -> int:
    """Elements in one all-reduce message: allreduce_chunk_bytes counted as fp32, whatever the codec
    (an fp16 piece is then half of it)."""
    return max(1, limits.allreduce_chunk_bytes // 4)


class ProtocolMismatch(PeerError, ValueError):
    """A mate's progress shows a round protocol other than this peer's (a ValueError like the
    other malformed progress replies `poll` sets aside)."""

    def __init__(self, peer_id: bytes, addr: str, protocol: Any) -> None:
        super().__init__(f"mate {peer_id.hex()[:8]} at {addr} speaks round protocol {protocol!r}, "
                         f"this peer {ROUND_PROTOCOL}")


def _check_protocol(meta: dict, what: str) -> None:
    """Refuse a round RPC of another round protocol (none given: version 1) with its own code."""
    protocol = meta.get("protocol", UNVERSIONED)
    if protocol != ROUND_PROTOCOL:
        raise protocol_mismatch(f"{what} of round protocol {protocol!r}; this peer speaks {ROUND_PROTOCOL}")
