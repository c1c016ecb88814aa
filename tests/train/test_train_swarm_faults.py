"""Faults under real stage peers on loopback: a peer closed mid-step, a stage with no peer for a
while, a peer that answers garbage. Training goes on, nothing hangs, no step commits short."""

import asyncio
import dataclasses

import pytest
import torch
from waiting import until

from swarmd.directory import StagePeer
from swarmd.reference import ReferenceTrainer
from swarmd.train.events import StatusEvent, StepEvent
from swarmd.train.errors import InputRefused
from swarmd.train.trainer import Trainer
from transport.errors import RpcError
from transport.rpc import Message, Router, RpcServer

pytestmark = pytest.mark.slow


def make_trainers(spec, data, swarm_, pools, kit, shards=2, events=None):
    sink = events.append if events is not None else None
    return [Trainer(spec, kit.JOB_ID, swarm_.directory, pool, data, shard=k, shards=shards,
                    config=kit.TRAINER_CONFIG, on_event=sink) for k, pool in enumerate(pools(shards))]


async def close_a_peer_mid_step(spec, data, swarm_, pools, kit, after_mate_saw: bool):
    """Run 2 trainers for 5 steps; when one peer of stage 1 holds gradients for step 2, close its
    server (its announcement stays in the directory, as a dead DHT record would until it expires).
    Checks what must hold however the stage noticed the loss."""
    victim, mate = swarm_.of_stage(1)
    held: list[int] = []

    def mid_step() -> bool:
        ids = victim.service.accumulator.progress(2).ids
        if victim.service.committed != 2 or not ids:
            return False
        # The mate has polled the victim's progress since: the ids are no longer uncovered there.
        return not after_mate_saw or (mate.service.committed == 2 and not ids & set(mate.service.sync.uncovered))

    async def close_mid_step():
        while not mid_step():
            await asyncio.sleep(0.001)
        held.extend(sorted(victim.service.accumulator.progress(2).ids))
        await victim.close()

    events = []
    trainers = make_trainers(spec, data, swarm_, pools, kit, events=events)
    killer = asyncio.create_task(close_mid_step())
    results = await asyncio.wait_for(asyncio.gather(*(t.run(0, 5) for t in trainers)), timeout=90)
    await asyncio.wait_for(killer, 1)

    steps = [e for e in events if isinstance(e, StepEvent)]
    assert [[e.step for e in r] for r in results] == [list(range(5))] * 2
    assert held, "the victim held no gradient when closed"
    assert sum(e.bans for e in steps) >= 1
    # Each held id was lost with the victim: re-sent when the trainer had its answer already,
    # retried elsewhere when the answer was still on its way.
    assert sum(e.resent + e.retries for e in steps) >= len(held)
    duplicates = {(e.step, i): d for e in steps for i, d in enumerate(e.duplicates)}
    print(f"closed a stage-1 peer holding microbatches {held} of step 2; re-sent {sum(e.resent for e in steps)}, "
          f"retries {sum(e.retries for e in steps)}, bans {sum(e.bans for e in steps)}, "
          f"duplicates per (step, stage) {duplicates}")
    G = spec.batch.global_samples
    for e in steps:
        for samples, dup in zip(e.stage_samples, e.duplicates):
            assert samples == -1 or samples >= G, e
            if dup == 0:
                assert samples in (-1, G), e
    # A trainer moves on once the stage reports the commit; a mate may apply it a moment later.
    live = [peer for peer in swarm_.peers if not peer.closed]
    await until(lambda: all(peer.service.committed == 5 for peer in live), 10, "every live peer to apply step 5",
                interval=0.1, detail=lambda: f"committed: {[peer.service.committed for peer in live]}")
    if all(d == 0 for d in duplicates.values()):
        reference = ReferenceTrainer(spec, data)
        reference.train(5)
        worst = kit.max_relative_difference(swarm_, reference)
        print(f"no duplicates: max relative difference to the reference {worst:.2e}")
        assert worst <= 1e-5


async def test_a_peer_closed_mid_step_loses_no_gradient(tiny_job, swarm, pools, kit):
    """Steps: 3 stages × 2 peers, 2 trainers, 8 microbatches per step, SGD with momentum, stage-mates
    polling each other every 20 ms; close one peer of stage 1 mid-step 2. Expected: all 5 steps
    complete; the trainers ban the dead peer and re-send the microbatches its mate reports
    `missing` (or retry those whose answer had not come back); every stage commits every step with at least global_samples, exactly
    global_samples where nothing was duplicated (duplicates printed); with no duplicates the final
    parameters equal the reference's within 1e-5."""
    spec, data = tiny_job(optim="sgd", lr=0.1, global_samples=32, microbatch_samples=4, in_flight=2)
    await close_a_peer_mid_step(spec, data, await swarm(spec, peers_per_stage=2), pools, kit, after_mate_saw=True)


