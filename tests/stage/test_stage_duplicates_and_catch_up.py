"""Edge paths of a stage peer: a microbatch accumulated on two peers, a peer that missed a commit
catching up by download, a caller that gives up while queued, a one-stage job, and stopping with
work queued."""

from __future__ import annotations

import asyncio

import pytest
import torch
from stageref import reference_stage
from waiting import until

from swarmd.directory import StagePeer, StaticDirectory
from swarmd.model import build_stage
from swarmd.stage import StageLimits
from swarmd.stage.core import Admission
from transport.errors import DeadlineExceeded, RemoteError
from transport.rpc import Message, Router

B, T, C = 2, 16, 32
STAGE = 1


def inputs(step, m):
    g = torch.Generator().manual_seed(500 + 10 * step + m)
    return torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)


async def backward(kit, client, peer, step, m, timeout=10.0):
    x, gy = inputs(step, m)
    return await kit.call(client, peer, "stage.backward", STAGE, step, step * 4 + m, [x, gy], timeout=timeout)


def _mate_ids(peer):
    return {i for m in peer.service.core._mates.values() for i in m.ids}


def assert_reference(spec, peer, mbs):
    """The peer's parameters equal one step of a reference that applied each of `mbs` once."""
    ref = reference_stage(spec, STAGE, 3, 1, lambda step, m: inputs(0, mbs[m]), microbatches=len(mbs))
    for p, q in zip(peer.service.stage.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


async def test_a_microbatch_a_mate_holds_is_answered_but_not_added(kit, client):
    """Steps: microbatches 0,1,2 to peer A, then 2 (as a trainer's retry after a timeout whose
    call did complete) and 3 to peer B, which has polled A; and mb 0 to A once more. Expected: B
    answers mb 2 (`held_by_mate`, nothing added), A refuses the repeat of mb 0 (`duplicate`); the
    step commits with exactly global_samples and no duplicate, and the parameters equal a
    reference that applied every microbatch once (I1)."""
    spec = kit.make_spec(stages=3, optim="sgd")
    directory = StaticDirectory()
    a = await kit.start_peer(spec, STAGE, 1, directory)
    b = await kit.start_peer(spec, STAGE, 2, directory)
    try:
        for m in (0, 1, 2):
            await backward(kit, client, a, 0, m)
        assert (await backward(kit, client, a, 0, 0)).meta["duplicate"] is True
        await until(lambda: 2 in _mate_ids(b), 10.0, "2 in _mate_ids(b)")
        retry = await backward(kit, client, b, 0, 2)
        assert retry.meta["held_by_mate"] is True and retry.meta["added"] is False
        await backward(kit, client, b, 0, 3)
        await until(lambda: all(p.service.records for p in (a, b)), 10.0, "all(p.service.records for p in (a, b))")
        record = a.service.records[-1]
        assert record.samples == spec.batch.global_samples and record.members == 2
        assert record.summed_duplicates == 0 and record.dropped_repeats == 1
        assert_reference(spec, a, (0, 1, 2, 3))
    finally:
        await a.close()
        await b.close()


async def test_overlapping_sums_are_never_both_summed(kit, client):
    """Steps: B cannot see A (A is not announced to it) and takes mbs 2 and 3 while A holds 0,1,2
    (mb 2 twice: the trainer's retry on a mate it could not know held it). A sees B and leads.
    Expected: the round keeps A's sum, leaves B's out and, short of mb 3, fails; B clears its sum
    and mb 3 shows as missing on A; re-sent to B, the step commits with every microbatch summed
    once, the parameters equal the reference (I1), and both peers show the same digest (I2)."""
    spec = kit.make_spec(stages=3, optim="sgd")
    directory = StaticDirectory()
    a = await kit.start_peer(spec, STAGE, 1, directory, announce=False)
    b = await kit.start_peer(spec, STAGE, 2, directory)
    try:
        for m in (0, 1, 2):
            await backward(kit, client, a, 0, m)
        for m in (2, 3):
            assert (await backward(kit, client, b, 0, m)).meta["added"] is True
        await until(lambda: a.service.sync.missing == [3], 10.0, "a.service.sync.missing == [3]")
        assert b.service.accumulator.progress(0).ids == frozenset()
        assert (await backward(kit, client, b, 0, 3)).meta["added"] is True
        await until(lambda: all(p.service.records for p in (a, b)), 10.0, "all(p.service.records for p in (a, b))")
        record = a.service.records[-1]
        assert record.samples == spec.batch.global_samples and record.summed_duplicates == 0
        assert_reference(spec, a, (0, 1, 2, 3))
        assert_reference(spec, b, (0, 1, 2, 3))
        assert a.service.digest == b.service.digest
    finally:
        await a.close()
        await b.close()


async def test_a_peer_that_missed_commits_downloads_the_state_of_a_mate_ahead(kit, client):
    """Steps: peer B sees A in its directory, A does not see B; A alone commits steps 0 and 1.
    Expected: B notices A is ahead, downloads its state and ends at step 2 with A's parameters."""
    spec = kit.make_spec(stages=3, optim="adamw")
    a = await kit.start_peer(spec, STAGE, 1, StaticDirectory())
    b_directory = StaticDirectory({(kit.JOB, STAGE): [StagePeer(bytes([1]) * 32, a.addr, STAGE)]})
    b = await kit.start_peer(spec, STAGE, 2, b_directory)
    try:
        for step in (0, 1):
            await asyncio.gather(*(backward(kit, client, a, step, m) for m in range(4)))
            await until(lambda: a.service.committed > step, 10.0, "a.service.committed > step")
        await until(lambda: b.service.committed == 2, 10.0, "b.service.committed == 2")
        await until(lambda: b.service.state == "serving", 10.0, "b.service.state == 'serving'")
        for p, q in zip(b.service.stage.parameters(), a.service.stage.parameters()):
            assert torch.equal(p, q)
        assert b.service.opt.lr == a.service.opt.lr
    finally:
        await a.close()
        await b.close()


async def test_a_caller_that_gives_up_while_queued_leaves_no_claim(kit, client):
    """Steps: compute blocked with one forward in the only worker; a backward with a 0.3 s deadline
    times out while queued behind it; compute unblocked; the same microbatch is sent again. Expected: the retry is not a duplicate and the
    gradient is accumulated exactly once."""
    spec = kit.make_spec(stages=3)
    peer = await kit.start_peer(spec, STAGE, 1, StaticDirectory(), StageLimits(workers=1, sync_interval_s=60.0))
    try:
        blocker = peer.service.guard.write()
        blocker.__enter__()
        try:
            x, _ = inputs(0, 0)
            filler = asyncio.create_task(kit.call(client, peer, "stage.forward", STAGE, 0, 0, [x]))
            await until(lambda: peer.service.executor.depth == 1, 10.0, "the worker to hold it, blocked")
            with pytest.raises(DeadlineExceeded):
                await backward(kit, client, peer, 0, 1, timeout=0.3)
        finally:
            await asyncio.to_thread(blocker.__exit__, None, None, None)
        await filler
        reply = await backward(kit, client, peer, 0, 1)
        assert reply.meta["duplicate"] is False
        progress = peer.service.accumulator.progress(0)
        assert progress.ids == {1} and progress.samples == B
    finally:
        await peer.close()


async def test_a_one_stage_job_answers_forward_backward_with_the_loss_only(kit, client):
    spec = kit.make_spec(stages=1)
    peer = await kit.start_peer(spec, 0, 1, StaticDirectory(), StageLimits(sync_interval_s=60.0))
    try:
        g = torch.Generator().manual_seed(9)
        ids, targets = torch.randint(0, 256, (B, T), generator=g), torch.randint(0, 256, (B, T), generator=g)
        reply = await kit.call(client, peer, "stage.forward_backward", 0, 0, 0, [ids, targets])
        ref = build_stage(spec.model.config, 0, 1, spec.seed)
        assert reply.tensors == [] and reply.meta["loss_sum"] == ref(ids, targets).item()
        with pytest.raises(RemoteError) as info:
            await kit.call(client, peer, "stage.forward", 0, 0, 0, [ids])
        assert info.value.code == "bad_input"
    finally:
        await peer.close()


async def test_stopping_answers_queued_calls_busy(kit, client):
    spec = kit.make_spec(stages=3)
    peer = await kit.start_peer(spec, STAGE, 1, StaticDirectory(), StageLimits(workers=1, sync_interval_s=60.0))
    blocker = peer.service.guard.write()
    blocker.__enter__()
    try:
        first = asyncio.create_task(backward(kit, client, peer, 0, 0))
        await until(lambda: peer.service.executor.depth == 1, 10.0, "peer.service.executor.depth == 1")
        queued = asyncio.create_task(backward(kit, client, peer, 0, 1))
        await until(lambda: peer.service.executor.depth == 2, 10.0, "peer.service.executor.depth == 2")
        stopping = asyncio.create_task(peer.service.stop())
        for task in (first, queued):
            with pytest.raises(RemoteError) as info:
                await task
            assert info.value.code == "busy"
        with pytest.raises(RemoteError) as info:
            await backward(kit, client, peer, 0, 2)
        assert info.value.code == "not_serving"
        await asyncio.to_thread(blocker.__exit__, None, None, None)  # stop waits for the blocked thread
        blocker = None
        await asyncio.wait_for(stopping, 10)
    finally:
        if blocker is not None:
            await asyncio.to_thread(blocker.__exit__, None, None, None)
        await peer.rpc.close()
        await peer.pool.close()


async def test_a_non_finite_reduced_gradient_skips_the_update_but_commits(kit, client):
    """Steps: a single peer; an inf is planted in its gradient sum (finite inputs cannot make one
    here, overflow could); the step's microbatches arrive. Expected: the step commits (the stage
    stays live), parameters are unchanged, and the record shows grad_norm inf."""
    spec = kit.make_spec(stages=3)
    peer = await kit.start_peer(spec, STAGE, 1, StaticDirectory())
    try:
        before = [p.detach().clone() for p in peer.service.stage.parameters()]
        poison = [torch.full_like(p, float("inf")) for p in peer.service.params]
        assert peer.service.core.admit(0.0, 0, 0) == Admission.ACCUMULATE
        peer.service.accumulator.add(0, [0], B, poison)
        await asyncio.gather(*(backward(kit, client, peer, 0, m) for m in (1, 2, 3)))
        await until(lambda: peer.service.records, 10.0, "peer.service.records")
        assert peer.service.committed == 1 and peer.service.records[-1].grad_norm == float("inf")
        for p, q in zip(peer.service.stage.parameters(), before):
            assert torch.equal(p, q)
    finally:
        await peer.close()


class SlowProgressRouter(Router):
    """A mate that stops answering progress in time (overloaded, not dead) once `slow` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.slow = False

    def lookup(self, name):
        entry = super().lookup(name)
        if name != "stage.sync.progress" or not self.slow:
            return entry

        async def stall(req):
            await asyncio.sleep(3600)

        return "unary", stall


async def test_a_slow_mate_keeps_its_ids_out_of_missing_for_the_grace_period(kit, client):
    """Steps: A holds mbs 0,1 and B holds 2; A has seen B's progress; B's progress calls then time
    out. Expected: within missing_grace_s, A reports 2 neither missing nor uncovered (a re-send
    would be a second copy if B is only slow); after it, 2 is missing."""
    spec = kit.make_spec(stages=3)
    limits = StageLimits(sync_interval_s=0.02, progress_timeout_s=0.2, missing_grace_s=1.5)
    directory = StaticDirectory()
    router = SlowProgressRouter()
    a = await kit.start_peer(spec, STAGE, 1, directory, limits)
    b = await kit.start_peer(spec, STAGE, 2, directory, limits, router=router)
    try:
        for m, peer in ((0, a), (1, a), (2, b)):
            await backward(kit, client, peer, 0, m)

        async def info():
            return (await client.call(a.addr, "stage.info", Message(kit.meta(STAGE)), timeout=5)).meta

        await until(lambda: a.service.sync.uncovered == [3], 10.0, "a.service.sync.uncovered == [3]")
        router.slow = True
        slow_since = asyncio.get_running_loop().time()
        await until(lambda: a.service.core.mate_slow(), 10.0, "a.service.core.mate_slow()")
        meta = await info()
        assert meta["missing"] == [] and meta["uncovered"] == [3]
        assert asyncio.get_running_loop().time() - slow_since < 1.5
        await until(lambda: a.service.sync.missing == [2], 5, "a.service.sync.missing == [2]")
        assert asyncio.get_running_loop().time() - slow_since >= 1.5
        assert (await info())["missing"] == [2]
    finally:
        router.slow = False
        await a.close()
        await b.close()
