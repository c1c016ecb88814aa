"""A real peer process floods an honest stage peer with RPCs while a trainer trains through that
peer: training keeps committing whole steps, the flooder is refused `rate_limited` and named in
the log, and no honest caller (trainer or stage-mate) is ever refused. The run also measures what
honest callers ask of one peer, the figure the daemon's default rate limit is checked against
(docs/security.md)."""

import asyncio
import logging
import time

import pytest

pytestmark = pytest.mark.slow

#: Well below the daemon's default (1000/s, burst 256) so a Python flooder on a shared 2-core
#: machine surely exceeds it, and still above what the fast-polling test trainer generates.
RATE = {"rate_limit_per_s": 300.0, "rate_limit_burst": 128}
STEPS = 12


async def test_an_rpc_flood_is_refused_and_named_while_training_goes_on(hostile_swarm, kit, caplog):
    """Steps: two honest peers per stage, every server limiting each peer to 300 calls/s (burst
    128); a `flood` process calls stage.info on one stage-0 peer from 8 loops for the whole run; a
    trainer runs 12 steps.
    Expected: steps 0..11 commit, each stage counting the whole global batch with no duplicates,
    and the flooded peer committed every one of them with its mate (2 members); the flooder's
    calls are mostly `rate_limited`, the flooded server counts them against the flooder's peer id
    and logs a line naming it; no other caller of any honest server (the trainer, stage-mates) was
    ever refused."""
    from swarmd.train.trainer import Trainer

    caplog.set_level(logging.WARNING, logger="transport.ratelimit")
    swarm, data, pool = await hostile_swarm(
        2, 0, "flood", steps=STEPS, rpc=RATE, target=lambda s: next(p.addr for p in s.honest if p.stage == 0))
    flooder = swarm.hostile[0]
    flooded = next(p for p in swarm.honest if p.stage == 0)
    trainer = Trainer(swarm.spec, kit.JOB_ID, swarm.directory, pool, data, config=kit.TRAINER)
    started = time.monotonic()
    events = await asyncio.wait_for(trainer.run(0, STEPS), 120)
    elapsed = time.monotonic() - started
    seen = await flooder.finish()
    print("flooder saw", seen, f"over a {elapsed:.1f} s run")

    assert [e.step for e in events] == list(range(STEPS))
    global_samples = swarm.spec.batch.global_samples
    for e in events:
        assert e.stage_samples == (global_samples,) * 2 and e.duplicates == (0, 0), e
    assert [(r.step, r.members) for r in flooded.service.records] == [(s, 2) for s in range(STEPS)]
    assert seen["rate_limited"] > 2 * seen["ok"] > 0, seen

    calls = flooded.rpc.peer_calls()
    assert calls[flooder.transport_id].refused == seen["rate_limited"], calls[flooder.transport_id]
    named = [r.getMessage() for r in caplog.records if flooder.transport_id.hex() in r.getMessage()]
    assert named and "rate limiting peer" in named[0], caplog.text

    for peer in swarm.honest:
        for key, counts in peer.rpc.peer_calls().items():
            if key == flooder.transport_id:
                continue
            rate = counts.allowed / elapsed
            print(f"stage {peer.stage} peer {peer.peer_id.hex()[:4]}: caller {key.hex()[:12]} made {counts.allowed} calls ({rate:.0f}/s mean), "
                  f"its bucket's lowest level {counts.lowest_tokens:.0f} of {RATE['rate_limit_burst']}")
            assert counts.refused == 0, (key.hex(), counts)
