"""The DHT's RPC schema: builders and validators for the msgpack maps peers exchange. No I/O.

Every payload from a peer passes through a `parse_*` function here before anything else touches
it; a payload that does not match raises DHTProtocolError (the adapter answers "bad_request").
Counts are checked before anything is built from a list, so a hostile payload costs no more than
the bytes the transport already bounded.

    dht.ping        {addr?}                     -> {}
    dht.find_node   {target: id, n?, addr?}      -> {contacts: [[id, address], ...]}
    dht.find_value  {key: raw, n?, addr?}        -> {records: [rec, ...], contacts: [...]}
    dht.store       {key: raw, records: [rec..], addr?} -> {results: ["ok" | reason, ...]}
    rec = [subkey, value, expiration, signature, public_key]

`n` is how many contacts the caller wants (the width of its lookup): a lookup for the 3 nearest
has no use for 20 contacts per reply, and their bytes are most of a reply. Without it a node
answers `max_contacts_per_reply`; above that it is cut to it, below 1 (or not an integer) refused.

`addr` is the caller's own announce address ("host:port") when the transport's hello did not
carry one; the caller's id always comes from the handshake, never from the payload.
"""

from __future__ import annotations

from typing import Any

from .config import DHTConfig
from .errors import DHTProtocolError
from .records import ID_BYTES, Record
from .routing import Contact

PING, FIND_NODE, FIND_VALUE, STORE = "dht.ping", "dht.find_node", "dht.find_value", "dht.store"
METHODS = (PING, FIND_NODE, FIND_VALUE, STORE)


def _field(meta: Any, name: str, kind: type, optional: bool = False) -> Any:
    if not isinstance(meta, dict):
        raise DHTProtocolError(f"payload is {type(meta).__name__}, expected a map")
    if name not in meta:
        if optional:
            return None
        raise DHTProtocolError(f"missing field {name!r}")
    value = meta[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise DHTProtocolError(f"field {name!r} is {type(value).__name__}, expected {kind.__name__}")
    return value


def _bytes(meta: Any, name: str, max_len: int, exact: int | None = None) -> bytes:
    value = _field(meta, name, bytes)
    if exact is not None and len(value) != exact:
        raise DHTProtocolError(f"field {name!r} is {len(value)} bytes, expected {exact}")
    if not value or len(value) > max_len:
        raise DHTProtocolError(f"field {name!r} is {len(value)} bytes, allowed 1..{max_len}")
    return value


def _list(meta: Any, name: str, max_len: int) -> list:
    value = _field(meta, name, list)
    if len(value) > max_len:
        raise DHTProtocolError(f"field {name!r} has {len(value)} items, limit {max_len}")
    return value


def parse_addr(meta: Any, config: DHTConfig) -> str | None:
    addr = _field(meta, "addr", str, optional=True)
    if addr is not None and not _peer_address(addr, config):
        raise DHTProtocolError("field 'addr' is not a host:port string within the size limit")
    return addr


def _peer_address(addr: str, config: DHTConfig) -> bool:
    """A peer's address is TCP `host:port`: never `unix:/path`, which the transport would dial on
    this host (a stranger's contact naming the daemon's own control socket or docker.sock)."""
    return 0 < len(addr) <= config.max_address_bytes and ":" in addr and not addr.startswith("unix:")


def with_addr(meta: dict, addr: str | None) -> dict:
    return {**meta, "addr": addr} if addr else meta


# --- requests ---

def _wanted(meta: dict, n: int | None) -> dict:
    return meta if n is None else {**meta, "n": n}


def parse_wanted(meta: Any, config: DHTConfig) -> int:
    """The number of contacts a find_node/find_value caller wants: 1 up to max_contacts_per_reply
    (a larger ask gets that many; an absent one too, as before the field existed)."""
    n = _field(meta, "n", int, optional=True)
    if n is None:
        return config.max_contacts_per_reply
    if n < 1:
        raise DHTProtocolError(f"field 'n' is {n}, a lookup wants at least 1 contact")
    return min(n, config.max_contacts_per_reply)


def find_node_request(target: bytes, n: int | None = None) -> dict:
    return _wanted({"target": target}, n)


def parse_find_node(meta: Any, config: DHTConfig) -> bytes:
    return _bytes(meta, "target", ID_BYTES, exact=ID_BYTES)


def find_value_request(key: bytes, n: int | None = None) -> dict:
    return _wanted({"key": key}, n)


def parse_find_value(meta: Any, config: DHTConfig) -> bytes:
    return _bytes(meta, "key", config.max_key_bytes)


def store_request(key: bytes, records: list[Record]) -> dict:
    return {"key": key, "records": [encode_record(r) for r in records]}


def parse_store(meta: Any, config: DHTConfig) -> tuple[bytes, list[Record]]:
    key = _bytes(meta, "key", config.max_key_bytes)
    raw = _list(meta, "records", config.max_records_per_store)
    return key, [decode_record(key, item) for item in raw]


# --- replies ---

def contacts_reply(contacts: list[Contact]) -> dict:
    return {"contacts": [[c.peer_id, c.address] for c in contacts]}


def parse_contacts(meta: Any, config: DHTConfig) -> list[tuple[bytes, str]]:
    raw = _list(meta, "contacts", config.max_contacts_per_reply)
    out = []
    for item in raw:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], bytes)
                or len(item[0]) != ID_BYTES or not isinstance(item[1], str) or not _peer_address(item[1], config)):
            raise DHTProtocolError("a contact is [32-byte id, host:port address string]")
        out.append((item[0], item[1]))
    return out


