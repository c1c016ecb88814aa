"""The hello exchange that opens every connection, as a sans-IO state machine.

Both sides send two messages at once, so the exchange costs one round trip whoever starts:

1. HELLO: wire version, a fresh random nonce, our Ed25519 public key (or none: anonymous), whether we
   use a swarm key, a summary of our limits and a small `app` dict (e.g. the DHT announce address).
2. PROOF, sent once the peer's HELLO is in: an Ed25519 signature and/or an HMAC-SHA256 with the swarm
   key, both over the transcript.

With encryption on, each HELLO also carries a fresh ephemeral X25519 public key. As it is part of
the hello bytes, the transcript (and so the signature and the swarm-key MAC) covers it, so nobody
in the middle can swap it for their own. Each side derives two keys, one per direction, with HKDF
over the X25519 shared secret salted with the transcript; they seal everything after the hello
(transport.seal). Fresh ephemeral keys per connection mean a stolen identity key does not open
recorded traffic.

The transcript is a context string plus SHA-256 of each side's HELLO bytes exactly as sent, in
initiator-then-responder order. It therefore binds both nonces (fresh each time: no replay), both
public keys (so the signature proves the peer holds the key whose hash is its peer id) and both apps
and limits (nobody in the middle can rewrite them). Each proof also names the role of its author, so
a proof cannot be reflected back to the side that made it.

Nothing here touches a socket: the connection feeds the peer's bytes in and writes what comes out,
which keeps every failure path testable on bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import HandshakeError
from .identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, peer_id_of, verify

CONTEXT = b"swarmd transport hello v1"
NONCE_BYTES = 32
MAC_BYTES = 32
# A hello holds a few keys, a 32-byte key, a nonce and a small app dict; 16 KiB is generous and
# bounds what a peer can make us parse before it has proven anything.
MAX_HELLO_BYTES = 16 * 1024
# The app dict and limits summary are flat, small maps; these bound msgpack's allocations.
MAX_HELLO_ITEMS = 64
MAX_HELLO_STR = 1024

KX_BYTES = 32
"""An X25519 public key."""
SEAL_CONTEXT = b"swarmd seal keys v1"
"""HKDF info for the two per-direction record keys (transport.seal)."""
SEAL_KEY_BYTES = 32

ROLE_INITIATOR = b"initiator"
ROLE_RESPONDER = b"responder"


@dataclass(frozen=True)
class Hello:
    """What one side announces before proving anything."""

    version: int
    nonce: bytes
    public_key: bytes | None
    uses_swarm_key: bool
    limits: dict[str, int] = field(default_factory=dict)
    app: dict[str, Any] = field(default_factory=dict)
    encrypt: bool = False
    kx: bytes | None = None  # ephemeral X25519 public key, present exactly when `encrypt`

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "v": self.version,
                "nonce": self.nonce,
                "pk": self.public_key,
                "swarm": self.uses_swarm_key,
                "limits": self.limits,
                "app": self.app,
                "enc": self.encrypt,
                "kx": self.kx,
            },
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, raw: bytes) -> "Hello":
        body = _unpack(raw, "hello")
        try:
            version, nonce, pk = body["v"], body["nonce"], body["pk"]
            swarm, limits, app = body["swarm"], body["limits"], body["app"]
        except KeyError as exc:
            raise HandshakeError(f"hello lacks field {exc.args[0]!r}") from None
        if not isinstance(version, int) or isinstance(version, bool):
            raise HandshakeError("hello version is not an integer")
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            raise HandshakeError(f"hello nonce must be {NONCE_BYTES} bytes")
        if pk is not None and (not isinstance(pk, bytes) or len(pk) != PUBLIC_KEY_BYTES):
            raise HandshakeError(f"hello public key must be {PUBLIC_KEY_BYTES} bytes or nil")
        if not isinstance(swarm, bool):
            raise HandshakeError("hello swarm flag is not a bool")
        if not isinstance(limits, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in limits.items()
        ):
            raise HandshakeError("hello limits must map names to integers")
        if not isinstance(app, dict) or not all(isinstance(k, str) for k in app):
            raise HandshakeError("hello app must be a map with string keys")
        encrypt, kx = body.get("enc", False), body.get("kx")
        if not isinstance(encrypt, bool):
            raise HandshakeError("hello encryption flag is not a bool")
        if encrypt != (isinstance(kx, bytes) and len(kx) == KX_BYTES) or (not encrypt and kx is not None):
            raise HandshakeError(f"hello must carry a {KX_BYTES}-byte key exchange exactly when it encrypts")
        return cls(version, nonce, pk, swarm, limits, app, encrypt, kx)


@dataclass(frozen=True)
class PeerHello:
    """The verified outcome: who the peer proved to be and what it announced."""

    hello: Hello
    peer_id: bytes | None
    # Record keys for transport.seal when the connection is encrypted: ours to send, theirs to open.
    send_key: bytes | None = None
    recv_key: bytes | None = None

    @property
    def public_key(self) -> bytes | None:
        return self.hello.public_key


class Handshake:
    """One side of the exchange: `hello_bytes()`, then `receive_hello()` gives our proof to send,
    then `receive_proof()` verifies the peer's and returns the `PeerHello`.

    Raises HandshakeError for anything wrong the peer did: wrong version, bad signature, wrong or
    missing swarm key, malformed messages, or calling out of order (a LocalProtocolError would be
    ours, but out-of-order here can only come from the peer's bytes driving the caller)."""

    def __init__(
        self,
        *,
        initiator: bool,
        version: int,
        identity: Identity | None,
        swarm_key: bytes | None,
        limits: dict[str, int],
        app: dict[str, Any],
        encrypt: bool = False,
        encrypt_setting: str = "RpcConfig.encrypt",
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self._initiator = initiator
        self._identity = identity
        self._swarm_key = swarm_key
        self._encrypt_setting = encrypt_setting
        self._kx = X25519PrivateKey.generate() if encrypt else None
        self._ours = Hello(
            version=version,
            nonce=random_bytes(NONCE_BYTES),
            public_key=identity.public_key if identity is not None else None,
            uses_swarm_key=swarm_key is not None,
            limits=dict(limits),
            app=dict(app),
            encrypt=encrypt,
            kx=None if self._kx is None else self._kx.public_key().public_bytes(
                serialization.Encoding.Raw, serialization.PublicFormat.Raw
            ),
        )
        self._our_raw = self._ours.encode()
        if len(self._our_raw) > MAX_HELLO_BYTES:
            raise ValueError(f"our hello is {len(self._our_raw)} bytes, over {MAX_HELLO_BYTES}: shrink `app`")
        self._theirs: Hello | None = None
        self._transcript: bytes | None = None
        self._keys: tuple[bytes, bytes] | None = None  # (send, receive)

    def hello_bytes(self) -> bytes:
        return self._our_raw

    def receive_hello(self, raw: bytes) -> bytes:
        """Check the peer's hello and return the proof message we must send."""
        if self._theirs is not None:
            raise HandshakeError("peer sent a second hello")
        theirs = Hello.decode(raw)
        if theirs.version != self._ours.version:
            raise HandshakeError(f"peer speaks wire version {theirs.version}, we speak {self._ours.version}",
                                 "incompatible")
        if theirs.uses_swarm_key != self._ours.uses_swarm_key:
            raise HandshakeError("one side uses a swarm key and the other does not", "swarm_key")
        if theirs.encrypt != self._ours.encrypt:
            raise HandshakeError(
                f"we {'require' if self._ours.encrypt else 'refuse'} encryption and the peer "
                f"{'does not' if self._ours.encrypt else 'requires it'}: both sides must set the same "
                f"{self._encrypt_setting}",
                "incompatible",
            )
        if theirs.nonce == self._ours.nonce:
            raise HandshakeError("peer echoed our nonce")
        self._theirs = theirs
        first, second = (self._our_raw, raw) if self._initiator else (raw, self._our_raw)
        self._transcript = CONTEXT + hashlib.sha256(first).digest() + hashlib.sha256(second).digest()
        if self._kx is not None:
            assert theirs.kx is not None
            self._keys = self._derive_keys(theirs.kx)
        our_role = ROLE_INITIATOR if self._initiator else ROLE_RESPONDER
        proof = {
            "sig": self._identity.sign(our_role + self._transcript) if self._identity is not None else None,
            "mac": self._mac(our_role) if self._swarm_key is not None else None,
        }
        return msgpack.packb(proof, use_bin_type=True)

    def receive_proof(self, raw: bytes) -> PeerHello:
        if self._theirs is None or self._transcript is None:
            raise HandshakeError("peer sent its proof before its hello")
        body = _unpack(raw, "proof")
        sig, mac = body.get("sig"), body.get("mac")
        their_role = ROLE_RESPONDER if self._initiator else ROLE_INITIATOR
        peer_id = None
        if self._theirs.public_key is not None:
            if not isinstance(sig, bytes) or len(sig) != SIGNATURE_BYTES:
                raise HandshakeError("peer announced a public key but sent no valid signature", "spoofed_id")
            if not verify(self._theirs.public_key, sig, their_role + self._transcript):
                raise HandshakeError(f"peer claims id {peer_id_of(self._theirs.public_key).hex()} but its signature "
                                     "does not verify: it does not hold that key", "spoofed_id")
            peer_id = peer_id_of(self._theirs.public_key)
        elif sig is not None:
            raise HandshakeError("anonymous peer sent a signature")
        if self._swarm_key is not None:
            if not isinstance(mac, bytes) or not hmac.compare_digest(mac, self._mac(their_role)):
                raise HandshakeError("peer does not know the swarm key", "swarm_key")
        send_key, recv_key = self._keys if self._keys is not None else (None, None)
        return PeerHello(self._theirs, peer_id, send_key, recv_key)

    def _derive_keys(self, their_kx: bytes) -> tuple[bytes, bytes]:
        assert self._kx is not None and self._transcript is not None
        try:
            shared = self._kx.exchange(X25519PublicKey.from_public_bytes(their_kx))
        except ValueError:  # a low-order point: the shared secret would be all zeros
            raise HandshakeError("peer's key exchange is a degenerate X25519 point") from None
        okm = HKDF(
            algorithm=hashes.SHA256(),
            length=2 * SEAL_KEY_BYTES,
            salt=hashlib.sha256(self._transcript).digest(),
            info=SEAL_CONTEXT,
        ).derive(shared)
        to_responder, to_initiator = okm[:SEAL_KEY_BYTES], okm[SEAL_KEY_BYTES:]
        return (to_responder, to_initiator) if self._initiator else (to_initiator, to_responder)

    def _mac(self, role: bytes) -> bytes:
        assert self._swarm_key is not None and self._transcript is not None
        return hmac.new(self._swarm_key, b"swarm key " + role + self._transcript, hashlib.sha256).digest()


def _unpack(raw: bytes, what: str) -> dict[str, Any]:
    if len(raw) > MAX_HELLO_BYTES:
        raise HandshakeError(f"{what} is {len(raw)} bytes, over {MAX_HELLO_BYTES}")
    try:
        body = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_HELLO_STR,
            max_bin_len=MAX_HELLO_STR,
            max_array_len=MAX_HELLO_ITEMS,
            max_map_len=MAX_HELLO_ITEMS,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise HandshakeError(f"{what} is not valid msgpack: {exc}") from None
    if not isinstance(body, dict):
        raise HandshakeError(f"{what} is not a map")
    return body
