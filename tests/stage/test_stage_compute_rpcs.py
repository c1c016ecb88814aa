"""stage.forward / backward / forward_backward / info over real loopback sockets, compared with
direct calls of the same stage module, plus the typed refusals (busy, bad_input, not_serving)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from swarmd.directory import StaticDirectory
from swarmd.model import build_stage
from swarmd.stage import StageLimits
from transport.errors import RemoteError
from transport.rpc import Message


B, T, C = 2, 16, 32


def reference(spec, stage):
    return build_stage(spec.model.config, stage, spec.pipeline.stages, spec.seed)


def ids(seed, b=B):
    return torch.randint(0, 256, (b, T), generator=torch.Generator().manual_seed(seed))


def acts(seed, b=B):
    return torch.randn(b, T, C, generator=torch.Generator().manual_seed(seed))


async def test_forward_backward_and_forward_backward_equal_direct_module_calls(client, kit):
    """Steps: serve stages 0 and 2 of a 3-stage job (codec none, batching off); call forward and
    backward on stage 0 and forward_backward on the last; compare with the same module called
    directly. Expected: identical tensors, and the loss equal to the module's sample-summed loss."""
    spec = kit.make_spec(stages=3)
    directory = StaticDirectory()
    limits = StageLimits(max_batch=1, sync_interval_s=60.0)
    first = await kit.start_peer(spec, 0, 1, directory, limits)
    last = await kit.start_peer(spec, 2, 2, directory, limits)
    try:
        x, gy = ids(1), acts(2)
        y = (await kit.call(client, first, "stage.forward", 0, 0, 0, [x])).tensors[0]
        ref0 = reference(spec, 0)
        with torch.no_grad():
            assert torch.equal(y, ref0(x))
        reply = await kit.call(client, first, "stage.backward", 0, 0, 0, [x, gy])
        assert reply.tensors == [] and reply.meta["duplicate"] is False

        h, targets = acts(3), ids(4)
        reply = await kit.call(client, last, "stage.forward_backward", 2, 0, 1, [h, targets])
        ref2 = reference(spec, 2)
        h_ref = h.clone().requires_grad_(True)
        loss = ref2(h_ref, targets)
        loss.backward()
        assert reply.meta["loss_sum"] == loss.item()
        assert torch.equal(reply.tensors[0], h_ref.grad)
        # The peer's accumulated gradient sums equal the direct call's .grad.
        acc = last.service.accumulator.progress(0)
        assert acc.ids == {1} and acc.samples == B
        taken = last.service.accumulator.take(0)
        for p, g in zip(ref2.parameters(), taken.grads):
            assert torch.equal(p.grad, g)
    finally:
        await first.close()
        await last.close()


async def test_middle_stage_backward_returns_the_input_gradient(client, kit):
    spec = kit.make_spec(stages=3)
    peer = await kit.start_peer(spec, 1, 1, StaticDirectory(), StageLimits(max_batch=1, sync_interval_s=60.0))
    try:
        x, gy = acts(5), acts(6)
        reply = await kit.call(client, peer, "stage.backward", 1, 0, 2, [x, gy])
        ref = reference(spec, 1)
        x_ref = x.clone().requires_grad_(True)
        ref(x_ref).backward(gy)
        assert torch.equal(reply.tensors[0], x_ref.grad)
        fwd = await kit.call(client, peer, "stage.forward", 1, 0, 2, [x])
        with torch.no_grad():
            assert torch.equal(fwd.tensors[0], ref(x))
    finally:
        await peer.close()


async def test_backward_is_idempotent_per_microbatch(client, kit):
    """Steps: the same backward (same mb) three times. Expected: the same grad_x each time, only the
    first accumulates (duplicate false, then true), the sum equals one direct backward."""
    spec = kit.make_spec(stages=3)
    peer = await kit.start_peer(spec, 1, 1, StaticDirectory(), StageLimits(max_batch=1, sync_interval_s=60.0))
    try:
        x, gy = acts(7), acts(8)
        replies = [await kit.call(client, peer, "stage.backward", 1, 0, 3, [x, gy]) for _ in range(3)]
        assert [r.meta["duplicate"] for r in replies] == [False, True, True]
        assert all(torch.equal(r.tensors[0], replies[0].tensors[0]) for r in replies)
        ref = reference(spec, 1)
        ref(x).backward(gy)
        taken = peer.service.accumulator.take(0)
        assert taken.ids == {3} and taken.samples == B
        for p, g in zip(ref.parameters(), taken.grads):
            assert torch.equal(p.grad, g)
        assert peer.service.core.repeats(0) == 2
    finally:
        await peer.close()


