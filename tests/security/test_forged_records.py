"""A real peer process forges DHT records while a trainer finds its stage peers through the DHT:
it stores announcements under an honest stage peer's subkey that point at an address of its own.
Storers refuse them, the trainer never sees them, training goes on, and the forger is named."""

import asyncio
import logging
import time

import pytest

from swarmd.dht import DHTNode
from swarmd.dht import protocol as dht_protocol
from swarmd.dht.records import sign_record
from swarmd.dht.rpc_network import RpcNetwork
from swarmd.jobs.directory import DHTStageDirectory, announcement_value, stage_key
from transport.identity import Identity
from transport.rpc import Message, RpcConfig

pytestmark = pytest.mark.slow

STEPS = 8


async def dht_node() -> DHTNode:
    identity = Identity.generate()
    node = DHTNode(identity, await RpcNetwork.listen(identity, rpc=RpcConfig(identity=identity)))
    await node.start()
    return node


async def test_forged_stage_announcements_are_refused_and_named_while_training_goes_on(hostile_swarm, kit, caplog):
    """Steps: a DHT of two real nodes over TCP (a storer S and the trainer's node T, bootstrapped
    from S); two honest peers per stage, each storing its signed stage announcement on S; a
    `forge` process storing, every 50 ms, announcements under the first stage-0 peer's subkey that
    point at 127.0.0.1:9 (the victim's public key with the forger's signature, and the forger's own
    signature on the victim's subkey); a trainer that finds its peers through T runs 8 steps.
    Expected: every step commits whole; S refused every forged record (bad_signature,
    wrong_owner; never ok), counts them in refused_records, and logged the forger's peer id; the
    stage-0 peers T lists are the two honest ones at their real addresses."""
    from swarmd.train.trainer import Trainer

    caplog.set_level(logging.WARNING, logger="swarmd.dht.node")
    storer = await dht_node()
    reader = await dht_node()
    try:
        swarm, data, pool = await hostile_swarm(
            2, 0, "forge", steps=STEPS, rpc={"rate_limit_per_s": 1000.0}, target=lambda s: storer.address,
            victim=lambda s: next(p for p in s.honest if p.stage == 0).identity.public_key)
        forger = swarm.hostile[0]
        victim = next(p for p in swarm.honest if p.stage == 0)
        for peer in swarm.honest:
            key = stage_key(kit.JOB_ID, peer.stage)
            value = announcement_value(peer.addr, {"samples_per_s": 0.0, "queue": 0, "step": 0, "state": "serving"})
            record = sign_record(peer.identity, key, peer.peer_id, value, time.time() + 600)
            reply = await peer.pool.call(storer.address, dht_protocol.STORE,
                                         Message(dht_protocol.store_request(key, [record])), timeout=10)
            assert reply.meta["results"] == ["ok"]
        assert await reader.bootstrap([storer.address]) == 1

        directory = DHTStageDirectory(reader, ttl_s=0.2)
        trainer = Trainer(swarm.spec, kit.JOB_ID, directory, pool, data, config=kit.TRAINER)
        events = await asyncio.wait_for(trainer.run(0, STEPS), 120)
        assert [e.step for e in events] == list(range(STEPS))
        for e in events:
            assert e.stage_samples == (swarm.spec.batch.global_samples,) * 2 and e.duplicates == (0, 0), e
        listed = {(p.peer_id, p.addr) for p in await directory.peers(kit.JOB_ID, 0)}
        seen = await forger.finish()
        print("forger saw", seen, "; storer refused", storer.refused_records)

        assert listed == {(p.peer_id, p.addr) for p in swarm.honest if p.stage == 0}
        assert "ok" not in seen and seen.get("bad_signature", 0) > 0 and seen.get("wrong_owner", 0) > 0, seen
        assert storer.refused_records.get("bad_signature", 0) >= seen["bad_signature"]
        assert storer.refused_records.get("wrong_owner", 0) >= seen["wrong_owner"]
        named = [r.getMessage() for r in caplog.records if forger.transport_id.hex() in r.getMessage()]
        assert len(named) == 1 and "forged record" in named[0] and victim.peer_id.hex() in named[0], caplog.text
    finally:
        await reader.stop()
        await storer.stop()
