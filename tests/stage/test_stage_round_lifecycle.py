"""The life of an all-reduce round on one peer's mailbox, over real loopback sockets: a round that
closed (aborted, failed, finished) stays closed, so parts that arrive late for it cannot open boxes
nobody closes, and a round a member aborted stops sending at once instead of waiting out a hung
mate. These are the failures behind a stage stuck at one step with `busy: 2 all-reduce rounds
already open (max_open_rounds)`."""

from __future__ import annotations

import asyncio
import os

import torch

from swarmd.stage.core import initial_digest
from swarmd.directory import StagePeer, StaticDirectory
from swarmd.stage import StageLimits
from swarmd.stage.sync import ROUND_PROTOCOL
from transport.rpc import Message, Pool, Request, Router, RpcServer

B, T, C = 2, 16, 32
STAGE = 1
MATE = b"\xff" * 32  # a stage-mate played by the test; sorts after every test peer


def part_meta(kit, round_id, members, offset=0, step=0):
    return {**kit.meta(STAGE), "protocol": ROUND_PROTOCOL, "round": round_id, "step": step, "members": members,
            "src": members.index(MATE), "offset": offset, "ids": [[0, 1]], "samples": B}


async def test_late_parts_of_closed_rounds_cannot_fill_the_mailbox(kit, client):
    """Steps: for two rounds, a mate sends the first part, then aborts the round, then a late part
    of it arrives (another member's part, sent before it saw the abort); for a third round the abort
    overtakes every part. Then a fresh round's first part comes.
    Expected: every late part is refused `busy` (the round is closed here) and the fresh round is
    accepted: with max_open_rounds=2, two orphan boxes would otherwise refuse it, and every round
    after it, until they expired."""
    spec = kit.make_spec(stages=3)
    peer = await kit.start_peer(spec, STAGE, 1, StaticDirectory(),
                                StageLimits(max_open_rounds=2, sync_interval_s=60.0, progress_timeout_s=60.0))
    members = sorted([peer.service.peer_id, MATE])
    part = [torch.zeros(1)]
    try:
        late = []
        for _ in range(2):
            rid = os.urandom(16)
            assert await kit.code_of(client, peer.addr, "stage.sync.reduce", part_meta(kit, rid, members), part) == "ok"
            assert await kit.code_of(client, peer.addr, "stage.sync.abort", {**kit.meta(STAGE), "round": rid}) == "ok"
            late.append(await kit.code_of(client, peer.addr, "stage.sync.reduce",
                                      part_meta(kit, rid, members, offset=1), part))
        overtaken = os.urandom(16)
        assert await kit.code_of(client, peer.addr, "stage.sync.abort", {**kit.meta(STAGE), "round": overtaken}) == "ok"
        late.append(await kit.code_of(client, peer.addr, "stage.sync.reduce", part_meta(kit, overtaken, members), part))
        assert late == ["busy", "busy", "busy"]
        assert peer.service.sync.mailbox.open_rounds == 0
        fresh = await kit.code_of(client, peer.addr, "stage.sync.reduce", part_meta(kit, os.urandom(16), members), part)
        assert fresh == "ok"
    finally:
        await peer.close()


async def test_boxes_of_rounds_never_joined_here_make_room(kit, client):
    """Steps: a mate sends first parts of two rounds (max_open_rounds=2) and neither round is ever
    joined here nor aborted (the leader's abort never arrived); a third round's part comes after
    twice progress_timeout_s (0.2 s here; the test waits 0.6 s): a join lags its round's first part
    by at most the leader's join call, which times out after progress_timeout_s.
    Expected: the third round is accepted and the two orphans are gone."""
    spec = kit.make_spec(stages=3)
    peer = await kit.start_peer(spec, STAGE, 1, StaticDirectory(),
                                StageLimits(max_open_rounds=2, sync_interval_s=60.0, progress_timeout_s=0.2))
    members = sorted([peer.service.peer_id, MATE])
    part = [torch.zeros(1)]
    try:
        for _ in range(2):
            assert await kit.code_of(client, peer.addr, "stage.sync.reduce",
                                 part_meta(kit, os.urandom(16), members), part) == "ok"
        await asyncio.sleep(0.6)
        assert await kit.code_of(client, peer.addr, "stage.sync.reduce",
                             part_meta(kit, os.urandom(16), members), part) == "ok"
        assert peer.service.sync.mailbox.open_rounds == 1
    finally:
        await peer.close()


