"""Progress lies: a peer that claims a step it never reached, to make honest peers and trainers act
on it ("catch-up poisoning" and its relatives), and a stranger that takes the waiting slots.

- R2 (closed in swarmd/stage/core.py): a lone mate claiming a far higher step was downloaded from
  at once, even while another mate at this peer's step agreed with it and no trainer ever asked for
  a later step: the liar's state replaced the honest one.
- R3: one peer's `stage.info` step is believed over its mates': the trainer counts the stage
  committed and stops re-sending; one answer from another stage is the only evidence a lone stage
  peer needs to jump ahead, losing every step between (a stranger sends the call for the far step
  itself). Stage side closed (swarmd/stage/resume.py, `StageService._resume_at`): a stage takes up
  a step it lost only when its job's submitter signed at least that many steps committed in its
  progress record, and a peer of another stage answers as much; a peer that knows no such record
  (here: none) never skips.
- R7 (race, swarmd/train/progress.py `uncovered_everywhere`): what is uncovered is the intersection
  of every answering peer's report, so one peer answering `uncovered: []` hides every lost
  microbatch from the re-sends and the takeover.
  Closed (trainer side of R3, and R7): a stage is committed for the trainer when the lower median
  of its peers' steps is past the step, and an id is uncovered when at least half of the answers
  at the step list it (`progress.committed`, `progress.uncovered_everywhere`).
- R4 (closed, swarmd/stage/service.py): `stage.wait_commit` (since replaced by `stage.info`'s
  long-poll) took the same `max_waiting` slots as the trainers' calls parked for the next step, and
  anyone may call it: 16 calls from a stranger and every trainer's next-step call was refused
  `busy`; so were 16 calls parked for a far step. Now long-polls have slots of their own, every
  slot count is also per caller, and a call more than `max_steps_ahead` ahead does not park.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest
from adversary_kit import FAST, JOB, STAGE, backward, committed_within, spec, start_peer, stranger_pool, training_job
from waiting import until

from swarmd.directory import StagePeer, StaticDirectory
from swarmd.stage.core import CoreConfig, Download, MateView, Phase, StageCore, initial_digest
from swarmd.train import progress
from swarmd.train.trainer import Trainer, TrainerConfig
from swarmd.train.wiring import WiringConfig
from transport.errors import RemoteError, RpcError, TransportError
from transport.identity import Identity
from transport.rpc import Message, Router, RpcConfig, RpcServer

D0 = initial_digest(5, 1)


def serving_core() -> StageCore:
    core = StageCore(b"\x10" * 32, "127.0.0.1:1", CoreConfig(4))
    core.replaced(3, D0)
    core.phase = Phase.SERVING
    return core


def test_a_lone_liar_far_ahead_is_not_downloaded_from_over_an_agreeing_mate():
    """This peer and an honest mate are at step 3 with the same digest; a third mate alone claims
    step 1,000,000 (any digest). No trainer asked for a step past 3. Expected: no Download (its
    claim is unconfirmed and contradicted); on main the core downloads the liar's state first."""
    core = serving_core()
    honest = MateView(b"\x20" * 32, "127.0.0.1:2", 3, "serving", D0, frozenset())
    liar = MateView(b"\x30" * 32, "127.0.0.1:3", 1_000_000, "serving", b"\x00" * 16, frozenset())
    core.observe(0.0, [honest, liar], [], [honest.peer_id, liar.peer_id])
    action = core.decide(0.0, frozenset())
    assert not (isinstance(action, Download) and liar.peer_id in [p for p, _ in action.sources])


def test_one_peer_far_ahead_does_not_make_a_stage_committed():
    """Two answers from stage peers: an honest one still at step 3, uncovered microbatches waiting
    for re-sends, and one at step 1,000,000 with a made-up record. Expected: step 3 is not
    committed on that word (the trainer keeps re-sending); on main the liar alone is enough."""
    honest = {"step": 3, "state": "serving", "uncovered": [12, 13], "missing": []}
    liar = {"step": 1_000_000, "state": "serving", "last_step": {"step": 3, "samples": 8, "summed_duplicates": 0}}
    assert progress.committed([honest, liar], 3) == []


