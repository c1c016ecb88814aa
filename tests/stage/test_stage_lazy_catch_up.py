"""An idle stage peer catches up lazily (issue 14, slow_peer goodput): a peer that gets no compute
call for `idle_after_steps` of its steps (the trainers withhold it for slowness) stops downloading
its stage's state every step its mates commit, catches up every `idle_catch_up_s` instead, and at
once when a compute call for a later step comes (the call waits for it). Meanwhile stage.info shows
it `behind`, and stage.evaluate and stage.state refuse it. Real peers on loopback: A gets every microbatch, B none
(as a withheld peer), a 3-stage job's middle stage with Adam (optimizer state is downloaded too)."""

from __future__ import annotations

import asyncio
import dataclasses

import torch
from waiting import until

from swarmd.directory import StaticDirectory
from swarmd.stage.state import download
from transport.errors import RemoteError
from transport.rpc import Message

B, T, C = 2, 16, 32
STAGE = 1
IDLE_AFTER = 2


def inputs(step: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + 10 * step + m)
    return torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)


async def start(kit, idle_catch_up_s: float):
    spec = kit.make_spec(stages=3, optim="adamw")
    limits = dataclasses.replace(kit.FAST, idle_after_steps=IDLE_AFTER, idle_catch_up_s=idle_catch_up_s)
    directory = StaticDirectory()
    a = await kit.start_peer(spec, STAGE, 1, directory, limits)
    b = await kit.start_peer(spec, STAGE, 2, directory, limits)
    return a, b


async def info(client, peer) -> dict:
    return (await client.call(peer.addr, "stage.info", Message({"job": peer.service.job_id, "stage": STAGE},
                                                               codec="none"), timeout=5)).meta


async def drive_until_behind(kit, client, a, b, most_steps: int = 12) -> int:
    """Commit steps on A alone, each once B has followed it or shows behind (so a peer that
    downloads every step does so every step here); returns A's step once B is behind."""
    for step in range(most_steps):
        await asyncio.gather(*(kit.call(client, a, "stage.backward", STAGE, step, step * 4 + m, list(inputs(step, m)))
                               for m in range(4)))
        await until(lambda: a.service.committed > step, 10, f"A to commit step {step}")
        await until(lambda: b.service.committed == a.service.committed or b.service.core.behind(), 10,
                    f"B to follow A to step {step + 1} or to fall behind")
        if b.service.core.behind():
            return a.service.committed
    raise AssertionError(f"B never fell behind in {most_steps} steps: it downloads every step "
                         f"({b.service.catch_ups} catch-ups)")


def same_state(a, b) -> bool:
    params = all(torch.equal(p, q) for p, q in zip(a.service.stage.parameters(), b.service.stage.parameters()))
    return params and a.service.digest == b.service.digest


async def test_an_idle_peer_stops_downloading_each_step_and_catches_up_every_idle_catch_up_s(kit, client):
    """Steps: A commits steps with every microbatch, B gets none; each step waits for B to follow
    (download) or to show behind. Then nothing more is sent. Expected: B follows by download for
    idle_after_steps steps, then shows `behind` in stage.info (a catch_ups count of those
    downloads) while A goes on; within idle_catch_up_s of its last catch-up it downloads once more,
    ending on A's step and state, and shows `serving` again."""
    a, b = await start(kit, idle_catch_up_s=1.5)
    try:
        loop = asyncio.get_running_loop()
        began = loop.time()
        step = await drive_until_behind(kit, client, a, b)
        shown = await info(client, b)
        assert shown["state"] == "behind" and shown["step"] < step
        assert shown["catch_ups"] == b.service.catch_ups <= IDLE_AFTER + 1 + (loop.time() - began) / 1.5
        assert (await info(client, a))["state"] == "serving"
        downloads = b.service.catch_ups
        await until(lambda: b.service.committed == step, 1.5 + 5, "B's lazy catch-up")
        assert b.service.catch_ups == downloads + 1
        await until(lambda: same_state(a, b), 5, "B's state to equal A's")
        assert (await info(client, b))["state"] == "serving"
    finally:
        await a.close()
        await b.close()


