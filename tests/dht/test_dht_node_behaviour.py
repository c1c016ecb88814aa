"""DHTNode behaviours on small in-memory swarms: bootstrap recovery, quotas, hostile replicas."""

import asyncio

import pytest

from swarmd.clock import VirtualClock, run_virtual
from swarmd.dht import DHTConfig, DHTNode, DHTUsageError, InMemoryFabric, dht_key
from swarmd.dht import protocol as P
from swarmd.dht.records import Record, sign_record
from swarmd.dht.simulation import build_swarm, sim_address
from transport.identity import Identity


def run(main):
    clock = VirtualClock()
    return run_virtual(main(clock), clock)


def test_isolated_node_retries_its_bootstrap_peers():
    """1. the only bootstrap peer is down, bootstrap finds nobody; 2. the peer comes back;
    3. within one rebootstrap interval the node has contacts and can read the peer's records."""

    async def main(clock):
        cfg = DHTConfig()
        fabric = InMemoryFabric(seed=1)
        a_id, b_id = Identity.from_seed(b"a"), Identity.from_seed(b"b")
        a = DHTNode(a_id, fabric.endpoint(a_id, sim_address(1)), cfg, clock)
        b = DHTNode(b_id, fabric.endpoint(b_id, sim_address(2)), cfg, clock)
        await a.start()
        await b.start()
        fabric.kill(a.address)
        assert await b.bootstrap([a.address]) == 0
        fabric.revive(a.address)
        key = dht_key("job", "boot")
        assert await a.store(key, a.peer_id, b"v", clock.time() + 60) == 1  # a alone: itself
        await asyncio.sleep(cfg.rebootstrap_interval + 0.5)
        assert [c.peer_id for c in b.contacts()] == [a.peer_id]
        assert a.peer_id in await b.get(key)
        await a.stop()
        await b.stop()

    run(main)


def test_node_whose_contacts_all_stop_answering_rebootstraps():
    async def main(clock):
        cfg = DHTConfig(max_failures=2)
        swarm = await build_swarm(6, clock, cfg, seed=2)
        lonely = swarm.nodes[5]
        lonely._bootstrap_addrs = [swarm.nodes[0].address]
        for node in swarm.nodes[:5]:
            swarm.kill(node)
        key = dht_key("job", "x")
        for _ in range(cfg.max_failures):
            await lonely.get(key, latest=True)
            await asyncio.sleep(cfg.backoff_max)  # let backoff lapse so each contact is tried again
        assert all(c.failures >= cfg.max_failures for c in lonely.contacts())
        swarm.fabric.revive(swarm.nodes[0].address)
        await asyncio.sleep(cfg.rebootstrap_interval + 0.5)
        assert lonely.table.get(swarm.nodes[0].peer_id).failures == 0
        await swarm.stop()

    run(main)


def test_store_flood_from_one_peer_over_the_network_hits_its_quota_while_others_stay():
    """Mallory sends 40 store RPCs (one record each, under 40 keys, all properly signed by her)
    to one node whose per-origin quota is 10: 10 are kept, 30 answered "quota"; Alice's earlier
    record is still served and Bob can still store."""

    async def main(clock):
        cfg = DHTConfig(max_records_per_origin=10)
        fabric = InMemoryFabric(seed=3)
        ids = {name: Identity.from_seed(name.encode()) for name in ("target", "alice", "bob", "mallory")}
        nodes = {name: DHTNode(ident, fabric.endpoint(ident, sim_address(i)), cfg, clock)
                 for i, (name, ident) in enumerate(ids.items()) if name != "mallory"}
        for node in nodes.values():
            await node.start()
        for name in ("alice", "bob"):
            await nodes[name].bootstrap([nodes["target"].address])
        mallory = fabric.endpoint(ids["mallory"], sim_address(9))
        key = dht_key("job", "shared")
        await nodes["alice"].store(key, ids["alice"].peer_id, b"alice", clock.time() + 300)
        results = []
        for i in range(40):
            record = sign_record(ids["mallory"], dht_key("job", "spam", i), ids["mallory"].peer_id, b"x" * 100,
                                 clock.time() + 300)
            reply = await mallory.call(nodes["target"].address, P.STORE,
                                       P.store_request(record.key, [record]), timeout=1.0)
            results += P.parse_store_reply(reply.meta, 1)
        assert results.count("ok") == 10 and results.count("quota") == 30
        assert await nodes["bob"].store(key, ids["bob"].peer_id, b"bob", clock.time() + 300) == 3
        got = await nodes["target"].get(key, latest=True)
        assert {r.value for r in got.values()} == {b"alice", b"bob"}
        for node in nodes.values():
            await node.stop()

    run(main)


