"""Ed25519 peer identities: a peer id is SHA-256 of the public key, so nobody picks where they sit.

The key file lives in the daemon's state dir (mode 0600) and survives restarts; the same id then
names the peer in the DHT, in signed records and in the connection handshake.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
PEER_ID_BYTES = 32


def peer_id_of(public_key: bytes) -> bytes:
    """The peer id for a raw 32-byte Ed25519 public key."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    return hashlib.sha256(public_key).digest()


def verify(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """True when `signature` is `public_key`'s signature of `message`; never raises on bad input."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True)
class Identity:
    """A private key with its public key and peer id precomputed."""

    private_key: Ed25519PrivateKey
    public_key: bytes
    peer_id: bytes

    @classmethod
    def generate(cls) -> "Identity":
        return cls.from_private_key(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_key(cls, key: Ed25519PrivateKey) -> "Identity":
        public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return cls(key, public, peer_id_of(public))

    @classmethod
    def from_seed(cls, seed: bytes) -> "Identity":
        """Deterministic identity from 32 bytes (tests, simulations)."""
        return cls.from_private_key(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(seed).digest()))

    @classmethod
    def load_or_create(cls, path: Path) -> "Identity":
        """Read the raw 32-byte private key at `path`, creating it (mode 0600) on first start."""
        path = Path(path)
        if path.exists():
            raw = path.read_bytes()
            if len(raw) != 32:
                raise ValueError(f"{path}: an identity key file holds 32 raw bytes, found {len(raw)}")
            return cls.from_private_key(Ed25519PrivateKey.from_private_bytes(raw))
        key = Ed25519PrivateKey.generate()
        raw = key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, raw)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return cls.from_private_key(key)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)
