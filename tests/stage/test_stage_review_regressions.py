"""The stage holes found by review (../shared/repro at ae25aed), each as the behaviour it must
have now: real stage peers on loopback, the trainer played by the test. Each of these failed on
the old code."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from stageref import reference_stage
from waiting import until

from swarmd.directory import StagePeer, StaticDirectory
from transport.errors import DeadlineExceeded, RemoteError
from transport.rpc import Message

B, T, C = 2, 16, 32
STAGE = 1


def inputs(step, m):
    g = torch.Generator().manual_seed(500 + 10 * step + m)
    return torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)


async def backward(kit, client, peer, step, m, timeout=10.0):
    return await kit.call(client, peer, "stage.backward", STAGE, step, step * 4 + m, list(inputs(step, m)),
                          timeout=timeout)


def reference(spec, steps):
    """A single-process stage that applied every microbatch of each step once."""
    return reference_stage(spec, STAGE, 3, steps, inputs)


def assert_equal_to(ref, *peers):
    for peer in peers:
        for p, q in zip(peer.service.stage.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


async def test_a_reply_after_the_callers_timeout_is_not_summed_again_by_the_retry(kit, client):
    """Hole 1. Steps: A adds mb 0's gradient at once but answers 1.5 s later; the caller gives up
    after 0.5 s and retries on B (as a trainer does). Expected: B does not add it again (a mate
    holds it), the step sums 4 distinct microbatches once, and both peers equal the reference."""
    spec = kit.make_spec(stages=3, optim="sgd")
    directory = StaticDirectory()
    a = await kit.start_peer(spec, STAGE, 1, directory)
    b = await kit.start_peer(spec, STAGE, 2, directory)
    real = a.service.executor._compute
    first = [True]

    def slow_reply(batch):
        answers = real(batch)
        if first[0]:
            first[0] = False
            time.sleep(1.5)
        return answers

    a.service.executor._compute = slow_reply
    try:
        with pytest.raises(DeadlineExceeded):
            await backward(kit, client, a, 0, 0, timeout=0.5)
        await until(lambda: any(0 in m.ids for m in b.service.core._mates.values()), 15.0, "B to see mb 0 at a mate")
        retry = await backward(kit, client, b, 0, 0)
        assert retry.meta["added"] is False
        for m in (1, 2, 3):
            await backward(kit, client, b if m % 2 else a, 0, m)
        await until(lambda: all(p.service.committed == 1 for p in (a, b)), 15.0, "A and B to commit step 0")
        record = a.service.records[-1]
        assert record.samples == spec.batch.global_samples and record.summed_duplicates == 0
        assert_equal_to(reference(spec, 1), a, b)
    finally:
        await a.close()
        await b.close()


async def test_a_failed_compute_whose_caller_left_releases_its_claim(kit, client):
    """Hole 5. Steps: a call is abandoned by its caller after its compute began; the compute then
    fails. Expected: the re-send is accepted and added (no leaked claim), and the step commits."""
    spec = kit.make_spec(stages=3, optim="sgd")
    peer = await kit.start_peer(spec, STAGE, 1, StaticDirectory())
    real = peer.service.executor._compute
    first = [True]

    def flaky(batch):
        if first[0]:
            first[0] = False
            time.sleep(0.6)
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(batch)

    peer.service.executor._compute = flaky
    try:
        with pytest.raises(DeadlineExceeded):
            await backward(kit, client, peer, 0, 0, timeout=0.3)
        await until(lambda: 0 not in peer.service.core.claimed(0), 15.0, "0 not in peer.service.core.claimed(0)")
        again = await backward(kit, client, peer, 0, 0)
        assert again.meta["duplicate"] is False and again.meta["added"] is True
        for m in (1, 2, 3):
            await backward(kit, client, peer, 0, m)
        await until(lambda: peer.service.committed == 1, 15.0, "peer.service.committed == 1")
        assert_equal_to(reference(spec, 1), peer)
    finally:
        await peer.close()


async def test_split_views_that_heal_end_with_one_state_on_every_peer(kit, client):
    """Hole 4. Steps: views {A, B} and {C}; A holds mbs 0-3 and B a copy of 0, C holds 0-3: both
    sides commit step 0 apart (different rounds). The views heal; step 1 goes to A. Expected: C,
    whose digest is the minority's, downloads before stepping again; after step 1 all three hold
    bit-identical parameters and one digest, equal to the reference (each side's step 0 summed
    every microbatch once, so either is right)."""
    spec = kit.make_spec(stages=3, optim="sgd")
    left, right = StaticDirectory(), StaticDirectory()
    a = await kit.start_peer(spec, STAGE, 1, left)
    b = await kit.start_peer(spec, STAGE, 2, left)
    c = await kit.start_peer(spec, STAGE, 3, right)
    peers = (a, b, c)
    try:
        await backward(kit, client, b, 0, 0)
        for m in range(4):
            await backward(kit, client, a, 0, m)
            await backward(kit, client, c, 0, m)
        await until(lambda: all(p.service.committed == 1 for p in peers), 15.0, "every peer to commit step 0")
        assert a.service.digest == b.service.digest != c.service.digest
        everyone = [StagePeer(p.service.peer_id, p.addr, STAGE) for p in peers]
        left.set(kit.JOB, STAGE, everyone)
        right.set(kit.JOB, STAGE, everyone)
        await until(lambda: c.service.digest == a.service.digest, 15.0, "c.service.digest == a.service.digest")
        for m in range(4):
            await backward(kit, client, a, 1, m)
        await until(lambda: all(p.service.committed == 2 for p in peers), 15.0, "every peer to commit step 1")
        assert len({p.service.digest for p in peers}) == 1
        for p in (b, c):
            for x, y in zip(a.service.stage.parameters(), p.service.stage.parameters()):
                assert torch.equal(x, y)
        assert_equal_to(reference(spec, 2), *peers)
    finally:
        for p in peers:
            await p.close()


async def test_a_mate_with_a_slow_uplink_is_benched_and_its_share_resent(kit, client):
    """Hole 3. Steps: B's all-reduce sends take longer than the round timeout (a slow uplink); A
    and B each hold two microbatches. Expected: after B's parts were late (twice), A leaves B out
    and reports B's microbatches missing; re-sent to A (as a trainer does) the step commits
    without B, and B, behind, catches up by download to A's state."""
    spec = kit.make_spec(stages=3, optim="sgd")
    directory = StaticDirectory()
    a = await kit.start_peer(spec, STAGE, 1, directory)
    b = await kit.start_peer(spec, STAGE, 2, directory)
    real = b.service.pool.call

    async def slow_uplink(addr, method, message, **kw):
        if method in ("stage.sync.reduce", "stage.sync.gather"):
            await asyncio.sleep(kit.FAST.round_timeout_s + 0.5)
        return await real(addr, method, message, **kw)

    b.service.pool.call = slow_uplink
    try:
        for m in range(4):
            await backward(kit, client, a if m % 2 else b, 0, m)
        await until(lambda: a.service.sync.missing == [0, 2], 6 * kit.FAST.round_timeout_s, "A to miss mbs 0 and 2")
        for m in (0, 2):
            await backward(kit, client, a, 0, m)
        await until(lambda: a.service.committed == 1 and b.service.committed == 1, 30, "A and B to commit step 0")
        assert a.service.records[-1].members == 1
        assert b.service.digest == a.service.digest
        assert_equal_to(reference(spec, 1), a, b)
    finally:
        await a.close()
        await b.close()