async def test_gradients_lost_before_a_mate_saw_them_are_re_sent(tiny_job, swarm, pools, kit):
    """Steps: as above, but stage-mates poll each other only every 0.4 s, so the closed peer's
    microbatches were most likely never seen by its mate: they are `uncovered`, not `missing`.
    Expected: the same guarantees; the trainers re-send them after `uncovered_grace_s` (without
    that the stage would never commit step 2 and the run would time out)."""
    spec, data = tiny_job(optim="sgd", lr=0.1, global_samples=32, microbatch_samples=4, in_flight=2)
    limits = dataclasses.replace(kit.STAGE_LIMITS, sync_interval_s=0.4)
    await close_a_peer_mid_step(spec, data, await swarm(spec, 2, limits), pools, kit, after_mate_saw=False)


async def test_a_stage_without_peers_waits_then_resumes(tiny_job, swarm, pools, kit):
    """Steps: 2 stages; stage 1's only peer is absent from the directory at first. Expected: the
    trainer reports "stage 1 has no peers" (status and event) instead of failing or spinning;
    when a peer of stage 1 is announced it resumes on its own and finishes 2 steps."""
    spec, data = tiny_job(optim="sgd", lr=0.1, stages=2)
    swarm_ = await swarm(spec, peers_per_stage=1)
    stage1 = await swarm_.directory.peers(kit.JOB_ID, 1)
    swarm_.directory.set(kit.JOB_ID, 1, [])
    events = []
    [trainer] = make_trainers(spec, data, swarm_, pools, kit, shards=1, events=events)
    task = asyncio.create_task(trainer.run(0, 2))
    for _ in range(400):
        await asyncio.sleep(0.025)
        if trainer.status:
            break
    assert trainer.status == "stage 1 has no peers"
    await asyncio.sleep(0.3)
    assert not task.done()
    swarm_.directory.set(kit.JOB_ID, 1, stage1)
    steps = await asyncio.wait_for(task, 30)
    assert [e.step for e in steps] == [0, 1]
    assert StatusEvent("stage 1 has no peers") in events and StatusEvent("") in events
    assert trainer.status == ""


async def test_a_peer_answering_nan_is_banned_and_its_work_redone(tiny_job, swarm, pools, kit):
    """Steps: 2 stages; stage 0 has one real peer and one hostile peer (not a stage server: a bare
    Router whose stage.forward answers NaN activations of the right shape, and whose stage.info
    claims to be at step 0). Expected: the trainer bans the hostile peer on its first bad reply,
    redoes that forward on the real peer, and the 2 steps match the reference's losses."""
    spec, data = tiny_job(optim="sgd", lr=0.1, stages=2)
    swarm_ = await swarm(spec, peers_per_stage=1)
    B, T, C = spec.batch.microbatch_samples, spec.data.seq_len, spec.model.config.d_model
    calls = []

    async def poisoned(req):
        calls.append(req.method)
        return Message({}, [torch.full((B, T, C), float("nan"))], codec="none")

    async def info(req):
        return Message({"step": 0, "missing": [], "uncovered": []}, codec="none")

    router = Router()
    router.unary("stage.forward", poisoned)
    router.unary("stage.info", info)
    hostile = await RpcServer.serve_tcp(router, "127.0.0.1", 0)
    try:
        hostile_peer = StagePeer(b"\xee" * 32, f"127.0.0.1:{hostile.address[1]}", 0)
        swarm_.directory.set(kit.JOB_ID, 0, [*await swarm_.directory.peers(kit.JOB_ID, 0), hostile_peer])
        [trainer] = make_trainers(spec, data, swarm_, pools, kit, shards=1)
        steps = await asyncio.wait_for(trainer.run(0, 2), 30)
    finally:
        await hostile.close()
    assert "stage.forward" in calls  # the hostile peer was tried (it entered at the minimum key)
    assert b"\xee" * 32 in trainer.wiring[0].banned()
    assert "not finite" in trainer.wiring[0].banned()[b"\xee" * 32]
    assert sum(e.bans for e in steps) == 1
    ref_losses = [r.loss for r in ReferenceTrainer(spec, data).train(2)]
    for e, want in zip(steps, ref_losses):
        assert abs(e.global_loss - want) <= 1e-5 * want


