"""Flow on one connection over loopback: huge tensors, small calls overtaking them, cancellation and
deadlines reaching the handler, and cancellation at every await of a call leaving nothing behind."""

from __future__ import annotations

import asyncio

import pytest
import torch

from transport.errors import ConnectionLost, DeadlineExceeded, RemoteError
from transport.limits import MiB, Limits
from transport.rpc import Message, Pool, Request, Router, RpcConfig, RpcServer

torch.set_num_threads(1)


class Probe:
    """What the server's handlers saw, for tests to assert on."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.finished: list[str] = []
        self.produced = 0


def _router(probe: Probe) -> Router:
    router = Router()

    async def echo(req: Request) -> Message:
        return Message(dict(req.meta), req.tensors, codec="none")

    async def block(req: Request) -> Message:
        probe.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            probe.cancelled.set()
            raise
        return Message()

    async def ticks(req: Request):
        for i in range(req.meta["n"]):
            await asyncio.sleep(0)
            probe.produced += 1
            yield Message({"i": i}, [torch.zeros(req.meta.get("size", 1))], codec="none")
        probe.finished.append("ticks")

    async def slow(req: Request) -> Message:
        probe.started.set()
        await asyncio.sleep(0.3)
        return Message({"slow": "done"})

    router.unary("echo", echo)
    router.unary("block", block)
    router.unary("slow", slow)
    router.stream("ticks", ticks)
    return router


@pytest.fixture
async def setup():
    probe = Probe()
    srv = await RpcServer.serve_tcp(_router(probe), "127.0.0.1", 0)
    pool = Pool(RpcConfig())
    try:
        yield srv, pool, probe
    finally:
        await pool.close()
        await srv.close()


@pytest.mark.slow
async def test_256_mb_tensor_round_trips_exactly(setup):
    srv, pool, _ = setup
    big = torch.arange(64 * 1024 * 1024, dtype=torch.float32)  # 256 MiB
    reply = await pool.call(srv.address, "echo", Message({"big": True}, [big], codec="none"), timeout=120)
    assert reply.meta == {"big": True}
    assert reply.tensors[0].shape == big.shape and torch.equal(reply.tensors[0], big)


async def test_small_call_overtakes_a_huge_transfer_on_the_same_connection(setup):
    """Steps: start a 128 MiB echo; once part of its request is on the wire, make a small call.
    Expected: the small call's answer arrives while the big request is still being sent (the
    writer interleaves chunks), on the same connection."""
    srv, pool, _ = setup
    conn = await pool.connect(srv.address)
    big = torch.ones(32 * 1024 * 1024)
    big_call = asyncio.create_task(pool.call(srv.address, "echo", Message({}, [big], codec="none"), timeout=120))
    # Wait until the big request is partly written: some of its bytes left, most still queued.
    while not big.nbytes // 2 < conn.buffered_bytes < big.nbytes - 4 * MiB:
        await asyncio.sleep(0.001)
    small = await pool.call(srv.address, "echo", Message({"small": 1}), timeout=60)
    assert small.meta == {"small": 1}
    # Overtaken, not merely finished first: the big request itself is still being written.
    assert conn.buffered_bytes > 0
    assert not big_call.done()
    assert torch.equal((await big_call).tensors[0], big)
    assert srv.connections == 1


async def test_caller_cancellation_cancels_the_server_handler(setup):
    srv, pool, probe = setup
    call = asyncio.create_task(pool.call(srv.address, "block", timeout=60))
    await asyncio.wait_for(probe.started.wait(), 10)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await asyncio.wait_for(probe.cancelled.wait(), 10)


async def test_server_enforces_the_deadline_from_the_header(setup):
    """The caller keeps waiting past its own deadline; the server must still stop the handler at
    the deadline it was sent and answer deadline_exceeded."""
    srv, pool, probe = setup
    conn = await pool.connect(srv.address)
    loop = asyncio.get_running_loop()
    rid = conn._calls.start(stream=False)
    try:
        await conn._calls.send_request(rid, "block", Message(), loop.time() + 0.2)
        with pytest.raises(RemoteError) as err:
            await asyncio.wait_for(conn._calls.answer_message(await conn._calls.next_frame(rid)), 10)
    finally:
        conn._calls.end(rid)
    assert err.value.code == "deadline_exceeded"
    assert probe.cancelled.is_set()


async def test_client_deadline_is_typed_and_cancels_the_handler(setup):
    srv, pool, probe = setup
    with pytest.raises(DeadlineExceeded):
        await pool.call(srv.address, "block", timeout=0.2)
    await asyncio.wait_for(probe.cancelled.wait(), 10)


async def test_leaving_a_stream_early_stops_the_server_generator(setup):
    srv, pool, probe = setup
    async with pool.stream(srv.address, "ticks", Message({"n": 10**9}), timeout=30) as items:
        async for item in items:
            if item.meta["i"] == 3:
                break
    # The server is not producing a billion items: a following call is answered promptly.
    assert (await pool.call(srv.address, "echo", Message({"after": 1}), timeout=10)).meta == {"after": 1}
    assert "ticks" not in probe.finished


async def test_a_consumer_that_stops_reading_stops_the_stream_producer():
    """Steps: stream 2000 items of 1 MiB with 4 MiB limits on undelivered items (client) and
    in-flight bytes (server); take one item and pause. Expected: the server's generator stops far
    short of the end (our queue, the server's budget and the kernel's socket buffers are all that
    fill), and the stream resumes when the consumer does."""
    probe = Probe()
    limits = Limits(max_inflight_bytes=4 * MiB)
    srv = await RpcServer.serve_tcp(_router(probe), "127.0.0.1", 0, RpcConfig(limits=limits))
    pool = Pool(RpcConfig(max_undelivered_bytes=4 * MiB))
    try:
        async with pool.stream(srv.address, "ticks", Message({"n": 2000, "size": 256 * 1024}), timeout=60) as items:
            await anext(items)
            await asyncio.sleep(1.0)
            stalled_at = probe.produced
            assert stalled_at < 64
            for _ in range(100):
                await anext(items)
            assert probe.produced > stalled_at
    finally:
        await pool.close()
        await srv.close()


async def test_server_close_lets_running_calls_finish_and_says_goodbye(setup):
    """Steps: a call is running (0.3 s handler) when the server closes. Expected: the call still
    gets its answer, and the pool's next call finds the connection gone rather than hanging."""
    srv, pool, probe = setup
    running = asyncio.create_task(pool.call(srv.address, "slow", timeout=10))
    await asyncio.wait_for(probe.started.wait(), 10)
    await srv.close()
    assert (await running).meta == {"slow": "done"}
    with pytest.raises(ConnectionLost):
        await pool.call(srv.address, "echo", timeout=5)


