"""The jobs a daemon learned from the index are forgotten once the index stops listing them
(adversary's attack on the bounded index).

The index read is bounded per refresh (`lookups_per_refresh`), but what it learned was kept for
ever: a stranger whose index entries list fresh, valid job ids at every refresh (identities are
free, a spec is a few hundred signed bytes) grew every daemon's `registry.jobs`, and `swarmctl
jobs` with it, by `lookups_per_refresh` jobs per refresh without end, though the index itself
never listed more than a handful. One DHT node on loopback in this process; records signed by
throw-away identities are put straight into its storage, as a stranger's stores would land."""

from __future__ import annotations

import time

from swarmd.dht import DHTConfig, DHTNode
from swarmd.dht.records import sign_record
from swarmd.dht.rpc_network import RpcNetwork
from swarmd.job import JobSpec
from swarmd.jobs.registry import IndexLimits, JobRegistry
from swarmd.values import encode_index, index_key, spec_key
from transport.identity import Identity

SUBMITTERS = 4
ROUNDS = 6


def spec(name: str) -> JobSpec:
    return JobSpec.from_dict({
        "name": name, "steps": 3, "model": {"arch": "transformer-lm", "d_model": 16, "n_heads": 2},
        "data": {"files": ["x"], "seq_len": 8}, "batch": {"global_samples": 4, "microbatch_samples": 2},
    })


def publish(node: DHTNode, submitter: Identity, name: str) -> bytes:
    """`submitter`'s index entry now lists one new job (its spec stored too); the old one is gone from it."""
    job = spec(name)
    job_id = job.job_id(submitter.public_key)
    expires = time.time() + 90
    for key, value in ((spec_key(job_id), job.to_msgpack()), (index_key(), encode_index([job_id]))):
        node.storage.put(sign_record(submitter, key, submitter.peer_id, value, expires), submitter.peer_id, time.time())
    return job_id


async def test_jobs_no_longer_listed_are_forgotten() -> None:
    identity = Identity.from_seed(b"churn-daemon")
    config = DHTConfig()
    node = DHTNode(identity, await RpcNetwork.listen(identity, config=config), config)
    await node.start()
    try:
        registry = JobRegistry(node, identity, index_limits=IndexLimits(lookups_per_refresh=16, forget_after_s=0.0))
        submitters = [Identity.generate() for _ in range(SUBMITTERS)]
        for round_ in range(ROUNDS):
            listed = {publish(node, s, f"churn-{round_}-{i}") for i, s in enumerate(submitters)}
            await registry.refresh()
            assert registry.listed == listed
        known = len(registry.jobs)
        assert known <= 2 * SUBMITTERS, f"{known} jobs known after {ROUNDS} rounds; the index lists {SUBMITTERS}"
    finally:
        await node.stop()


def list_ids(node: DHTNode, submitter: Identity, job_ids: list[bytes]) -> None:
    record = sign_record(submitter, index_key(), submitter.peer_id, encode_index(job_ids), time.time() + 90)
    node.storage.put(record, submitter.peer_id, time.time())


async def test_an_honest_new_job_is_learned_however_many_ids_strangers_list() -> None:
    """Steps: eight stranger identities each list 63 made-up ids and, newest, the id of an honest
    job they copied from the index; then the honest submitter's entry and spec appear; the daemon
    reads the index three times (16 lookups each). Expected: the honest job is learned. On the old
    code the strangers' entries (read first) spent every lookup of every read on made-up ids, and a
    stranger listing the honest id cached it as a miss for `miss_ttl_s`, whoever listed it next."""
    identity = Identity.from_seed(b"starve-daemon")
    config = DHTConfig()
    node = DHTNode(identity, await RpcNetwork.listen(identity, config=config), config)
    await node.start()
    try:
        registry = JobRegistry(node, identity, index_limits=IndexLimits(lookups_per_refresh=16))
        honest = Identity.generate()
        honest_id = spec("honest").job_id(honest.public_key)
        for _ in range(8):
            made_up = [Identity.generate().peer_id for _ in range(63)]
            list_ids(node, Identity.generate(), [*made_up, honest_id])
        await registry.refresh()
        assert publish(node, honest, "honest") == honest_id
        for _ in range(3):
            await registry.refresh()
        assert honest_id in registry.jobs, f"not learned; {len(registry.misses)} misses cached"
        assert honest_id in registry.listed
    finally:
        await node.stop()