async def test_slow_and_busy_peers_are_rerouted_not_banned(tiny_job, swarm, pools, kit):
    """Steps: 2 stages; stage 0 has one real peer, one peer whose stage.forward and stage.backward
    never answer in time (a bare Router sleeping 30 s) and one that always answers `busy`; call
    timeouts 0.3 s.
    Expected: 2 steps complete with the reference's losses; both bad peers were tried, neither is
    banned; the slow one's measured speed fell far below the real peer's, so it gets little work."""
    spec, data = tiny_job(optim="sgd", lr=0.1, stages=2)
    swarm_ = await swarm(spec, peers_per_stage=1)
    tried = []

    async def slow(req):
        tried.append("slow")
        await asyncio.sleep(30)

    async def busy(req):
        tried.append("busy")
        raise RpcError("busy", "queue full")

    async def info(req):
        return Message({"step": 0, "missing": [], "uncovered": []}, codec="none")

    servers = []
    for name, handler in (("slow", slow), ("busy", busy)):
        router = Router()
        router.unary("stage.forward", handler)
        router.unary("stage.backward", handler)
        router.unary("stage.info", info)
        servers.append(await RpcServer.serve_tcp(router, "127.0.0.1", 0))
    slow_id, busy_id = b"\x51" * 32, b"\xb5" * 32
    extra = [StagePeer(slow_id, f"127.0.0.1:{servers[0].address[1]}", 0),
             StagePeer(busy_id, f"127.0.0.1:{servers[1].address[1]}", 0)]
    swarm_.directory.set(kit.JOB_ID, 0, [*await swarm_.directory.peers(kit.JOB_ID, 0), *extra])
    config = dataclasses.replace(kit.TRAINER_CONFIG, forward_timeout_s=0.3, backward_timeout_s=0.3)
    trainer = Trainer(spec, kit.JOB_ID, swarm_.directory, pools(1)[0], data, config=config)
    try:
        steps = await asyncio.wait_for(trainer.run(0, 2), 30)
    finally:
        for server in servers:
            await server.close()
    assert {"slow", "busy"} <= set(tried)
    assert trainer.wiring[0].banned() == {} and sum(e.bans for e in steps) == 0
    assert sum(e.retries for e in steps) >= 2
    real = swarm_.of_stage(0)[0].peer_id
    assert trainer.wiring[0].samples_per_s(slow_id) < trainer.wiring[0].samples_per_s(real) / 5
    ref_losses = [r.loss for r in ReferenceTrainer(spec, data).train(2)]
    for e, want in zip(steps, ref_losses):
        assert abs(e.global_loss - want) <= 1e-5 * want


async def test_delayed_updates_overlap_steps_and_commit_each_in_full(tiny_job, swarm, pools, kit):
    """Steps: 2 stages × 2 peers, 2 trainers, delayed_updates = true (step s+1 runs on the old
    parameters while s commits); 4 steps. Expected: every step commits on every stage with exactly
    global_samples and no duplicates, and the loss stays finite and in a sane range."""
    spec, data = tiny_job(optim="sgd", lr=0.1, stages=2, delayed=True)
    swarm_ = await swarm(spec, peers_per_stage=2)
    events = []
    trainers = make_trainers(spec, data, swarm_, pools, kit, events=events)
    results = await asyncio.wait_for(asyncio.gather(*(t.run(0, 4) for t in trainers)), timeout=60)
    assert [[e.step for e in r] for r in results] == [list(range(4))] * 2
    G = spec.batch.global_samples
    for e in events:
        # -1: the stage had already committed s+1 (possible with delayed updates) when polled for s.
        assert all(s in (G, -1) for s in e.stage_samples) and all(d in (0, -1) for d in e.duplicates), e
        assert 4.0 < e.shard_loss < 6.5
    for peer in swarm_.peers:
        assert peer.service.committed == 4


