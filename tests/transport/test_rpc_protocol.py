"""RpcProtocol on bytes alone: no socket, no loop, no clock. Two protocol objects, a caller and a
server, pass each other the bytes their events ask to write; every rule of docs/protocol.md that the
protocol owns (hello sequence, frame kinds per role, ids, answer matching, cancel, goaway) is driven
here, and cancellation is tried at every step of a call's life."""

from __future__ import annotations

import pytest

from transport.errors import ConnectionLost, HandshakeError, LimitExceeded, LocalProtocolError, MalformedFrame
from transport.handshake import Handshake
from transport.identity import Identity
from transport.limits import Limits
from transport.protocol import (
    Answer,
    Broken,
    Cancelled,
    GoingAway,
    Incoming,
    PeerRefused,
    Ready,
    RpcProtocol,
    Send,
)
from transport.seal import Sealer
from transport.wire import ID, MAGIC, PRELUDE, VERSION, Kind, encode_frame

LIMITS = Limits()
KEY = b"k" * 32


def protocol(initiator: bool, *, seed: bytes, encrypt: bool = False, swarm_key: bytes | None = None,
             admit=None, limits: Limits = LIMITS) -> RpcProtocol:
    handshake = Handshake(initiator=initiator, version=VERSION, identity=Identity.from_seed(seed),
                          swarm_key=swarm_key, limits=limits.as_dict(), app={"who": seed.decode()}, encrypt=encrypt)
    return RpcProtocol(handshake, limits, initiator=initiator, encrypt=encrypt, admit=admit)


def joined(frames: list) -> bytes:
    return b"".join(bytes(piece) for piece in frames)


class Link:
    """A caller and a server joined by bytes. `pump` delivers what each side's `Send` events ask
    for until nothing moves, sealing once a side is Ready with keys; other events are kept."""

    def __init__(self, **options) -> None:
        server_options = {k: v for k, v in options.items() if k != "admit"}
        self.client = protocol(True, seed=b"client", **server_options)
        self.server = protocol(False, seed=b"server", **options)
        self.events: dict[str, list] = {"client": [], "server": []}
        self.sealers: dict[str, Sealer | None] = {"client": None, "server": None}
        self.outgoing = {"client": bytearray(joined(self.client.hello_frame())),
                         "server": bytearray(joined(self.server.hello_frame()))}

    def write(self, side: str, frame: list) -> None:
        sealer = self.sealers[side]
        if sealer is None:
            self.outgoing[side] += joined(frame)
        else:
            header, body = sealer.seal(frame)
            self.outgoing[side] += header + body

    def pump(self) -> None:
        while any(self.outgoing.values()):
            for side, peer in (("client", "server"), ("server", "client")):
                data, self.outgoing[side] = bytes(self.outgoing[side]), bytearray()
                if data:
                    self.deliver(peer, data)

    def deliver(self, side: str, data: bytes) -> list:
        """The events `data` makes on `side`; a broken rule is raised here, as the shell would end on it."""
        events = getattr(self, side).receive_data(data)
        for event in events:
            if isinstance(event, Broken):
                raise event.error
            if isinstance(event, Send):
                self.write(side, event.frame)
            elif isinstance(event, Ready) and event.keys is not None:
                self.sealers[side] = Sealer(event.keys[0], lambda pieces: None)
        self.events[side] += events
        return events

    def of(self, side: str, kind: type) -> list:
        return [e for e in self.events[side] if isinstance(e, kind)]


def ready_link(**options) -> Link:
    link = Link(**options)
    link.pump()
    assert link.client.ready and link.server.ready
    return link


def request(rid: int, method: str = "echo", timeout: float | None = 5.0) -> list:
    header = {ID: rid, "m": method, "meta": {}, "x": []}
    if timeout is not None:
        header["t"] = timeout
    return encode_frame(Kind.REQUEST, header)


def answer(kind: Kind, rid: int) -> list:
    return encode_frame(kind, {ID: rid, "meta": {}, "x": []} if kind is not Kind.STREAM_END else {ID: rid})


# ------------------------------------------------------------------------------------- hello


def test_hello_proof_welcome_makes_both_sides_ready_with_each_others_identity():
    link = ready_link()
    (client_ready,), (server_ready,) = link.of("client", Ready), link.of("server", Ready)
    assert client_ready.remote.peer_id == Identity.from_seed(b"server").peer_id
    assert server_ready.remote.peer_id == Identity.from_seed(b"client").peer_id
    assert client_ready.remote.app == {"who": "server"} and client_ready.keys is None