async def test_a_call_for_the_step_just_committed_is_answered_on_its_parameters(kit, client):
    """Hole 2 (stage side). Steps: step 0 commits on one peer; then mb 0 of step 0 comes again (a
    call whose first attempt timed out on the trainer though the stage committed with it), as
    forward and as backward; then a call for step 0 after step 1 committed. Expected: the first
    two are answered exactly as before the commit (same output and grad_x, computed on the step-0
    parameters), marked `replayed`, adding nothing; the last is `stale_step`."""
    spec = kit.make_spec(stages=3, optim="sgd")
    peer = await kit.start_peer(spec, STAGE, 1, StaticDirectory())
    try:
        x, gy = inputs(0, 0)
        before_y = (await kit.call(client, peer, "stage.forward", STAGE, 0, 0, [x])).tensors[0]
        first = await backward(kit, client, peer, 0, 0)
        for m in (1, 2, 3):
            await backward(kit, client, peer, 0, m)
        await until(lambda: peer.service.committed == 1, 15.0, "peer.service.committed == 1")
        y = await kit.call(client, peer, "stage.forward", STAGE, 0, 0, [x])
        again = await backward(kit, client, peer, 0, 0)
        assert y.meta["replayed"] is True and torch.equal(y.tensors[0], before_y)
        assert again.meta["replayed"] is True and again.meta["added"] is False
        assert torch.equal(again.tensors[0], first.tensors[0])
        assert peer.service.accumulator.progress(0).ids == frozenset()
        for m in range(4):
            await backward(kit, client, peer, 1, m)
        await until(lambda: peer.service.committed == 2, 15.0, "peer.service.committed == 2")
        with pytest.raises(RemoteError) as stale:
            await backward(kit, client, peer, 0, 0)
        assert stale.value.code == "stale_step"
        assert_equal_to(reference(spec, 2), peer)
    finally:
        await peer.close()


async def test_a_backward_tagged_with_its_forwards_version_recomputes_on_those_parameters(kit, client):
    """Delayed updates: mb 0 of step 1 is forwarded while step 0 is open (version 0), then step 0
    commits, then its backward comes tagged `version: 0`. Expected: the recompute runs on the
    step-0 parameters (the reply says version 0; grad_x equals a reference backward on them) and
    its gradient goes to step 1's sum; untagged, the same backward runs on version 1."""
    spec = kit.make_spec(stages=3, optim="sgd", delayed=True)
    peer = await kit.start_peer(spec, STAGE, 1, StaticDirectory())
    try:
        x, gy = inputs(1, 0)
        forward = await kit.call(client, peer, "stage.forward", STAGE, 1, 4, [x])
        assert forward.meta["version"] == 0
        before = reference(spec, 0)
        x_ref = x.clone().requires_grad_(True)
        before(x_ref).backward(gy)
        for m in range(4):
            await backward(kit, client, peer, 0, m)
        await until(lambda: peer.service.committed == 1, 15.0, "peer.service.committed == 1")
        meta = {**kit.call_meta(STAGE, 1, 4, B), "version": 0}
        tagged = await client.call(peer.addr, "stage.backward", Message(meta, [x, gy], codec="none"), timeout=10)
        assert tagged.meta["version"] == 0 and tagged.meta["added"] is True
        torch.testing.assert_close(tagged.tensors[0], x_ref.grad, rtol=1e-5, atol=1e-7)
        untagged = await backward(kit, client, peer, 1, 1)
        assert untagged.meta["version"] == 1
        assert peer.service.accumulator.progress(1).ids == {4, 5}
    finally:
        await peer.close()
