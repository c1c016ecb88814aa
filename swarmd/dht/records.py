"""Records: what is stored under key -> subkey, how it is signed, and who may write it.

Key schema. A raw key is the msgpack encoding of a short list whose first element is a namespace
string, e.g. `dht_key("job", job_id, "stage", 3)`. Storers see the raw key, so they can apply the
namespace's rule; the key's place in the id space is SHA-256 of the raw key (domain-separated).

Write rules, by namespace:
- default ("peer" rule): the subkey is a 32-byte peer id and the record must be signed by the
  Ed25519 key whose SHA-256 is that id. Nobody can write or overwrite another peer's entry.
- namespaces listed in `DHTConfig.open_namespaces`: any subkey, signature optional (checked when
  present). For public scratch data where authorship does not matter.

An empty value is a tombstone: a withdrawn entry that must out-live the record it replaces, and
that readers never see.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import msgpack

from transport.identity import Identity, peer_id_of, verify

from .config import DHTConfig
from .errors import DHTUsageError, RecordRejected

SIGNING_DOMAIN = b"swarmd/dht/record/v1\x00"
KEY_DOMAIN = b"swarmd/dht/key/v1\x00"
ID_BYTES = 32


def dht_key(*parts: str | int | bytes) -> bytes:
    """A raw key from its parts; the first part is the namespace, e.g. ("job", "j1", "stage", 3)."""
    if not parts or not isinstance(parts[0], str):
        raise DHTUsageError("a DHT key starts with a namespace string")
    for part in parts:
        if not isinstance(part, (str, int, bytes)) or isinstance(part, bool):
            raise DHTUsageError(f"a DHT key part is str, int or bytes, not {type(part).__name__}")
    return msgpack.packb(list(parts), use_bin_type=True)


def key_id(raw_key: bytes) -> bytes:
    """Where a key lives in the 256-bit id space."""
    return hashlib.sha256(KEY_DOMAIN + raw_key).digest()


def namespace_of(raw_key: bytes) -> str:
    """The namespace of a raw key; raises RecordRejected("bad_key") if it is not a schema key."""
    try:
        parts = msgpack.unpackb(raw_key, raw=False, strict_map_key=True, max_str_len=len(raw_key),
                                max_bin_len=len(raw_key), max_array_len=len(raw_key), max_map_len=0)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise RecordRejected("bad_key", "raw key is not msgpack") from e
    if not isinstance(parts, list) or not parts or not isinstance(parts[0], str):
        raise RecordRejected("bad_key", "raw key is not a list starting with a namespace")
    return parts[0]


@dataclass(frozen=True, slots=True)
class Record:
    """One signed entry. `expiration` is absolute wall-clock seconds, exactly as signed."""

    key: bytes
    subkey: bytes
    value: bytes
    expiration: float
    signature: bytes = b""
    public_key: bytes = b""

    @property
    def is_tombstone(self) -> bool:
        return not self.value

    @property
    def signer(self) -> bytes | None:
        """Peer id of the signer, or None for an unsigned record."""
        return peer_id_of(self.public_key) if self.public_key else None

    def size(self) -> int:
        return len(self.subkey) + len(self.value)

    def supersedes(self, other: "Record") -> bool:
        """Newest expiration wins; equal expirations tie-break on signature bytes so that every
        replica picks the same record whatever order the stores arrive in."""
        if self.expiration != other.expiration:
            return self.expiration > other.expiration
        return (self.signature, self.value) > (other.signature, other.value)


def signing_payload(key: bytes, subkey: bytes, value: bytes, expiration: float) -> bytes:
    return SIGNING_DOMAIN + msgpack.packb([key, subkey, value, float(expiration)], use_bin_type=True)


def sign_record(identity: Identity, key: bytes, subkey: bytes, value: bytes, expiration: float) -> Record:
    expiration = float(expiration)
    sig = identity.sign(signing_payload(key, subkey, value, expiration))
    return Record(key, subkey, value, expiration, sig, identity.public_key)


def check_record(record: Record, config: DHTConfig, now: float) -> None:
    """Raise RecordRejected unless `record` may be stored (by a storer) or believed (by a reader).

    Checks sizes first (cheap), then ownership, then the signature (the costly step)."""
    if not record.key or len(record.key) > config.max_key_bytes:
        raise RecordRejected("bad_key", f"key is {len(record.key)} bytes, limit {config.max_key_bytes}")
    if not record.subkey or len(record.subkey) > config.max_subkey_bytes:
        raise RecordRejected("bad_subkey", f"subkey is {len(record.subkey)} bytes, limit {config.max_subkey_bytes}")
    if len(record.value) > config.max_value_bytes:
        raise RecordRejected("value_too_large", f"{len(record.value)} bytes, limit {config.max_value_bytes}")
    if not math.isfinite(record.expiration):
        raise RecordRejected("bad_expiration", "expiration is not a finite number")
    if record.expiration <= now:
        raise RecordRejected("expired")
    namespace = namespace_of(record.key)
    if namespace in config.open_namespaces and not record.signature and not record.public_key:
        return
    if len(record.public_key) != 32:
        raise RecordRejected("unsigned", f"namespace {namespace!r} requires a signed record")
    if namespace not in config.open_namespaces and peer_id_of(record.public_key) != record.subkey:
        raise RecordRejected("wrong_owner", "subkey is not the signer's peer id")
    payload = signing_payload(record.key, record.subkey, record.value, record.expiration)
    if not verify(record.public_key, record.signature, payload):
        raise RecordRejected("bad_signature")