async def test_batched_microbatches_are_answered_separately(client, kit):
    """Steps: 4 concurrent forward_backward calls on the last stage with batching up to 4.
    Expected: each loss and input gradient matches the single-microbatch direct call (1e-5), and
    the accumulated sum matches the sum of the four direct backwards."""
    spec = kit.make_spec(stages=2)
    peer = await kit.start_peer(spec, 1, 1, StaticDirectory(), StageLimits(max_batch=4, workers=1, sync_interval_s=60.0))
    try:
        inputs = [(acts(10 + m), ids(20 + m)) for m in range(4)]
        replies = await asyncio.gather(*(kit.call(client, peer, "stage.forward_backward", 1, 0, m, [h, t])
                                         for m, (h, t) in enumerate(inputs)))
        ref = reference(spec, 1)
        for (h, t), reply in zip(inputs, replies):
            h_ref = h.clone().requires_grad_(True)
            loss = ref(h_ref, t)
            loss.backward()
            assert abs(reply.meta["loss_sum"] - loss.item()) <= 1e-5 * abs(loss.item())
            torch.testing.assert_close(reply.tensors[0], h_ref.grad, rtol=1e-5, atol=1e-7)
        taken = peer.service.accumulator.take(0)
        assert taken.ids == {0, 1, 2, 3}
        for p, g in zip(ref.parameters(), taken.grads):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)
    finally:
        await peer.close()


async def test_full_queue_answers_busy_at_once(client, kit):
    """Steps: queue_size 2, one worker; a compute thread blocked by holding the parameter guard's
    write side; send 5 forwards. Expected: 2 are queued (the worker holds one more), the rest get
    `busy` immediately, and all queued ones succeed once the guard is released."""
    spec = kit.make_spec(stages=3)
    limits = StageLimits(queue_size=2, workers=1, max_batch=1, sync_interval_s=60.0)
    peer = await kit.start_peer(spec, 1, 1, StaticDirectory(), limits)
    try:
        guard = peer.service.guard
        blocker = guard.write()
        blocker.__enter__()  # the worker's next batch waits on the guard
        try:
            calls = [asyncio.create_task(kit.call(client, peer, "stage.forward", 1, 0, 0, [acts(0)]))]
            while peer.service.executor.depth == 0:  # the worker took it and waits on the guard
                await asyncio.sleep(0.01)
            calls += [asyncio.create_task(kit.call(client, peer, "stage.forward", 1, 0, m % 4, [acts(m)]))
                      for m in range(1, 5)]
            done: set[asyncio.Task] = set()
            pending = set(calls)
            async with asyncio.timeout(10):
                while len(done) < 2:  # the two past the queue's room
                    finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    done |= finished
            refused = [t for t in done if isinstance(t.exception(), RemoteError)]
            assert len(refused) == 2 and all(t.exception().code == "busy" for t in refused)
            assert len(pending) == 3
            assert peer.service.announcement()["queue"] == 3
        finally:
            await asyncio.to_thread(blocker.__exit__, None, None, None)
        results = await asyncio.gather(*pending)
        assert all(r.tensors[0].shape == (B, T, C) for r in results)
    finally:
        await peer.close()


@pytest.mark.parametrize("case", ["shape", "dtype", "nan", "inf_grad", "tensor_count", "mb_of_other_step",
                                  "token_out_of_vocab", "samples"])
async def test_bad_input_is_refused_before_compute(client, kit, case):
    spec = kit.make_spec(stages=3)
    first = await kit.start_peer(spec, 0, 1, StaticDirectory(), StageLimits(sync_interval_s=60.0))
    middle = await kit.start_peer(spec, 1, 2, StaticDirectory(), StageLimits(sync_interval_s=60.0))
    try:
        peer, stage, method, tensors, mb = middle, 1, "stage.forward", [acts(1)], 0
        if case == "shape":
            tensors = [torch.zeros(B, T, C + 1)]
        elif case == "dtype":
            tensors = [acts(1).double()]
        elif case == "nan":
            x = acts(1)
            x[0, 0, 0] = float("nan")
            tensors = [x]
        elif case == "inf_grad":
            gy = acts(2)
            gy[1, 2, 3] = float("inf")
            method, tensors = "stage.backward", [acts(1), gy]
        elif case == "tensor_count":
            method = "stage.backward"
        elif case == "mb_of_other_step":
            mb = 99
        elif case == "token_out_of_vocab":
            bad = ids(1)
            bad[0, 0] = 256
            peer, stage, tensors = first, 0, [bad]
        with pytest.raises(RemoteError) as info:
            if case == "samples":
                meta = {**kit.call_meta(stage, 0, mb, B), "samples": 3}
                await client.call(peer.addr, method, Message(meta, tensors, codec="none"), timeout=5)
            else:
                await kit.call(client, peer, method, stage, 0, mb, tensors)
        assert info.value.code == "bad_input", info.value
        print(case, "->", info.value.message)
        assert peer.service.executor.samples_per_s == 0.0  # nothing was computed
        assert peer.service.accumulator.progress(0).ids == frozenset()
    finally:
        await first.close()
        await middle.close()