async def test_a_call_for_a_later_step_waits_for_the_catch_up_and_answers_on_the_mates_parameters(kit, client):
    """Steps: as above until B is behind (its next lazy catch-up a minute away), then a forward and
    a backward of A's current step to B, as a trainer's probe. Expected: each waits for B's one
    download and succeeds (the backward adds its gradient); the forward's reply says how long B
    caught up first, its activations equal A's for the same input bit for bit, and B then holds
    A's state."""
    a, b = await start(kit, idle_catch_up_s=60.0)
    try:
        step = await drive_until_behind(kit, client, a, b)
        downloads = b.service.catch_ups
        x, gy = inputs(step, 0)
        on_b = await kit.call(client, b, "stage.forward", STAGE, step, step * 4, [x])
        on_a = await kit.call(client, a, "stage.forward", STAGE, step, step * 4, [x])
        assert on_b.meta["version"] == on_a.meta["version"] == step
        # How long B caught up first, for a trainer's probe not to be judged on it; A did not.
        assert on_b.meta["caught_up_s"] > 0 and "caught_up_s" not in on_a.meta
        assert torch.equal(on_b.tensors[0], on_a.tensors[0])
        assert b.service.catch_ups == downloads + 1 and b.service.committed == step
        assert same_state(a, b)
        added = await kit.call(client, b, "stage.backward", STAGE, step, step * 4, [x, gy])
        assert added.meta["added"] is True and not b.service.core.behind()
    finally:
        await a.close()
        await b.close()


async def test_a_peer_behind_refuses_evaluation_and_its_state(kit, client):
    """Steps: as above until B is behind; stage.evaluate of B's own step on B and on A; a download
    of the stage's state (`stage.state`, what a joiner or an export reads) from B and from A.
    Expected: B refuses both, saying it is behind (evaluation `not_ready`: a trainer asks another;
    the state `busy`: a reader tries another peer), so no one takes its old parameters for its
    stage's; A answers both, its state at its step."""
    a, b = await start(kit, idle_catch_up_s=60.0)
    try:
        await drive_until_behind(kit, client, a, b)
        x = inputs(0, 0)[0]
        meta = {"job": kit.JOB, "stage": STAGE, "version": b.service.committed, "samples": B}
        try:
            await client.call(b.addr, "stage.evaluate", Message(meta, [x], codec="none"), timeout=5)
            raise AssertionError("a peer behind its mates evaluated")
        except RemoteError as exc:
            assert exc.code == "not_ready" and "behind" in exc.message
        meta["version"] = a.service.committed
        assert (await client.call(a.addr, "stage.evaluate", Message(meta, [x], codec="none"), timeout=5)).tensors
        try:
            await download(client, b.addr, kit.JOB, STAGE, b.service.stage, 10)
            raise AssertionError("a peer behind its mates served its state")
        except RemoteError as exc:
            assert exc.code == "busy" and "behind" in exc.message
        assert (await download(client, a.addr, kit.JOB, STAGE, a.service.stage, 10)).step == a.service.committed
    finally:
        await a.close()
        await b.close()


async def test_an_idle_peer_answers_a_long_poll_at_once(kit, client):
    """Steps: B falls behind as above; a trainer long-polls both for a commit past A's step, with
    wait_s 30. Expected: B answers at once (idle, it commits only at its next catch-up: waiting
    would hold the trainer's commit watch, measured 0.5 s a step in the slow-peer bench), A keeps
    waiting as a working peer does."""
    a, b = await start(kit, idle_catch_up_s=60.0)
    try:
        step = await drive_until_behind(kit, client, a, b)
        meta = {"job": kit.JOB, "stage": STAGE, "until_step": step, "wait_s": 30.0}
        polls = [asyncio.create_task(client.call(p.addr, "stage.info", Message(meta, codec="none"), timeout=40))
                 for p in (a, b)]
        b_answer = await asyncio.wait_for(polls[1], 10)
        assert b_answer.meta["state"] == "behind" and not polls[0].done()
        polls[0].cancel()
        await asyncio.gather(polls[0], return_exceptions=True)
    finally:
        await a.close()
        await b.close()