async def test_a_committed_step_frees_the_boxes_of_its_rounds(kit, client):
    """Steps: a mate opens two boxes for step 0 on a lone peer (first parts of two rounds that never
    finish; max_open_rounds=3 leaves room for the peer's own), then the peer commits step 0 with the
    whole step's microbatches held by itself alone.
    Expected: once step 0 is committed no box of it is left open (each holds a gradient-sized buffer)."""
    spec = kit.make_spec(stages=3)
    directory = StaticDirectory()
    # progress_timeout_s long, so only the commit can free the mate's boxes (not the never-joined rule).
    peer = await kit.start_peer(spec, STAGE, 1, directory, StageLimits(
        max_open_rounds=3, sync_interval_s=0.02, progress_timeout_s=60.0, round_timeout_s=60.0))
    members = sorted([peer.service.peer_id, MATE])
    try:
        for _ in range(2):
            meta = part_meta(kit, os.urandom(16), members)
            assert await kit.code_of(client, peer.addr, "stage.sync.reduce", meta, [torch.zeros(1)]) == "ok"
        assert peer.service.sync.mailbox.open_rounds == 2
        for m in range(spec.batch.microbatches_per_step):
            g = torch.Generator().manual_seed(m)
            await kit.call(client, peer, "stage.backward", STAGE, 0, m,
                           [torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)])
        async with asyncio.timeout(30):
            while not peer.service.records:  # the record lands after the commit's bookkeeping
                await asyncio.sleep(0.02)
        assert peer.service.sync.mailbox.open_rounds == 0
    finally:
        await peer.close()


class HungMate:
    """A stage-mate that reports holding every microbatch of step 0 but the first, accepts the
    round, and then never answers a part (as a SIGSTOPped process would not)."""

    def __init__(self, spec) -> None:
        self.spec = spec
        self.rounds: list[bytes] = []
        self.joined = asyncio.Event()
        self.router = Router()
        self.router.unary("stage.sync.progress", self.progress)
        self.router.unary("stage.sync.round", self.round)
        self.router.unary("stage.sync.reduce", self.hang)
        self.router.unary("stage.sync.gather", self.hang)
        self.router.unary("stage.sync.abort", self.ok)

    async def progress(self, req: Request) -> Message:
        n = self.spec.batch.microbatches_per_step
        return Message({"peer_id": MATE, "step": 0, "state": "serving", "held": [[1, n]], "claimed": [],
                        "digest": initial_digest(self.spec.seed, STAGE), "samples": B * (n - 1), "in_round": False,
                        "protocol": ROUND_PROTOCOL},
                       codec="none")

    async def round(self, req: Request) -> Message:
        self.rounds.append(req.meta["round"])
        self.joined.set()
        return Message({}, codec="none")

    async def hang(self, req: Request) -> Message:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def ok(self, req: Request) -> Message:
        return Message({}, codec="none")


async def test_an_aborted_round_stops_sending_to_a_hung_mate(kit, client):
    """Steps: a real peer and a hung mate (it accepts the round, then never answers a part) form a
    stage; the real peer gets microbatch 0 (the mate holds the others), leads a round (it has the
    smaller id) and blocks sending its part to the mate; the test aborts that round on the real
    peer, as another member would.
    Expected: the real peer leaves the round at once, long before its round_timeout_s (600 s here;
    the test gives up after 30), and puts its gradient back (microbatch 0 is held again)."""
    spec = kit.make_spec(stages=3)
    mate = HungMate(spec)
    rpc = await RpcServer.serve_tcp(mate.router, "127.0.0.1", 0)
    pool = Pool()
    directory = StaticDirectory()
    directory.set(kit.JOB, STAGE, [StagePeer(MATE, f"{rpc.address[0]}:{rpc.address[1]}", STAGE)])
    limits = StageLimits(sync_interval_s=0.05, progress_timeout_s=1.0, round_timeout_s=600.0)
    peer = await kit.start_peer(spec, STAGE, 1, directory, limits)
    try:
        async with asyncio.timeout(30):
            g = torch.Generator().manual_seed(0)
            await kit.call(client, peer, "stage.backward", STAGE, 0, 0,
                           [torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)])
            await mate.joined.wait()
            while not peer.service.sync.in_round:
                await asyncio.sleep(0.01)
            directory.set(kit.JOB, STAGE, [])  # no new round with the mate once this one is over
            await pool.call(peer.addr, "stage.sync.abort", Message({**kit.meta(STAGE), "round": mate.rounds[0]},
                                                                   codec="none"), timeout=5)
            while peer.service.sync.in_round:
                await asyncio.sleep(0.01)
        assert "aborted" in (peer.service.sync.last_failure or "")
        assert peer.service.committed == 0 and peer.service.accumulator.progress(0).ids == {0}
    finally:
        await peer.close()
        await pool.close()
        await rpc.close()