async def test_not_serving_and_info(client, kit):
    spec = kit.make_spec(stages=3)
    peer = await kit.start_peer(spec, 1, 1, StaticDirectory(), StageLimits(sync_interval_s=60.0))
    try:
        with pytest.raises(RemoteError) as info:
            await kit.call(client, peer, "stage.forward", 2, 0, 0, [acts(1)])
        assert info.value.code == "not_serving"
        with pytest.raises(RemoteError) as info:
            meta = {**kit.call_meta(1, 0, 0, B), "job": b"\x00" * 32}
            await client.call(peer.addr, "stage.forward", Message(meta, [acts(1)], codec="none"), timeout=5)
        assert info.value.code == "not_serving"
        await kit.call(client, peer, "stage.backward", 1, 0, 1, [acts(1), acts(2)])
        reply = await client.call(peer.addr, "stage.info", Message({"job": kit.JOB, "stage": 1}), timeout=5)
        meta = reply.meta
        assert meta["step"] == 0 and meta["state"] == "serving" and meta["queue"] == 0
        assert meta["accumulated_samples"] == B and meta["samples_per_s"] > 0
    finally:
        await peer.close()


async def test_a_large_non_finite_input_is_refused_by_the_threaded_check(client, kit):
    """256 samples x 16 x 32 is past INLINE_CHECK_ELEMENTS, so the value check runs in a thread."""
    from swarmd.stage.service import INLINE_CHECK_ELEMENTS

    spec = kit.make_spec(stages=3, global_samples=256, microbatch=256)
    peer = await kit.start_peer(spec, 1, 1, StaticDirectory(), StageLimits(sync_interval_s=60.0))
    try:
        x = acts(1, b=256)
        assert x.numel() > INLINE_CHECK_ELEMENTS
        x[255, 15, 31] = float("-inf")
        with pytest.raises(RemoteError) as info:
            await kit.call(client, peer, "stage.forward", 1, 0, 0, [x])
        assert info.value.code == "bad_input" and "non-finite" in info.value.message
        x[255, 15, 31] = 0.0
        reply = await kit.call(client, peer, "stage.forward", 1, 0, 0, [x])
        assert reply.tensors[0].shape == (256, T, C)
    finally:
        await peer.close()


async def test_two_stages_served_behind_one_router(client, kit):
    """A daemon hosting stages 0 and 1 of a job: one Router, one RpcServer, two services; each
    call reaches the stage its meta names, and stopping one leaves the other serving."""
    from swarmd.stage import StageServer, StageService
    from transport.rpc import Pool, Router, RpcServer

    spec = kit.make_spec(stages=3)
    router = Router()
    rpc = await RpcServer.serve_tcp(router, "127.0.0.1", 0)
    pool = Pool()
    addr = f"{rpc.address[0]}:{rpc.address[1]}"
    services = [StageService(spec, kit.JOB, i, bytes([i + 1]) * 32, router, pool, StaticDirectory(), address=addr,
                             limits=StageLimits(sync_interval_s=60.0)) for i in (0, 1)]
    try:
        for service in services:
            await service.start()
        assert services[0].server is services[1].server is StageServer.for_router(router)
        at = SimpleNamespace(addr=addr)  # what kit.call needs of a peer
        y0 = await kit.call(client, at, "stage.forward", 0, 0, 0, [ids(1)])
        y1 = await kit.call(client, at, "stage.forward", 1, 0, 0, [y0.tensors[0]])
        with torch.no_grad():
            assert torch.equal(y1.tensors[0], reference(spec, 1)(reference(spec, 0)(ids(1))))
        await services[0].stop()
        with pytest.raises(RemoteError) as info:
            await kit.call(client, at, "stage.forward", 0, 0, 0, [ids(1)])
        assert info.value.code == "not_serving"
        await kit.call(client, at, "stage.forward", 1, 0, 0, [y0.tensors[0]])
    finally:
        for service in services:
            await service.stop()
        await rpc.close()
        await pool.close()
