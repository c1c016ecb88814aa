"""Attackers that never get past the hello, each a real process aimed at an honest stage peer
while a trainer trains through it: one claiming another peer's id without its key (spoofed peer
id), one dialling a private swarm with a key of its own (outsider), one holding connections open
with a byte now and then (slow-loris). Each time training
keeps committing whole steps, the attacker gets nothing answered, and the target's log names it."""

import asyncio
import logging

import pytest
from waiting import until

pytestmark = pytest.mark.slow

STEPS = 8


async def wait_for_log(caplog, predicate, what: str, timeout: float = 60) -> list[str]:
    """Lines matching `predicate`, once there is one (an attack's effect shows in the log)."""
    return await until(lambda: [r.getMessage() for r in caplog.records if predicate(r.getMessage())], timeout,
                       f"a log line {what}", interval=0.1, detail=lambda: caplog.text)


def train_and_check(swarm, kit, data, pool):
    from swarmd.train.trainer import Trainer

    async def run():
        trainer = Trainer(swarm.spec, kit.JOB_ID, swarm.directory, pool, data, config=kit.TRAINER)
        events = await asyncio.wait_for(trainer.run(0, STEPS), 120)
        assert [e.step for e in events] == list(range(STEPS))
        for e in events:
            assert e.stage_samples == (swarm.spec.batch.global_samples,) * 2 and e.duplicates == (0, 0), e
        return trainer
    return run()


async def test_a_spoofed_peer_id_is_refused_in_the_hello_while_training_goes_on(hostile_swarm, kit, caplog):
    """Steps: two honest peers per stage, each with its own identity; a `spoof` process dials one
    stage-0 peer again and again claiming the peer id of that peer's stage-mate (the mate's public
    key, its own private key) and tries stage.info; a trainer runs 8 steps meanwhile.
    Expected: every step commits whole; not one spoofed call was answered, all failed in the
    hello; the target logged the refusal naming the claimed (victim's) peer id and the
    attacker's address; the victim itself kept serving its stage (it committed every step)."""
    caplog.set_level(logging.INFO, logger="transport.connection")

    def stage0(swarm):
        return [p for p in swarm.honest if p.stage == 0]

    swarm, data, pool = await hostile_swarm(
        2, 0, "spoof", steps=STEPS, rpc={"rate_limit_per_s": 1000.0},
        target=lambda s: stage0(s)[0].addr, victim=lambda s: stage0(s)[1].identity.public_key)
    target, victim = stage0(swarm)
    victim_id = victim.peer_id
    assert swarm.hostile[0].transport_id == victim_id  # it does claim the victim's id
    await train_and_check(swarm, kit, data, pool)
    named = await wait_for_log(caplog, lambda m: victim_id.hex() in m and "does not verify" in m,
                               "naming the spoofed id")
    seen = await swarm.hostile[0].finish()
    print("spoofer saw", seen, "; target logged:", named[0])
    assert seen["answered"] == 0 and seen["other"] == 0 and seen["refused_hello"] > 0, seen
    assert "hello with ('127.0.0.1'" in named[0]
    # The trainer moves on once the stage reports the last commit; a mate may apply it a moment later.
    await until(lambda: len(victim.service.records) >= STEPS, 10, "the victim to commit the last step")
    assert [r.step for r in victim.service.records] == list(range(STEPS))
    assert victim_id not in target.rpc.peer_calls() or target.rpc.peer_calls()[victim_id].refused == 0


async def test_an_outsider_with_another_swarm_key_is_refused_while_training_goes_on(hostile_swarm, kit, caplog):
    """Steps: a private swarm (every honest server, pool and the trainer share one swarm key), two
    honest peers per stage; an `outsider` process with a key of its own dials one stage-0 peer again
    and again and tries stage.info; a trainer runs 8 steps meanwhile.
    Expected: every step commits whole; not one outsider call was answered, all failed in the
    hello; the target logged each refusal with the outsider's address and the reason."""
    caplog.set_level(logging.INFO, logger="transport.connection")
    swarm, data, pool = await hostile_swarm(
        2, 0, "outsider", steps=STEPS, rpc={"swarm_key": bytes(range(32))},
        target=lambda s: [p for p in s.honest if p.stage == 0][0].addr)
    await train_and_check(swarm, kit, data, pool)
    named = await wait_for_log(caplog, lambda m: "swarm key" in m and "hello with ('127.0.0.1'" in m,
                               "naming the outsider's address")
    seen = await swarm.hostile[0].finish()
    print("outsider saw", seen, "; target logged:", named[0])
    assert seen["answered"] == 0 and seen["other"] == 0 and seen["refused_hello"] > 0, seen


async def test_slowloris_connections_are_dropped_and_named_while_training_goes_on(hostile_swarm, kit, caplog):
    """Steps: two honest peers per stage whose servers give a hello 1 s and admit 4 unproven
    connections per source host; a `slowloris` process on 127.0.0.2 keeps 24 connections to one
    stage-0 peer trickling a byte every 0.2 s (reopening each one dropped); a trainer runs 8 steps.
    Expected: every step commits whole; the target dropped the attacker's connections both at
    its deadline (held, then closed) and at once (over the per-source quota), and logged both
    naming 127.0.0.2; the honest peers, all on 127.0.0.1, kept connecting and training."""
    caplog.set_level(logging.INFO, logger="transport.connection")
    rpc = {"handshake_timeout_s": 1.0, "max_unproven_per_source": 4}
    swarm, data, pool = await hostile_swarm(
        2, 0, "slowloris", steps=STEPS, rpc=rpc, target=lambda s: next(p.addr for p in s.honest if p.stage == 0))
    await train_and_check(swarm, kit, data, pool)
    overdue = await wait_for_log(caplog, lambda m: "127.0.0.2" in m and "no hello within 1.0 s" in m,
                                 "about a deadline drop")
    at_once = await wait_for_log(caplog, lambda m: "127.0.0.2" in m and "max_unproven_per_source" in m,
                                 "about a quota drop")
    seen = await swarm.hostile[0].finish()
    print("slow-loris saw", seen, "; target logged:", overdue[0], "|", at_once[0])
    assert seen["dropped_after_hold"] > 0 and seen["dropped_at_once"] > 0, seen