def test_one_peer_reporting_nothing_uncovered_does_not_hide_lost_microbatches():
    """Two honest peers of a stage at step 3 both report microbatches 12 and 13 uncovered (their
    holder died before a mate saw them: only `uncovered` shows them); a third peer answers at step
    3 with `uncovered: []`. Expected: 12 and 13 are still uncovered for the trainer (re-sent or
    taken over; a copy a peer does hold is summed once anyway, I1); on main the intersection over
    every answer makes them vanish, so nothing is ever re-sent and the step never commits."""
    honest = {"step": 3, "state": "serving", "uncovered": [12, 13], "missing": []}
    liar = {"step": 3, "state": "serving", "uncovered": [], "missing": []}
    assert progress.uncovered_everywhere([honest, dict(honest), liar], 3, set(range(12, 16))) == {12, 13}


@pytest.fixture
async def lone_peer():
    directory = StaticDirectory()
    peer = await start_peer(spec(), STAGE, directory)
    try:
        yield peer, directory
    finally:
        await peer.close()


async def test_one_stranger_cannot_fast_forward_a_stage(lone_peer):
    """The only peer of stage 1 is at step 0. A stranger announces a stage-0 peer answering
    `stage.info` with step 15 and sends stage 1 a backward call for step 15. Expected: the peer
    does not jump (committed stays 0, nothing skipped); on main it skips steps 0..14 in ~1 s."""
    victim, directory = lone_peer
    identity = Identity.generate()
    router = Router()

    async def info(req):
        return Message({"step": 15, "state": "serving"}, codec="none")

    router.unary("stage.info", info)
    liar = await RpcServer.serve_tcp(router, "127.0.0.1", 0, config=RpcConfig(identity=identity))
    pool, _ = stranger_pool()
    try:
        directory.set(JOB, 0, [StagePeer(identity.peer_id, f"127.0.0.1:{liar.address[1]}", 0)])
        with contextlib.suppress(RemoteError, TransportError):
            await backward(pool, victim, 15, 0, timeout=6.0)
        assert victim.service.committed == 0 and not victim.service.skipped, \
            f"jumped to {victim.service.committed} (skipped {list(victim.service.skipped)})"
    finally:
        await pool.close()
        await liar.close()


async def next_step_is_answered(victim, stranger, calls: list[asyncio.Task], held) -> None:
    """Once each of a stranger's `calls` is either answered (refused) or held by the peer (`held()`
    counts the slots they hold), the trainer sends step 1's first microbatch (parked until step 0
    commits) and step 0's four: the step-1 call must be parked, then answered once step 0 commits
    (on main: RemoteError busy, "16 calls already wait for a commit")."""
    trainer, trainer_identity = stranger_pool()
    try:
        await until(lambda: held() + sum(call.done() for call in calls) >= len(calls), 5,
                    "every stranger's call answered or held", interval=0.01)
        next_step = asyncio.create_task(backward(trainer, victim, 1, 0, timeout=8.0))
        await until(lambda: victim.service.parked.held_by(trainer_identity.peer_id) or next_step.done(), 5,
                    "the trainer's step-1 call parked (or, on main, refused)", interval=0.01)
        await asyncio.gather(*(backward(trainer, victim, 0, m) for m in range(4)))
        assert await committed_within([victim], 1, 5.0)
        await next_step
    finally:
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await stranger.close()
        await trainer.close()