def find_value_reply(records: list[Record], contacts: list[Contact]) -> dict:
    return {**contacts_reply(contacts), "records": [encode_record(r) for r in records]}


def parse_find_value_reply(key: bytes, meta: Any, config: DHTConfig) -> tuple[list[Record], list[tuple[bytes, str]]]:
    raw = _list(meta, "records", config.max_subkeys_per_key)
    return [decode_record(key, item) for item in raw], parse_contacts(meta, config)


def store_reply(results: list[str]) -> dict:
    return {"results": results}


def parse_store_reply(meta: Any, count: int) -> list[str]:
    raw = _list(meta, "results", count)
    if len(raw) != count or not all(isinstance(r, str) and len(r) <= 64 for r in raw):
        raise DHTProtocolError(f"a store reply holds {count} short result strings")
    return raw


# --- records on the wire ---

def encode_record(r: Record) -> list:
    return [r.subkey, r.value, r.expiration, r.signature, r.public_key]


#: msgpack framing of one encoded record at most: the list, four bin headers and a float64.
RECORD_OVERHEAD_BYTES = 1 + 4 * 5 + 9


def record_wire_bytes(r: Record) -> int:
    """An upper bound on what `encode_record(r)` costs in a msgpack header."""
    return len(r.subkey) + len(r.value) + len(r.signature) + len(r.public_key) + RECORD_OVERHEAD_BYTES


def store_batches(records: list[Record], config: DHTConfig) -> list[list[Record]]:
    """`records` cut into store requests that each keep to max_records_per_store and to
    max_message_record_bytes (a record larger than the byte budget alone travels by itself)."""
    batches: list[list[Record]] = []
    size = 0
    for r in records:
        cost = record_wire_bytes(r)
        if not batches or len(batches[-1]) >= config.max_records_per_store \
                or size + cost > config.max_message_record_bytes:
            batches.append([])
            size = 0
        batches[-1].append(r)
        size += cost
    return batches


def decode_record(key: bytes, item: Any) -> Record:
    """Shape and types only; sizes, ownership and signatures are records.check_record's job."""
    if not isinstance(item, list) or len(item) != 5:
        raise DHTProtocolError("a record is [subkey, value, expiration, signature, public_key]")
    subkey, value, expiration, signature, public_key = item
    if not all(isinstance(x, bytes) for x in (subkey, value, signature, public_key)):
        raise DHTProtocolError("record subkey, value, signature and public key are bytes")
    if not isinstance(expiration, (int, float)) or isinstance(expiration, bool):
        raise DHTProtocolError("record expiration is a number")
    return Record(key, subkey, value, float(expiration), signature, public_key)