def test_the_hello_delivered_a_byte_at_a_time_gives_the_same_events():
    link = Link()
    for side, peer in (("client", "server"), ("server", "client")):
        data, link.outgoing[side] = bytes(link.outgoing[side]), bytearray()
        for i in range(len(data)):
            link.deliver(peer, data[i : i + 1])
    link.pump()
    assert link.client.ready and link.server.ready
    assert [type(e) for e in link.events["server"]] == [Send, Send, Ready]  # proof, welcome, ready
    assert [type(e) for e in link.events["client"]] == [Send, Ready]


def test_encrypted_hello_gives_keys_and_a_sealed_frame_behind_the_welcome_is_opened():
    link = Link(encrypt=True, swarm_key=KEY)
    # Deliver the client's hello and proof, so the server answers with its welcome...
    link.deliver("server", bytes(link.outgoing["client"]))
    link.outgoing["client"].clear()
    link.deliver("client", bytes(link.outgoing["server"]))
    link.outgoing["server"].clear()
    link.deliver("server", bytes(link.outgoing["client"]))
    link.outgoing["client"].clear()
    assert link.server.ready and not link.client.ready
    # ...then a sealed PING right behind the welcome, in the same read.
    link.write("server", encode_frame(Kind.PING, {}))
    events = link.deliver("client", bytes(link.outgoing["server"]))
    assert [type(e) for e in events] == [Ready, Send]
    assert events[0].keys is not None and joined(events[1].frame) == joined(encode_frame(Kind.PONG, {}))


def test_a_frame_other_than_hello_before_the_welcome_is_a_handshake_error_and_ends_reading():
    client = protocol(True, seed=b"client")
    (broken,) = client.receive_data(joined(request(1)))
    assert isinstance(broken, Broken) and isinstance(broken.error, HandshakeError)
    assert "REQUEST before the hello finished" in str(broken.error)
    assert client.receive_data(joined(request(2))) == []


def test_the_proof_owed_before_a_failing_frame_of_the_same_read_is_still_sent():
    """The server's hello and its proof arrive in one read, and the proof fails (another swarm
    key). Our own proof, owed for the hello, comes out first, so the server can tell why."""
    client = protocol(True, seed=b"client", swarm_key=KEY)
    server = protocol(False, seed=b"server", swarm_key=b"j" * 32)
    server_proof = server.receive_data(joined(client.hello_frame()))
    (owed, broken) = client.receive_data(joined(server.hello_frame()) + joined(server_proof[0].frame))
    assert isinstance(owed, Send) and b"proof" in joined(owed.frame)
    assert isinstance(broken, Broken) and broken.error.reason == "swarm_key"


def test_the_hello_decoder_refuses_a_big_frame_before_the_peer_is_proven():
    """Only the prelude arrives: its announced header length alone is refused, nothing is reserved."""
    server = protocol(False, seed=b"server")
    (broken,) = server.receive_data(PRELUDE.pack(MAGIC, VERSION, Kind.HELLO, 0, 40_000, 0))
    assert isinstance(broken.error, LimitExceeded)


def test_admission_refusal_and_a_failing_hook_refuse_the_hello():
    with pytest.raises(HandshakeError, match="admission refused: not you"):
        ready_link(admit=lambda remote: "not you")

    def broken(remote):
        raise RuntimeError("bug")

    with pytest.raises(HandshakeError, match="the admission check failed"):
        ready_link(admit=broken)


def test_a_refusal_from_the_peer_is_an_event_and_nothing_after_it_is_read():
    client = protocol(True, seed=b"client")
    refusal = RpcProtocol.refusal_frame(HandshakeError("wrong swarm"))
    assert client.receive_data(joined(refusal)) == [PeerRefused("wrong swarm")]
    assert client.receive_data(b"garbage that would not parse") == []


def test_a_repeated_hello_is_refused():
    link = Link()
    hello = bytes(link.outgoing["client"])
    link.deliver("server", hello)
    with pytest.raises(HandshakeError, match="unexpected hello message"):
        link.deliver("server", hello)


# -------------------------------------------------------------------------- calls and roles


def test_a_unary_call_is_an_incoming_request_and_its_response_an_answer():
    link = ready_link()
    rid = link.client.start_call(stream=False)
    (incoming,) = link.deliver("server", joined(request(rid, "echo", 2.5)))
    assert isinstance(incoming, Incoming) and (incoming.rid, incoming.method, incoming.timeout) == (rid, "echo", 2.5)
    (reply,) = link.deliver("client", joined(answer(Kind.RESPONSE, rid)))
    assert isinstance(reply, Answer) and reply.rid == rid and reply.frame.kind is Kind.RESPONSE