async def test_a_strangers_long_polls_do_not_refuse_the_trainers_next_step(lone_peer):
    """A stranger sends max_waiting (16) `stage.info` long-polls (`stage.wait_commit` calls when
    R4 was found); then the trainer sends step 1's first microbatch (parked until step 0 commits)
    and step 0's four. Expected: the step-1 call is answered once step 0 commits; before R4 was
    closed it was refused `busy` at once (the watches took every max_waiting slot; now they have
    slots of their own, max_watchers_per_peer for one caller, the rest answered at once)."""
    victim, _ = lone_peer
    stranger, _ = stranger_pool()
    wait = Message({"job": JOB, "stage": STAGE, "until_step": 100, "wait_s": 30.0}, codec="none")
    waits = [asyncio.create_task(stranger.call(victim.addr, "stage.info", wait, timeout=10))
             for _ in range(victim.service.limits.max_waiting)]
    await next_step_is_answered(victim, stranger, waits, lambda: victim.service.watchers.total)


async def test_a_strangers_parked_future_calls_do_not_refuse_the_trainers_next_step(lone_peer):
    """The same slots taken by compute calls: a stranger sends max_waiting (16) backward calls for
    step 5 (on main each waits for commits up to max_wait_s). Expected: the trainer's step-1 call is
    still parked and answered once step 0 commits; on main it is refused `busy` at once (now a call
    more than max_steps_ahead ahead is answered not_ready at once, and one caller parks at most
    max_waiting_per_peer)."""
    victim, _ = lone_peer
    stranger, _ = stranger_pool()
    parked = [asyncio.create_task(backward(stranger, victim, 5, m % 4, timeout=10.0))
              for m in range(victim.service.limits.max_waiting)]
    await next_step_is_answered(victim, stranger, parked, lambda: victim.service.parked.total)


async def test_a_liar_answering_at_once_does_not_cut_the_commit_watch_short(tmp_path):
    """A stranger announced in stage 1 answers `stage.info` at once with step 1,000,000 (every
    compute call `busy`, so it never serves the trainer); the honest peers commit up to 1 s after
    the trainer's last backward (their sync loop ticks every second); the trainer gives stragglers
    0.05 s. Expected: every step's commit is heard from the honest peers, with their records. The
    commit watch long-polls: had the liar's instant answer ended the round, the honest peers, still
    waiting for their commit, cut off and left out, the liar's claim alone would have decided
    (measured so: every step taken as committed without stage 1's record, -1). A peer that did
    not serve the trainer does not start the stragglers' clock, and a peer cut off by it is asked
    where it stands."""
    job_spec, data = training_job(tmp_path)
    directory = StaticDirectory()
    peers = [await start_peer(job_spec, stage, directory, dataclasses.replace(FAST, sync_interval_s=1.0))
             for stage in range(2)]
    liar_identity = Identity.generate()
    router = Router()

    async def info(req):
        return Message({"step": 1_000_000, "state": "serving"}, codec="none")

    async def busy(req):
        raise RpcError("busy", "always")

    router.unary("stage.info", info)
    for method in ("stage.forward", "stage.backward", "stage.forward_backward"):
        router.unary(method, busy)
    liar = await RpcServer.serve_tcp(router, "127.0.0.1", 0, config=RpcConfig(identity=liar_identity))
    directory.set(JOB, 1, [*await directory.peers(JOB, 1),
                           StagePeer(liar_identity.peer_id, f"127.0.0.1:{liar.address[1]}", 1)])
    pool, _ = stranger_pool()
    config = TrainerConfig(info_timeout_s=2.0, refresh_s=0.5, wait_initial_s=0.01, wait_max_s=0.2,
                           commit_poll_s=0.01, commit_poll_max_s=0.05, stage_info_straggler_s=0.05,
                           wiring=WiringConfig(seed=3))
    try:
        trainer = Trainer(job_spec, JOB, directory, pool, data, config=config)
        events = await asyncio.wait_for(trainer.run(0, 3), 120)
        assert [e.stage_samples for e in events] == [(job_spec.batch.global_samples,) * 2] * 3
    finally:
        await pool.close()
        await liar.close()
        for peer in peers:
            await peer.close()