def test_reader_drops_forged_records_served_by_a_hostile_replica():
    """A hostile node answers find_value with (a) the writer's subkey re-signed by itself with a
    far-future expiry, (b) a tampered copy of the real record, (c) junk under its own subkey;
    the reader keeps only the honest record."""

    async def main(clock):
        cfg = DHTConfig(get_quorum=50)  # make the reader ask everyone, the hostile node included
        swarm = await build_swarm(8, clock, cfg, seed=4)
        key = dht_key("job", "hostile")
        writer, reader = swarm.nodes[1], swarm.nodes[6]
        await writer.store(key, writer.peer_id, b"honest", clock.time() + 300)
        real = writer.storage.get(key, clock.time()) or swarm.nodes[0].storage.get(key, clock.time())
        evil = Identity.from_seed(b"evil")
        forged = [
            sign_record(evil, key, writer.peer_id, b"forged", clock.time() + 10_000),
            Record(key, writer.peer_id, b"tampered", real[0].expiration + 1, real[0].signature, real[0].public_key),
            Record(key, evil.peer_id, b"junk", clock.time() + 100, b"\x00" * 64, evil.public_key),
        ]

        async def hostile(caller, method, meta):
            if method == P.FIND_VALUE:
                return P.find_value_reply(forged, [])
            return P.contacts_reply([]) if method == P.FIND_NODE else {}

        endpoint = swarm.fabric.endpoint(evil, sim_address(99))
        await endpoint.start(hostile)
        await endpoint.call(reader.address, P.PING, {}, timeout=1.0)  # now in the reader's table
        got = await reader.get(key, latest=True)
        assert {s: r.value for s, r in got.items()} == {writer.peer_id: b"honest"}
        await swarm.stop()

    run(main)


def test_lossy_network_still_finds_every_key():
    async def main(clock):
        swarm = await build_swarm(100, clock, seed=5, loss=0.05)
        keys = []
        for i in range(30):
            writer = swarm.nodes[(i * 7) % 100]
            key = dht_key("job", "lossy", i)
            await writer.store(key, writer.peer_id, b"v", clock.time() + 600)
            keys.append((key, writer.peer_id))
        found = 0
        for i, (key, writer_id) in enumerate(keys):
            found += writer_id in await swarm.nodes[(i * 13 + 5) % 100].get(key, latest=True)
        print(f"\n5% loss: {found}/{len(keys)} keys found")
        assert found == len(keys)
        await swarm.stop()

    run(main)


def test_our_own_bad_record_is_a_usage_error_and_nothing_is_sent():
    async def main(clock):
        swarm = await build_swarm(5, clock, seed=6)
        node = swarm.nodes[0]
        before = swarm.fabric.calls
        with pytest.raises(DHTUsageError):
            await node.store(dht_key("job", "x"), node.peer_id, b"x" * (DHTConfig().max_value_bytes + 1),
                             clock.time() + 10)
        with pytest.raises(DHTUsageError):
            await node.store(dht_key("job", "x"), b"not-my-id" * 4, b"v", clock.time() + 10)
        with pytest.raises(DHTUsageError):
            node.announce(b"not a schema key", lambda: b"v")
        assert swarm.fabric.calls == before
        await swarm.stop()

    run(main)


def test_stop_cancels_every_background_task():
    async def main(clock):
        swarm = await build_swarm(10, clock, seed=7)
        swarm.nodes[3].announce(dht_key("job", "t"), lambda: b"v")
        await asyncio.sleep(40.0)
        await swarm.stop()
        assert asyncio.all_tasks() == {asyncio.current_task()}

    run(main)


def test_virtual_runs_are_deterministic():
    async def main(clock):
        swarm = await build_swarm(50, clock, seed=8)
        key = dht_key("job", "det")
        await swarm.nodes[1].store(key, swarm.nodes[1].peer_id, b"v", clock.time() + 60)
        await swarm.nodes[40].get(key)
        trace = (swarm.fabric.calls, round(clock.now, 9), [len(n.contacts()) for n in swarm.nodes])
        await swarm.stop()
        return trace

    assert run(main) == run(main)


