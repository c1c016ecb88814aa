"""StageService.stop waits for the stage's compute and auxiliary threads: a batch under way when the
stage stops finishes first, and once `stop` returns no thread of the stage is left running."""

from __future__ import annotations

import asyncio
import threading

import torch
from waiting import until

from swarmd.directory import StaticDirectory
from swarmd.stage import StageLimits
from transport.errors import RemoteError

B, T, C = 2, 16, 32


def stage_threads(index: int) -> list[threading.Thread]:
    """The stage's compute pool ("stage1_0") and its auxiliary thread ("stage1-aux_0")."""
    return [t for t in threading.enumerate() if t.name.startswith(f"stage{index}_") or
            t.name.startswith(f"stage{index}-aux")]


async def test_stop_waits_for_the_batch_under_way_and_leaves_no_thread_of_the_stage(client, kit):
    """Steps: one compute worker; hold the parameter guard's write side so the worker's batch waits
    inside its compute thread; stop the stage. Expected: the caller is answered busy at once, `stop`
    does not return while the thread still runs, and once the guard is released it returns with
    every thread of the stage ended (before: `stop` returned at once, the thread still blocked)."""
    spec = kit.make_spec(stages=3)
    peer = await kit.start_peer(spec, 1, 1, StaticDirectory(), StageLimits(workers=1, max_batch=1,
                                                                          sync_interval_s=60.0))
    blocker = peer.service.guard.write()
    blocker.__enter__()
    released = False
    try:
        acts = torch.randn(B, T, C, generator=torch.Generator().manual_seed(0))
        call = asyncio.create_task(kit.call(client, peer, "stage.forward", 1, 0, 0, [acts]))
        await until(lambda: any(t.name.startswith("stage1_") for t in threading.enumerate()), 10,
                    "the compute thread to take the batch")
        stopping = asyncio.create_task(peer.service.stop())
        try:
            await call
        except RemoteError as exc:
            assert exc.code == "busy" and "stopping" in exc.message
        else:
            raise AssertionError("a call cut off by stop was answered")
        assert not stopping.done() and any(t.is_alive() for t in stage_threads(1))
        await asyncio.to_thread(blocker.__exit__, None, None, None)
        released = True
        await asyncio.wait_for(stopping, 10)
        assert str(peer.service.state) == "stopped"
        assert stage_threads(1) == []
    finally:
        if not released:
            blocker.__exit__(None, None, None)
        await peer.rpc.close()
        await peer.pool.close()