async def _idle(pool: Pool, srv: RpcServer) -> None:
    """Wait until neither side holds anything for a call: no pending calls, queued frames,
    reserved bytes or running handlers."""
    conn = await pool.connect(srv.address)
    (server_conn,) = srv._connections
    for _ in range(2000):
        if not (conn._calls or conn._sender.outbox or conn.buffered_bytes or server_conn._dispatch.running):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"the call left state behind after being cancelled: {len(conn._calls)} {bool(conn._sender.outbox)} {conn._sender.budget.used} {conn.buffered_bytes} {server_conn._dispatch.running}")


@pytest.mark.parametrize("kind", ["unary", "stream"])
async def test_cancelling_at_every_await_leaves_the_connection_clean(setup, kind):
    """Steps: for k = 0, 1, 2, ...: start a call with a 2 MiB tensor (chunked, encoded in a worker
    thread), let the loop run k steps, cancel it. Expected: each cancellation either wins or the
    call completes; afterwards nothing is left on either side and the next call works. Stops at the
    first k where the call completed before the cancel."""
    srv, pool, _ = setup
    await pool.connect(srv.address)
    tensor = torch.ones(512 * 1024)

    async def one_call():
        if kind == "unary":
            return await pool.call(srv.address, "echo", Message({}, [tensor], codec="none"), timeout=30)
        async with pool.stream(srv.address, "ticks", Message({"n": 3, "size": 512 * 1024}), timeout=30) as items:
            return [m async for m in items]

    for steps in range(10_000):
        task = asyncio.create_task(one_call())
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        else:
            break
        await _idle(pool, srv)
        check = await pool.call(srv.address, "echo", Message({"k": steps}), timeout=10)
        assert check.meta == {"k": steps}
    else:
        raise AssertionError("the call never completed")
    assert steps > 3  # the call really had awaits to cancel at
    await _idle(pool, srv)


async def test_messages_larger_than_the_readers_window_still_flow():
    """A reader announcing a 4 KiB window (`max_inflight_bytes`) streams 8 KiB items and echoes a
    16 KiB tensor. The sender reserved min(size, window) before encoding and then asked for the
    rest while holding it, which the budget never grants past its capacity: the stream stopped
    after the first item, for ever (found by the state-stream adversary test). Expected: every item
    and the echo arrive; an oversized message goes alone, slowly, never deadlocked."""
    probe = Probe()
    srv = await RpcServer.serve_tcp(_router(probe), "127.0.0.1", 0)
    pool = Pool(RpcConfig(limits=Limits(max_inflight_bytes=4096)))
    try:
        async with asyncio.timeout(20):
            async with pool.stream(srv.address, "ticks", Message({"n": 5, "size": 2048}), timeout=20) as items:
                got = [item.meta["i"] async for item in items]
            assert got == [0, 1, 2, 3, 4]
            big = torch.arange(4096, dtype=torch.float32)
            echoed = await pool.call(srv.address, "echo", Message({"x": 1}, [big], codec="none"), timeout=20)
            assert torch.equal(echoed.tensors[0], big)
    finally:
        await pool.close()
        await srv.close()