def test_call_ids_are_never_reused_on_a_connection():
    link = ready_link()
    first = link.client.start_call(stream=False)
    link.client.end_call(first, untouched=True)
    assert link.client.start_call(stream=True) == first + 1


def test_a_server_serves_an_id_again_only_once_the_first_request_is_done():
    link = ready_link()
    link.deliver("server", joined(request(7)))
    link.server.request_done(7)
    assert [type(e) for e in link.deliver("server", joined(request(7)))] == [Incoming]
    with pytest.raises(MalformedFrame, match="request id 7 is already running"):
        link.deliver("server", joined(request(7)))


@pytest.mark.parametrize("kind", [Kind.STREAM_ITEM, Kind.STREAM_END])
def test_a_stream_frame_answering_a_unary_call_is_malformed(kind):
    link = ready_link()
    rid = link.client.start_call(stream=False)
    with pytest.raises(MalformedFrame, match="does not answer a unary call"):
        link.deliver("client", joined(answer(kind, rid)))


def test_a_response_answering_a_stream_call_is_malformed_and_an_error_answers_either():
    link = ready_link()
    stream = link.client.start_call(stream=True)
    unary = link.client.start_call(stream=False)
    error = encode_frame(Kind.ERROR, {ID: stream, "code": "busy", "msg": "later"})
    assert [e.frame.kind for e in link.deliver("client", joined(error))] == [Kind.ERROR]
    error = encode_frame(Kind.ERROR, {ID: unary, "code": "busy", "msg": "later"})
    assert [e.frame.kind for e in link.deliver("client", joined(error))] == [Kind.ERROR]
    other = link.client.start_call(stream=True)
    with pytest.raises(MalformedFrame, match="does not answer a stream call"):
        link.deliver("client", joined(answer(Kind.RESPONSE, other)))


def test_a_stream_ends_with_its_end_and_a_frame_after_the_end_is_dropped():
    link = ready_link()
    rid = link.client.start_call(stream=True)
    kinds = [Kind.STREAM_ITEM, Kind.STREAM_ITEM, Kind.STREAM_END, Kind.STREAM_ITEM]
    events = link.deliver("client", b"".join(joined(answer(k, rid)) for k in kinds))
    assert [e.frame.kind for e in events] == kinds[:3]


@pytest.mark.parametrize("side, kind", [
    ("server", Kind.RESPONSE), ("server", Kind.STREAM_ITEM), ("server", Kind.ERROR),
    ("client", Kind.REQUEST), ("client", Kind.CANCEL),
])
def test_each_role_refuses_the_frame_kinds_of_the_other(side, kind):
    link = ready_link()
    frame = request(1) if kind is Kind.REQUEST else encode_frame(kind, {ID: 1, "meta": {}, "x": []})
    with pytest.raises(MalformedFrame, match=f"{kind.name} is not something"):
        link.deliver(side, joined(frame))


def test_only_the_side_that_dialled_makes_calls():
    link = ready_link()
    with pytest.raises(LocalProtocolError):
        link.server.start_call(stream=False)


@pytest.mark.parametrize("header, match", [
    ({ID: 1, "meta": {}, "x": []}, "no method name"),
    ({ID: 1, "m": "echo", "t": -1.0, "meta": {}, "x": []}, "not a finite number"),
    ({ID: 1, "m": "echo", "t": float("inf"), "meta": {}, "x": []}, "not a finite number"),
    ({ID: 1, "m": "echo", "t": "soon", "meta": {}, "x": []}, "not a finite number"),
    ({ID: -1, "m": "echo", "meta": {}, "x": []}, "no valid"),
    ({ID: True, "m": "echo", "meta": {}, "x": []}, "no valid"),
])
def test_a_malformed_request_header_is_refused(header, match):
    link = ready_link()
    with pytest.raises(MalformedFrame, match=match):
        link.deliver("server", joined(encode_frame(Kind.REQUEST, header)))


def test_a_call_before_the_hello_finished_is_our_mistake():
    with pytest.raises(LocalProtocolError, match="before the hello finished"):
        protocol(True, seed=b"client").start_call(stream=False)


def test_a_ping_is_answered_with_a_pong():
    link = ready_link()
    (send,) = link.deliver("server", joined(encode_frame(Kind.PING, {})))
    assert joined(send.frame) == joined(encode_frame(Kind.PONG, {}))


