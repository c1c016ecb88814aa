"""The RPC schema: every malformed payload gets a typed DHTProtocolError, on bytes alone."""


import msgpack
import pytest

from swarmd.clock import VirtualClock, run_virtual
from swarmd.dht import DHTConfig, DHTNode, DHTProtocolError, InMemoryFabric, RemoteFailure, dht_key
from swarmd.dht import protocol as P
from swarmd.dht.records import sign_record
from transport.identity import Identity

CFG = DHTConfig()
KEY = dht_key("job", "j")
GOOD_REC = [b"s" * 32, b"v", 1.0, b"", b""]

GARBAGE = [None, 3, "str", b"bytes", [], [1, 2], {"x": 1}, {b"target": b"x"}, {"target": None},
           {"target": "a" * 32}, {"target": b"short"}, {"target": b"x" * 33}, {"target": True},
           {"key": b""}, {"key": b"k" * 1000}, {"key": KEY, "records": "no"},
           {"key": KEY, "records": [GOOD_REC] * (CFG.max_records_per_store + 1)},
           {"key": KEY, "records": [[b"s", b"v", "soon", b"", b""]]},
           {"key": KEY, "records": [[b"s", b"v", True, b"", b""]]},
           {"key": KEY, "records": [[b"s", "v", 1.0, b"", b""]]},
           {"key": KEY, "records": [[b"s", b"v", 1.0, b""]]},
           {"key": KEY, "records": [{"subkey": b"s"}]}]


@pytest.mark.parametrize("payload", GARBAGE)
def test_garbage_requests_raise_protocol_errors(payload):
    # a payload may be valid for one method (e.g. a well-formed target for find_node), never more
    assert sum(_valid(parse, payload) for parse in PARSERS.values()) <= 1


PARSERS = {P.FIND_NODE: P.parse_find_node, P.FIND_VALUE: P.parse_find_value, P.STORE: P.parse_store}


def _valid(parse, payload) -> bool:
    try:
        parse(payload, CFG)
    except DHTProtocolError:
        return False
    return True


@pytest.mark.parametrize("reply", [
    None, {}, {"contacts": "x"}, {"contacts": [[b"x" * 32]]}, {"contacts": [[b"x" * 31, "a:1"]]},
    {"contacts": [[b"x" * 32, ""]]}, {"contacts": [[b"x" * 32, "a:1"]] * 21},
    {"contacts": [], "records": [[1, 2, 3, 4, 5]]},
])
def test_garbage_replies_raise_protocol_errors(reply):
    with pytest.raises(DHTProtocolError):
        P.parse_find_value_reply(KEY, reply, CFG)


def test_store_reply_must_match_the_request():
    assert P.parse_store_reply({"results": ["ok", "quota"]}, 2) == ["ok", "quota"]
    for bad in [{"results": ["ok"]}, {"results": [1, 2]}, {"results": ["x" * 100, "ok"]}, {}]:
        with pytest.raises(DHTProtocolError):
            P.parse_store_reply(bad, 2)


def test_addr_field_is_checked():
    assert P.parse_addr({"addr": "10.0.0.1:7"}, CFG) == "10.0.0.1:7"
    assert P.parse_addr({}, CFG) is None
    for bad in [{"addr": 7}, {"addr": ""}, {"addr": "nocolon"}, {"addr": "a:" + "1" * 300}]:
        with pytest.raises(DHTProtocolError):
            P.parse_addr(bad, CFG)


def test_records_round_trip():
    ident = Identity.from_seed(b"a")
    r = sign_record(ident, KEY, ident.peer_id, b"v", 2e9)
    key, [back] = P.parse_store(P.store_request(KEY, [r]), CFG)
    assert key == KEY and back == r


def test_garbage_rpc_payloads_get_bad_request_from_a_live_node():
    """Over the in-memory network (msgpack on the way), each bad payload makes the node answer
    a typed "bad_request" error; the node keeps serving good requests afterwards."""

    async def main(clock):
        fabric = InMemoryFabric(seed=1)
        ids = [Identity.from_seed(b"n%d" % i) for i in range(2)]
        server = DHTNode(ids[0], fabric.endpoint(ids[0], "10.0.0.1:1"), CFG, clock)
        client = fabric.endpoint(ids[1], "10.0.0.2:1")
        await server.start()
        try:
            for method in P.METHODS[1:] + ("dht.nonsense",):
                for payload in GARBAGE:
                    if method in PARSERS and _valid(PARSERS[method], payload):
                        continue
                    with pytest.raises(RemoteFailure) as e:
                        await client.call(server.address, method, payload, timeout=1.0)
                    assert e.value.code == "bad_request"
            assert not server.contacts()  # callers that sent garbage were not admitted
            await client.call(server.address, P.PING, {}, timeout=1.0)
            reply = await client.call(server.address, P.FIND_NODE, P.find_node_request(b"t" * 32), timeout=1.0)
            assert reply.peer_id == ids[0].peer_id
            assert P.parse_contacts(reply.meta, CFG) == [(ids[1].peer_id, "10.0.0.2:1")]
        finally:
            await server.stop()

    clock = VirtualClock()
    run_virtual(main(clock), clock)


def test_store_batches_keep_to_the_record_count_and_the_byte_budget():
    """A hand-off of 100 records of 2 KiB values goes in requests of at most 48 KiB of records
    (the transport refuses headers over 64 KiB), and 100 tiny records in requests of 64."""
    cfg = DHTConfig()
    key = dht_key("job", "handoff", "stage", 0)
    ids = [Identity.from_seed(b"h%d" % i) for i in range(100)]
    for size, most in ((2048, None), (8, cfg.max_records_per_store)):
        records = [sign_record(i, key, i.peer_id, b"x" * size, 2e9) for i in ids]
        batches = P.store_batches(records, cfg)
        assert [r for b in batches for r in b] == records
        assert all(sum(P.record_wire_bytes(r) for r in b) <= cfg.max_message_record_bytes for b in batches)
        assert all(len(b) <= cfg.max_records_per_store for b in batches)
        if most is not None:
            assert max(len(b) for b in batches) == most
        for batch in batches:
            assert len(msgpack.packb(P.store_request(key, batch), use_bin_type=True)) <= 64 * 1024