async def test_a_stage_that_cannot_commit_is_a_clear_status(tiny_job, swarm, pools, kit):
    """Steps: 2 stages × 1 peer; only trainer 0 of 2 runs, so half of every step's microbatches
    never arrive and no stage can commit step 0. Expected: once its own microbatches are done the
    trainer keeps polling and its status names each stage and how many microbatches are uncovered;
    cancelling it ends promptly."""
    spec, data = tiny_job(optim="sgd", lr=0.1, stages=2)
    swarm_ = await swarm(spec, peers_per_stage=1)
    config = dataclasses.replace(kit.TRAINER_CONFIG, commit_status_after_s=0.3)
    trainer = Trainer(spec, kit.JOB_ID, swarm_.directory, pools(1)[0], data, shard=0, shards=2, config=config)
    task = asyncio.create_task(trainer.run(0, 1))
    for _ in range(400):
        await asyncio.sleep(0.025)
        if "stage 1" in trainer.status:
            break
    assert trainer.status == ("stage 0 has not committed step 0 for 0.3+ s (1 peers answered, 2 microbatches "
                              "uncovered); stage 1 has not committed step 0 for 0.3+ s (1 peers answered, "
                              "2 microbatches uncovered)")
    task.cancel()
    try:
        await asyncio.wait_for(task, 2)
    except asyncio.CancelledError:
        pass
    assert task.cancelled()


async def test_one_hung_peer_per_stage_does_not_hold_up_the_commit_watch(tiny_job, swarm, pools, kit):
    """Steps: 3 stages, each with one real peer and one announced peer that takes compute calls as
    `busy` and never answers `stage.info` (hung); per-peer info timeout 0.5 s, directory-read timeout
    60 s. Expected: 2 steps commit well inside 40 s: every stage is asked at once and each hung
    peer costs one short timeout per poll (the old watch asked stage by stage, waiting out every
    hung peer: 3 stages x 60 s per poll)."""
    spec, data = tiny_job(optim="sgd", lr=0.1, stages=3)
    swarm_ = await swarm(spec, peers_per_stage=1)
    asked = []

    async def hang(req):
        asked.append(req.meta.get("stage"))
        await asyncio.sleep(3600)

    async def busy(req):
        raise RpcError("busy", "queue full")

    router = Router()
    router.unary("stage.info", hang)
    for method in ("stage.forward", "stage.backward", "stage.forward_backward"):
        router.unary(method, busy)
    server = await RpcServer.serve_tcp(router, "127.0.0.1", 0)
    addr = f"127.0.0.1:{server.address[1]}"
    for stage in range(3):
        swarm_.directory.set(kit.JOB_ID, stage, [*await swarm_.directory.peers(kit.JOB_ID, stage),
                                                 StagePeer(bytes([0xEE, stage]) * 16, addr, stage)])
    config = dataclasses.replace(kit.TRAINER_CONFIG, info_timeout_s=60.0, stage_info_timeout_s=0.5)
    trainer = Trainer(spec, kit.JOB_ID, swarm_.directory, pools(1)[0], data, config=config)
    try:
        events = await asyncio.wait_for(trainer.run(0, 2), 40)
    finally:
        await server.close()
    assert [e.step for e in events] == [0, 1] and {0, 1, 2} <= set(asked)
    G = spec.batch.global_samples
    assert all(e.stage_samples == (G, G, G) for e in events)


async def test_an_input_every_peer_of_a_stage_refuses_stops_the_trainer(tiny_job, swarm, pools, kit):
    """Steps: 2 stages; stage 0 has one real peer, stage 1 only two peers that answer every
    forward_backward `bad_input` (as a stage would refuse an input that is at fault). Expected: the
    trainer raises InputRefused, naming the refusals, once both refused one input: refusals from
    strangers alone blame nothing (tests/security/test_adversary_bad_input_sybils.py), but every
    unbanned peer of the stage refusing does, and there is nobody left to accept it."""
    spec, data = tiny_job(optim="sgd", lr=0.1, stages=2)
    swarm_ = await swarm(spec, peers_per_stage=1)

    async def refuse(req):
        raise RpcError("bad_input", "targets: token ids outside the vocabulary")

    async def info(req):
        return Message({"step": 0, "state": "serving", "missing": [], "uncovered": []}, codec="none")

    router = Router()
    router.unary("stage.forward_backward", refuse)
    router.unary("stage.info", info)
    servers = [await RpcServer.serve_tcp(router, "127.0.0.1", 0) for _ in range(2)]
    try:
        swarm_.directory.set(kit.JOB_ID, 1, [StagePeer(bytes([0xEE, k]) * 16, f"127.0.0.1:{s.address[1]}", 1)
                                             for k, s in enumerate(servers)])
        [trainer] = make_trainers(spec, data, swarm_, pools, kit, shards=1)
        with pytest.raises(InputRefused, match="2 peers of stage 1 refused microbatch .*0 unbanned peers left"):
            await asyncio.wait_for(trainer.run(0, 1), 30)
    finally:
        for server in servers:
            await server.close()