# ------------------------------------------------------------------ cancel at every step


def test_giving_up_before_the_request_is_queued_owes_the_server_nothing():
    link = ready_link()
    rid = link.client.start_call(stream=False)
    assert link.client.end_call(rid, untouched=True) is None


def test_giving_up_on_a_request_still_wholly_queued_owes_the_server_nothing():
    link = ready_link()
    rid = link.client.start_call(stream=False)
    link.client.call_sent(rid)
    assert link.client.end_call(rid, untouched=True) is None


@pytest.mark.parametrize("items", [0, 1, 3])
def test_giving_up_once_the_request_left_sends_cancel_and_the_server_hears_it(items):
    """Steps: the request reaches the server, `items` stream items come back, the caller gives up.
    Expected: a CANCEL for that id, a Cancelled event on the server, and the items that were
    already on their way afterwards dropped without an event."""
    link = ready_link()
    rid = link.client.start_call(stream=True)
    link.client.call_sent(rid)
    link.deliver("server", joined(request(rid)))
    link.deliver("client", b"".join(joined(answer(Kind.STREAM_ITEM, rid)) for _ in range(items)))
    cancel = link.client.end_call(rid, untouched=False)
    assert cancel is not None and joined(cancel) == joined(encode_frame(Kind.CANCEL, {ID: rid}))
    assert link.deliver("server", joined(cancel)) == [Cancelled(rid)]
    assert link.deliver("client", joined(answer(Kind.STREAM_ITEM, rid)) + joined(answer(Kind.STREAM_END, rid))) == []


def test_giving_up_after_the_final_answer_owes_nothing_and_a_second_give_up_is_harmless():
    link = ready_link()
    rid = link.client.start_call(stream=False)
    link.client.call_sent(rid)
    link.deliver("client", joined(answer(Kind.RESPONSE, rid)))
    assert link.client.end_call(rid, untouched=False) is None
    assert link.client.end_call(rid, untouched=False) is None


def test_a_cancel_for_a_request_not_being_served_is_ignored():
    link = ready_link()
    assert link.deliver("server", joined(encode_frame(Kind.CANCEL, {ID: 9}))) == []
    link.deliver("server", joined(request(9)))
    link.server.request_done(9)
    assert link.deliver("server", joined(encode_frame(Kind.CANCEL, {ID: 9}))) == []


def test_giving_up_after_the_connection_closed_owes_nothing():
    link = ready_link()
    rid = link.client.start_call(stream=False)
    link.client.call_sent(rid)
    assert link.client.close(ConnectionLost("gone")) and not link.client.close(ConnectionLost("again"))
    assert link.client.end_call(rid, untouched=False) is None
    assert link.client.receive_data(joined(answer(Kind.RESPONSE, rid))) == []


def test_a_cancel_split_across_reads_is_heard_once_whole():
    link = ready_link()
    link.deliver("server", joined(request(3)))
    cancel = joined(encode_frame(Kind.CANCEL, {ID: 3}))
    assert link.deliver("server", cancel[:5]) == []
    assert link.deliver("server", cancel[5:]) == [Cancelled(3)]


# ------------------------------------------------------------------------------- goaway


def test_goaway_from_the_peer_stops_new_calls_but_not_answers_to_running_ones():
    link = ready_link()
    rid = link.client.start_call(stream=False)
    assert link.deliver("client", joined(encode_frame(Kind.GOAWAY, {}))) == [GoingAway()]
    with pytest.raises(ConnectionLost, match="going away"):
        link.client.start_call(stream=False)
    assert [type(e) for e in link.deliver("client", joined(answer(Kind.RESPONSE, rid)))] == [Answer]


def test_our_goaway_is_a_frame_once_ready_and_nothing_during_the_hello():
    assert protocol(True, seed=b"client").goaway_frame() is None
    link = ready_link()
    frame = link.server.goaway_frame()
    assert frame is not None and link.server.going_away
    assert link.deliver("client", joined(frame)) == [GoingAway()]


def test_an_error_frame_keeps_its_message_within_the_peers_string_limit():
    """Four bytes per character at most: the message is cut to a quarter of the peer's max_str_len."""
    link = ready_link()
    rid = link.client.start_call(stream=False)
    long = "é" * LIMITS.max_str_len
    (reply,) = link.deliver("client", joined(link.server.error_frame(rid, "c" * 100, long)))
    assert reply.frame.header["msg"] == long[: LIMITS.max_str_len // 4] and reply.frame.header["code"] == "c" * 64