def test_a_failing_value_fn_skips_its_round_and_spares_other_announcements():
    async def main(clock):
        swarm = await build_swarm(10, clock, seed=9)
        node, reader = swarm.nodes[2], swarm.nodes[8]
        good, bad = dht_key("job", "good"), dht_key("job", "bad")
        node.announce(bad, lambda: {}["missing"])
        node.announce(good, lambda: b"fine")
        await asyncio.sleep(DHTConfig().refresh_interval + 1.0)
        assert (await reader.get(good, latest=True))[node.peer_id].value == b"fine"
        assert await reader.get(bad, latest=True) == {}
        await swarm.stop()

    run(main)


def test_quiet_buckets_get_refreshed():
    """With a 60 s refresh interval and no traffic, the maintenance loop looks up a random id in
    each quiet bucket (one per tick), so after a while no bucket of any node is quiet."""

    async def main(clock):
        cfg = DHTConfig(bucket_refresh_interval=60.0)
        swarm = await build_swarm(20, clock, cfg, seed=10)
        await asyncio.sleep(1.0)
        before = swarm.fabric.calls
        await asyncio.sleep(30.0)
        assert swarm.fabric.calls == before  # nothing is quiet yet: no background lookups
        await asyncio.sleep(60.0 + 10 * cfg.rebootstrap_interval)
        assert swarm.fabric.calls > before
        now = clock.monotonic()
        assert all(len(n.table.quiet_buckets(now)) <= 1 for n in swarm.nodes)
        await swarm.stop()

    run(main)


def test_a_maintenance_loop_that_dies_is_restarted_and_shown():
    """1. A node under a Supervisor whose prune loop raises a bug once (a TaskGroup: the other
          maintenance loops are cancelled with it).
       2. The failure is recorded on the supervisor's board with its task name, and the loops run
          again after the backoff: the prune loop is entered a second time and announcements go on."""
    from swarmd.supervisor import Backoff, Faults, Supervisor

    async def main(clock):
        cfg = DHTConfig(prune_interval=1.0)
        fabric = InMemoryFabric(seed=3)
        ident = Identity.from_seed(b"maint")
        faults = Faults()
        node = DHTNode(ident, fabric.endpoint(ident, sim_address(1)), cfg, clock,
                       supervisor=Supervisor("dht", faults, Backoff(initial_s=0.5, max_s=1.0)))
        entered = []
        honest_prune = node._prune_loop

        async def prune_once_broken():
            entered.append(clock.monotonic())
            if len(entered) == 1:
                raise KeyError("a bug in a maintenance loop")
            await honest_prune()

        node._prune_loop = prune_once_broken
        await node.start()
        while len(entered) < 2:
            await asyncio.sleep(0.25)
        assert faults.total == 1 and "maintenance" in faults.status()["tasks"][0]["task"]
        await node.stop()

    run(main)


def test_a_failing_value_fn_is_shown_in_the_supervisors_faults():
    """1. A node under a Supervisor announces a record whose value_fn raises a bug (a KeyError).
       2. The failure is in the supervisor's faults (what `swarmctl status` shows), not only logged,
          and counts down to the next period's retry.
       3. Once the value_fn works again, the fault stops counting down: it ran again."""
    from swarmd.supervisor import Faults, Supervisor

    async def main(clock):
        fabric, ident, faults = InMemoryFabric(seed=4), Identity.from_seed(b"value"), Faults()
        node = DHTNode(ident, fabric.endpoint(ident, sim_address(1)), DHTConfig(), clock,
                       supervisor=Supervisor("dht", faults))
        broken = [True]

        def value() -> bytes:
            if broken[0]:
                raise KeyError("a bug in the caller's value_fn")
            return b"fine"

        key = dht_key("job", "x")
        await node.start()
        node.announce(key, value)
        await asyncio.sleep(1.0)
        [fault] = faults.status()["tasks"]
        assert fault["task"] == f"dht: value of announcement {key.hex()[:16]}" and "KeyError" in fault["last_error"]
        assert fault["retry_in_s"] is not None
        broken[0] = False
        await asyncio.sleep(DHTConfig().refresh_interval + 1.0)
        assert faults.status()["tasks"][0]["retry_in_s"] is None and faults.total == 1
        await node.stop()

    run(main)
