"""Stage-mates agree on each optimizer step: progress exchange, who leads a round, and the round.

Every peer polls its mates' progress (`stage.sync.progress`: committed step and the microbatch ids
it holds gradients for). When the union over live mates at the same step covers every microbatch
of the step, the member with the smallest peer id leads: it asks every member to join a round
(`stage.sync.round`, carrying the sorted member list) and all of them, including mates that hold
no gradient at all, run the butterfly all-reduce and take the same optimizer step. A mate that
vanishes mid-round makes the round fail on every member (its parts never come; failing members
tell the others with `stage.sync.abort`, and stop sending at once); each puts back what it took,
refuses the round's late parts from then on (allreduce.Mailbox), and the next poll starts again
with whoever is left, reporting ids nobody live holds as `missing` so trainers re-send them.
A peer that finds a mate ahead of it downloads that mate's state instead (it missed a commit).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from swarmd.stage.allreduce import Contribution, Mailbox, RoundBox
from swarmd.stage.errors import RoundFailed, bad_input, busy
from swarmd.stage.robust import CENTERED_CLIP, centered_clip
from transport.codecs import decode_tensor, encode_tensor
from transport.errors import DeadlineExceeded, RpcError, TransportError
from transport.rpc import Message, Request

if TYPE_CHECKING:
    from swarmd.stage.service import StageService

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MateView:
    peer_id: bytes
    addr: str
    step: int
    state: str
    ids: frozenset[int]


class StageSync:
    def __init__(self, service: "StageService") -> None:
        self.s = service
        # A join lags its round's first part by at most the leader's join call (progress_timeout_s);
        # twice that before a box nobody joined here counts as an orphan.
        self.mailbox = Mailbox(service.limits.max_open_rounds, service.limits.round_timeout_s,
                               2 * service.limits.progress_timeout_s, service.limits.closed_rounds_kept)
        self.in_round = False
        self.missing: list[int] = []  # ids some live peer once held for this step, none holds now
        self.uncovered: list[int] = []  # ids of this step no live peer holds
        self.last_failure: str | None = None
        self._seen: set[int] = set()
        self._seen_step = -1
        self._known: dict[bytes, MateView] = {}  # each mate's last progress answer
        self._slow: dict[bytes, float] = {}  # mates whose progress calls time out, since when

    # ----------------------------------------------------------------------------- polling

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.s.limits.sync_interval_s)
            try:
                await self.tick()
            except (TransportError, RpcError, TimeoutError) as exc:
                log.debug("stage %d sync: %s", self.s.stage_index, exc)

    async def tick(self) -> None:
        mates = await self.poll()
        if self.s.state != "serving" or self.in_round:
            return
        committed = self.s.committed
        ahead = sorted((m for m in mates if m.step > committed and m.state == "serving"), key=lambda m: -m.step)
        if ahead:
            await self.s.catch_up([(m.peer_id, m.addr) for m in ahead])
            return
        same = [m for m in mates if m.step == committed and m.state == "serving"]
        union = set(self.s.accumulator.progress(committed).ids)
        for m in same:
            union |= m.ids
        self._coverage(committed, union)
        members = sorted([(self.s.peer_id, self.s.address)] + [(m.peer_id, m.addr) for m in same])
        if not self.uncovered and members[0][0] == self.s.peer_id:
            await self.lead(committed, members)

    async def poll(self) -> list[MateView]:
        peers = await self.s.directory.peers(self.s.job_id, self.s.stage_index)
        mates = [p for p in peers if p.peer_id != self.s.peer_id]
        results = await asyncio.gather(*(self._progress(p.peer_id, p.addr) for p in mates), return_exceptions=True)
        views = []
        now = asyncio.get_running_loop().time()
        for mate, result in zip(mates, results):
            if isinstance(result, MateView):
                views.append(result)
                self._slow.pop(mate.peer_id, None)
                self._known[mate.peer_id] = result
            elif isinstance(result, DeadlineExceeded):
                self._slow.setdefault(mate.peer_id, now)  # alive but slow, maybe: see `_held_by_slow`
            elif isinstance(result, (TransportError, RpcError, TimeoutError, ValueError)):
                self._slow.pop(mate.peer_id, None)  # refused or gone: what it held is lost
                self._known.pop(mate.peer_id, None)
            else:
                raise result
        for gone in set(self._known) - {m.peer_id for m in mates}:
            self._known.pop(gone)
            self._slow.pop(gone, None)
        return views

    def mate_ahead(self) -> bool:
        """Did a serving mate, at the last poll, show more committed steps than this peer? (Then
        `tick` downloads its state; it is the cached answer, so asking costs no call.)"""
        return any(m.state == "serving" and m.step > self.s.committed for m in self._known.values())

    def mate_slow(self) -> bool:
        """Did a mate's progress call time out (rather than be refused) at the last poll? It may be
        alive and ahead of us; only its answer would say."""
        return bool(self._slow)

    async def _progress(self, peer_id: bytes, addr: str) -> MateView:
        reply = await self.s.pool.call(addr, "stage.sync.progress", Message(self.s.meta(), codec="none"),
                                       timeout=self.s.limits.progress_timeout_s)
        meta = reply.meta
        step, state, ids = meta.get("step"), meta.get("state"), meta.get("ids")
        if (meta.get("peer_id") != peer_id or type(step) is not int or not isinstance(state, str)
                or not isinstance(ids, list) or not all(type(i) is int for i in ids)):
            raise ValueError(f"bad progress reply from {addr}")
        return MateView(peer_id, addr, step, state, frozenset(ids))

    def progress_reply(self) -> Message:
        committed = self.s.committed
        progress = self.s.accumulator.progress(committed)
        return Message({"peer_id": self.s.peer_id, "step": committed, "state": self.s.state,
                        "ids": sorted(progress.ids), "samples": progress.samples, "in_round": self.in_round},
                       codec="none")

    def _coverage(self, step: int, union: set[int]) -> None:
        if step != self._seen_step:
            self._seen, self._seen_step = set(), step
        self._seen |= union
        self.missing = sorted(self._seen - union - self._held_by_slow(step))
        self.uncovered = sorted(set(self.s.step_ids(step)) - union)

    def _held_by_slow(self, step: int) -> set[int]:
        """Ids last reported by mates that now time out rather than refuse, for `missing_grace_s`:
        a loaded peer still holds its gradients, and re-sending them elsewhere would count them twice."""
        now = asyncio.get_running_loop().time()
        held: set[int] = set()
        for peer_id, since in self._slow.items():
            known = self._known.get(peer_id)
            if known is not None and known.step == step and now - since < self.s.limits.missing_grace_s:
                held |= known.ids
        return held

    # ----------------------------------------------------------------------------- rounds

    async def lead(self, step: int, members: list[tuple[bytes, str]]) -> None:
        round_id = os.urandom(16)
        meta = {**self.s.meta(), "step": step, "round": round_id,
                "members": [p for p, _ in members], "addrs": [a for _, a in members]}
        others = [(p, a) for p, a in members if p != self.s.peer_id]
        calls = [self.s.pool.call(a, "stage.sync.round", Message(meta, codec="none"),
                                  timeout=self.s.limits.progress_timeout_s) for _, a in others]
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for r in failed:
                if not isinstance(r, (TransportError, RpcError, TimeoutError)):
                    raise r
            await self._abort(round_id, others)
            return
        try:
            self.start(round_id, step, members)
        except RpcError:  # a competing leader's round got here first, or we stepped meanwhile
            await self._abort(round_id, others)
            raise

    def start(self, round_id: bytes, step: int, members: list[tuple[bytes, str]]) -> None:
        if self.in_round:
            raise busy("this peer is already in an all-reduce round")
        if step != self.s.committed:
            raise busy(f"round for step {step}, this peer is at step {self.s.committed}")
        # Opened (or marked joined) now, so a closed round or a full mailbox refuses the join itself.
        self.mailbox.box(round_id, step, [p for p, _ in members], self.s.peer_id, self.s.numel, join=True)
        self.in_round = True
        try:
            self.s.spawn(self._round(round_id, step, members), f"round {round_id.hex()[:8]}")
        except BaseException:
            self.in_round = False
            raise

    def join(self, req: Request) -> Message:
        """`stage.sync.round` from a leader."""
        meta = req.meta
        round_id, step, members, addrs = meta.get("round"), meta.get("step"), meta.get("members"), meta.get("addrs")
        if not (isinstance(round_id, bytes) and type(step) is int and isinstance(members, list)
                and isinstance(addrs, list) and len(members) == len(addrs)
                and all(isinstance(p, bytes) for p in members) and all(isinstance(a, str) for a in addrs)):
            raise bad_input("stage.sync.round needs round, step, members and addrs")
        if self.s.peer_id not in members:
            raise bad_input("this peer is not a member of that round")
        self.start(round_id, step, list(zip(members, addrs)))
        return Message({}, codec="none")

    async def _round(self, round_id: bytes, step: int, members: list[tuple[bytes, str]]) -> None:
        ids = [p for p, _ in members]
        me = ids.index(self.s.peer_id)
        taken = await self.s.in_aux(self.s.accumulator.take, step)
        committed = False
        try:
            box = self.mailbox.box(round_id, step, ids, self.s.peer_id, self.s.numel, join=True)
            flat = await self.s.in_aux(self.s.flatten, taken.grads)
            mine = Contribution(frozenset(taken.ids), taken.samples)
            async with asyncio.timeout(self.s.limits.round_timeout_s):
                lo, hi = box.bounds[me]
                box.put_part(me, 0, flat[lo:hi], mine)
                head = {"ids": sorted(mine.ids), "samples": mine.samples}
                await _unless_failed(box, self._send(round_id, step, members, "stage.sync.reduce",
                                                     lambda j: flat[box.bounds[j][0]:box.bounds[j][1]], head))
                await box.wait(box.reduced_ready)
                reduced, outliers = await self.s.in_aux(_reduce_shard, box, self.s.limits, self.s.numel)
                union = frozenset().union(*(c.ids for c in box.contributions.values()))
                if union != frozenset(self.s.step_ids(step)):
                    raise RoundFailed(f"the round covers {len(union)} of {self.s.microbatches} microbatches")
                box.put_gather(me, 0, reduced, outliers)
                await _unless_failed(box, self._send(round_id, step, members, "stage.sync.gather",
                                                     lambda j: reduced, {"outliers": outliers}))
                await box.wait(box.gathered_ready)
            summed_twice = sum(len(c.ids) for c in box.contributions.values()) - len(union)
            samples = sum(c.samples for c in box.contributions.values())
            flagged = tuple(sorted(ids[i].hex() for i in box.outliers))
            if flagged:
                log.warning("stage %d step %d: outlier gradients from %s", self.s.stage_index, step, flagged)
            await self.s.commit(step, box.full, len(members), samples, summed_twice, flagged)
            committed = True
        except (RoundFailed, TransportError, RpcError, TimeoutError) as exc:
            self.last_failure = f"step {step}: {type(exc).__name__}: {exc}"
            log.info("stage %d round %s failed: %s", self.s.stage_index, round_id.hex()[:8], exc)
            await self._abort(round_id, [m for m in members if m[0] != self.s.peer_id])
        finally:
            self.mailbox.drop(round_id)
            try:
                if not committed:
                    await asyncio.shield(self.s.in_aux(self.s.accumulator.restore, step))
            finally:
                self.in_round = False

    async def _send(self, round_id: bytes, step: int, members: list[tuple[bytes, str]], method: str,
                    payload, head: dict) -> None:
        me = [p for p, _ in members].index(self.s.peer_id)
        meta = {**self.s.meta(), "round": round_id, "step": step, "members": [p for p, _ in members], "src": me}
        per = max(1, self.s.limits.allreduce_chunk_bytes // 4)

        async def to(j: int, addr: str) -> None:
            part = payload(j)
            for offset in range(0, max(part.numel(), 1), per):
                extra = head if offset == 0 else {}
                message = Message({**meta, **extra, "offset": offset}, [part[offset: offset + per]],
                                  codec=self.s.limits.allreduce_codec)
                await self.s.pool.call(addr, method, message, timeout=self.s.limits.round_timeout_s)

        try:
            async with asyncio.TaskGroup() as group:
                for j, (_, addr) in enumerate(members):
                    if j != me:
                        group.create_task(to(j, addr))
        except* (TransportError, RpcError) as failed:
            first = failed.exceptions[0]
            raise RoundFailed(f"{method} to a member failed: {type(first).__name__}: {first}") from None

    async def _abort(self, round_id: bytes, others: list[tuple[bytes, str]]) -> None:
        # Closed here first: parts members already sent must not open a box for it (allreduce.Mailbox).
        self.mailbox.drop(round_id, "this peer aborted the round")
        message = Message({**self.s.meta(), "round": round_id}, codec="none")
        await asyncio.gather(*(self.s.pool.call(a, "stage.sync.abort", message,
                                                timeout=self.s.limits.progress_timeout_s) for _, a in others),
                             return_exceptions=True)

    # ------------------------------------------------------------------------ mate handlers

    def receive(self, req: Request, gather: bool) -> Message:
        meta = req.meta
        round_id, step, members, src, offset = (meta.get(k) for k in ("round", "step", "members", "src", "offset"))
        if not (isinstance(round_id, bytes) and type(step) is int and isinstance(members, list)
                and all(isinstance(p, bytes) for p in members) and type(src) is int
                and 0 <= src < len(members) and type(offset) is int and len(req.tensors) == 1):
            raise bad_input("an all-reduce part needs round, step, members, src, offset and one tensor")
        if step != self.s.committed:
            raise busy(f"part for step {step}, this peer is at step {self.s.committed}")
        box = self.mailbox.box(round_id, step, members, self.s.peer_id, self.s.numel)
        if gather:
            outliers = meta.get("outliers", []) if offset == 0 else []
            if not (isinstance(outliers, list) and all(type(i) is int for i in outliers)):
                raise bad_input("outliers must be a list of member indices")
            box.put_gather(src, offset, req.tensors[0], outliers)
        else:
            contribution = None
            if offset == 0:
                ids, samples = meta.get("ids"), meta.get("samples")
                if not (isinstance(ids, list) and all(type(i) is int for i in ids) and type(samples) is int):
                    raise bad_input("the first part carries the sender's ids and samples")
                contribution = Contribution(frozenset(ids), samples)
            box.put_part(src, offset, req.tensors[0], contribution)
        return Message({}, codec="none")

    def abort(self, req: Request) -> Message:
        round_id = req.meta.get("round")
        if isinstance(round_id, bytes):
            self.mailbox.drop(round_id, "a member aborted the round")
        return Message({}, codec="none")


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


def _reduce_shard(box, limits, numel: int) -> tuple[torch.Tensor, list[int]]:
    """This member's shard of the step's gradient sum, and the members it found outliers.
    `mean` sums in member order, the same on every peer: the reduced shard is then one
    well-defined value. With a lossy codec the owner keeps the value its mates will decode, not
    its exact sum, so every member steps on bit-identical gradients."""
    outliers: list[int] = []
    if limits.aggregate == CENTERED_CLIP:
        members = range(len(box.members))
        robust = centered_clip([box.parts[i] for i in members], [box.contributions[i].samples for i in members],
                               numel, limits.clip_tau, limits.clip_iterations, limits.outlier_factor)
        total, outliers = robust.total, sorted(robust.outliers)
    else:
        total = box.parts[0].clone()
        for src in range(1, len(box.members)):
            total += box.parts[src]
    codec = limits.allreduce_codec
    if codec == "none":
        return total, outliers
    meta, buffers = encode_tensor(total, codec)
    return decode_tensor(meta, [bytes(b) for b in buffers]), outliers
