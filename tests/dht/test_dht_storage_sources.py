"""One network cannot fill a node's whole storage (adversary's attack on the per-key quotas).

The per-key quotas (`max_subkeys_per_source`) share each key between networks, but the node-wide
limits (`max_keys`, `max_total_bytes`) were first come, first served: one address storing unsigned
records under fresh keys of the open namespace (no signature to compute, a day to live, 64 a call)
filled every one of a node's 65,536 key slots in 1,024 RPCs, after which the node refused every new
key, the stage announcements of every new job included (`storage_full`), for a day."""

from __future__ import annotations

import pytest

from swarmd.dht import DHTConfig, RecordRejected, dht_key
from swarmd.dht.records import Record, sign_record
from swarmd.dht.storage import LOCAL_SOURCE, Storage
from transport.identity import Identity

NOW = 1_800_000_000.0
DAY = 24 * 3600.0
ATTACKER, HONEST = "198.51.100", "203.0.113"


def stuff(storage: Storage, config: DHTConfig, count: int, value: bytes = b"x") -> dict[str, int]:
    """`count` unsigned open records under fresh keys from the attacker's network, as many
    senders as the per-origin quota asks for; the store results by name."""
    results: dict[str, int] = {}
    for i in range(count):
        sender = (i // config.max_records_per_origin).to_bytes(32, "big")
        record = Record(dht_key("open", i), b"s", value, NOW + DAY, b"", b"")
        try:
            storage.put(record, sender, NOW, ATTACKER)
            results["ok"] = results.get("ok", 0) + 1
        except RecordRejected as exc:
            results[exc.reason] = results.get(exc.reason, 0) + 1
    return results


def honest_announcement(job: int) -> Record:
    ident = Identity.from_seed(b"honest%d" % job)
    return sign_record(ident, dht_key("job", b"%032d" % job, "stage", 0), ident.peer_id, b"announcement", NOW + 90)


def test_one_network_cannot_take_every_key_slot_of_a_node() -> None:
    config = DHTConfig()
    storage = Storage(config)
    results = stuff(storage, config, config.max_keys)
    assert results.get("source_quota", 0) > 0, f"one network filled the node: {results}"
    storage.put(honest_announcement(1), b"h" * 32, NOW, HONEST)  # a new job's announcement still lands


def test_one_network_cannot_take_every_byte_of_a_node() -> None:
    config = DHTConfig(max_total_bytes=1 << 20, max_value_bytes=8192)
    storage = Storage(config)
    results = stuff(storage, config, 256, value=b"x" * 8000)
    assert results.get("source_quota", 0) > 0, f"one network filled the node: {results}"
    storage.put(honest_announcement(2), b"h" * 32, NOW, HONEST)


def test_the_nodes_own_records_are_not_held_to_a_networks_share() -> None:
    config = DHTConfig(max_keys=64)
    storage = Storage(config)
    for job in range(64):
        storage.put(honest_announcement(job), b"h" * 32, NOW, LOCAL_SOURCE)
    assert len(storage) == 64
