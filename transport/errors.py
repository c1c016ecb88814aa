"""One exception tree for the transport, split by whose fault it was.

Local misuse (a bug in our code) and remote misbehaviour (a peer sent bytes we refuse) are kept
apart, as h11 does, so callers can ban a peer for the second without masking the first. Foreign
exceptions (OSError, msgpack, lz4) are converted at the edge into these.
"""

from __future__ import annotations


class TransportError(Exception):
    """Base of everything the transport raises."""


class LocalProtocolError(TransportError):
    """We were asked to send something the protocol or our own limits forbid."""


class ProtocolError(TransportError):
    """The remote side sent bytes that break the protocol; the connection is closed."""


class LimitExceeded(ProtocolError):
    """A length announced by the peer is past a configured limit; nothing was allocated for it."""

    def __init__(self, what: str, got: int, limit: int) -> None:
        super().__init__(f"{what} is {got}, over the limit of {limit}")
        self.what, self.got, self.limit = what, got, limit


class BadMagic(ProtocolError):
    """The stream does not start with our frame magic (not a swarmd peer, or desynchronised)."""


class UnsupportedVersion(ProtocolError):
    """The peer speaks a wire version we do not."""


class MalformedFrame(ProtocolError):
    """The frame's header or layout is not what the format says (bad msgpack, missing fields...)."""


class CodecError(ProtocolError):
    """A tensor payload does not decode to what its metadata announces."""


#: Why a hello failed, as counted for operators (a closed set: a metric label must not grow with
#: what peers send). "malformed" is the catch-all: bad msgpack, wrong order, missing fields.
HANDSHAKE_FAILURE_REASONS = (
    "deadline",  # no hello within handshake_timeout_s (a slow-loris, or a peer that is not swarmd)
    "unproven_limit",  # dropped on accept: too many connections still in their hello
    "spoofed_id",  # a public key announced without a signature made with it
    "swarm_key",  # one side is in a private swarm and the other does not know its key
    "incompatible",  # wire version, encryption setting or chunk size the two sides cannot agree on
    "admission",  # the server's admission check refused the proven peer
    "refused_by_peer",  # the other side refused our hello (its reason is in our log)
    "malformed",
)


class HandshakeError(ProtocolError):
    """The hello exchange failed: bad signature, wrong swarm key, timeout or wrong order;
    `reason` is one of HANDSHAKE_FAILURE_REASONS."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        if reason not in HANDSHAKE_FAILURE_REASONS:
            raise ValueError(f"unknown handshake failure reason {reason!r}")
        super().__init__(message)
        self.reason = reason


class SealError(ProtocolError):
    """An encrypted record failed authentication or came out of order: altered, replayed, dropped
    or reordered on the way (or sent under other keys)."""


class ConnectionLost(TransportError):
    """The connection closed (or was reset) while a call was outstanding."""


class DeadlineExceeded(TransportError):
    """The call's deadline passed before an answer arrived."""


class RemoteError(TransportError):
    """The remote handler failed; `code` is a short machine-readable tag, `message` a sentence."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class RpcError(Exception):
    """Raised by a handler to send a typed error back to the caller (arrives as RemoteError)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message
