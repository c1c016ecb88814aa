"""The hello exchange on bytes: who proves what, and every way a peer can get it wrong."""

from __future__ import annotations

import msgpack
import pytest

from transport.errors import HandshakeError
from transport.handshake import Handshake, Hello
from transport.identity import Identity


def _side(initiator: bool, *, identity=None, swarm_key=None, version=1, app=None, seed=0):
    counter = iter(range(seed * 1000, seed * 1000 + 1000))
    return Handshake(
        initiator=initiator,
        version=version,
        identity=identity,
        swarm_key=swarm_key,
        limits={"max_frame_bytes": 1 << 20},
        app=app or {},
        random_bytes=lambda n: bytes([next(counter) % 256]) * n,
    )


def _exchange(a: Handshake, b: Handshake):
    proof_a = a.receive_hello(b.hello_bytes())
    proof_b = b.receive_hello(a.hello_bytes())
    return a.receive_proof(proof_b), b.receive_proof(proof_a)


def test_both_sides_prove_their_peer_ids_and_see_each_others_app():
    ida, idb = Identity.from_seed(b"a"), Identity.from_seed(b"b")
    a = _side(True, identity=ida, app={"announce": "10.0.0.1:7000"}, seed=1)
    b = _side(False, identity=idb, app={"announce": "10.0.0.2:7000"}, seed=2)
    seen_by_a, seen_by_b = _exchange(a, b)
    assert seen_by_a.peer_id == idb.peer_id and seen_by_a.public_key == idb.public_key
    assert seen_by_b.peer_id == ida.peer_id
    assert seen_by_a.hello.app == {"announce": "10.0.0.2:7000"}
    assert seen_by_b.hello.limits == {"max_frame_bytes": 1 << 20}


def test_anonymous_side_has_no_peer_id():
    a, b = _side(True, seed=1), _side(False, identity=Identity.from_seed(b"b"), seed=2)
    seen_by_a, seen_by_b = _exchange(a, b)
    assert seen_by_b.peer_id is None
    assert seen_by_a.peer_id == Identity.from_seed(b"b").peer_id


def test_matching_swarm_key_passes_and_wrong_key_is_refused_on_both_sides():
    ok_a, ok_b = _side(True, swarm_key=b"k" * 32, seed=1), _side(False, swarm_key=b"k" * 32, seed=2)
    _exchange(ok_a, ok_b)
    a, b = _side(True, swarm_key=b"k" * 32, seed=1), _side(False, swarm_key=b"x" * 32, seed=2)
    proof_a, proof_b = a.receive_hello(b.hello_bytes()), b.receive_hello(a.hello_bytes())
    with pytest.raises(HandshakeError, match="swarm key"):
        a.receive_proof(proof_b)
    with pytest.raises(HandshakeError, match="swarm key"):
        b.receive_proof(proof_a)


def test_key_on_one_side_only_is_refused_at_hello():
    a, b = _side(True, swarm_key=b"k" * 32, seed=1), _side(False, seed=2)
    with pytest.raises(HandshakeError, match="swarm key"):
        a.receive_hello(b.hello_bytes())


def test_signature_by_another_key_is_refused():
    """An impostor announces the victim's public key but can only sign with its own key."""
    victim, impostor = Identity.from_seed(b"victim"), Identity.from_seed(b"impostor")
    honest = _side(True, identity=Identity.from_seed(b"a"), seed=1)
    fake = _side(False, identity=impostor, seed=2)
    forged_hello = Hello.decode(fake.hello_bytes())
    forged_raw = Hello(forged_hello.version, forged_hello.nonce, victim.public_key, False,
                       forged_hello.limits, forged_hello.app).encode()
    honest.receive_hello(forged_raw)
    # The best the impostor can do: sign the exact transcript the honest side holds, with its own key.
    sig = impostor.sign(b"responder" + honest._transcript)
    with pytest.raises(HandshakeError, match="signature"):
        honest.receive_proof(msgpack.packb({"sig": sig, "mac": None}))


def test_reflected_proof_is_refused():
    """Sending a side its own proof back fails: each proof names its author's role."""
    ident = Identity.from_seed(b"same")
    a, b = _side(True, identity=ident, seed=1), _side(False, identity=ident, seed=2)
    proof_a = a.receive_hello(b.hello_bytes())
    b.receive_hello(a.hello_bytes())
    with pytest.raises(HandshakeError, match="signature"):
        a.receive_proof(proof_a)


def test_missing_signature_and_out_of_order_and_garbage_are_typed():
    a = _side(True, seed=1)
    with pytest.raises(HandshakeError, match="before its hello"):
        a.receive_proof(msgpack.packb({"sig": None}))
    b = _side(False, identity=Identity.from_seed(b"b"), seed=2)
    a.receive_hello(b.hello_bytes())
    with pytest.raises(HandshakeError, match="no valid signature"):
        a.receive_proof(msgpack.packb({"sig": None, "mac": None}))
    with pytest.raises(HandshakeError, match="second hello"):
        a.receive_hello(b.hello_bytes())
    for junk in (b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"v": 1}), b"\x00" * 20000):
        with pytest.raises(HandshakeError):
            _side(True, seed=3).receive_hello(junk)


def test_version_mismatch_is_refused():
    a, b = _side(True, version=1, seed=1), _side(False, version=2, seed=2)
    with pytest.raises(HandshakeError, match="version"):
        a.receive_hello(b.hello_bytes())
