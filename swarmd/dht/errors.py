"""The DHT's exception tree, split by whose fault it was.

`DHTProtocolError` means a remote peer sent a payload that breaks the schema: the RPC adapter turns it
into `RpcError("bad_request", ...)`. `RecordRejected` is a well-formed record we refuse to hold (bad
signature, wrong owner, over a limit); a store RPC reports those per record instead of failing whole.
`DHTUsageError` is our own caller's mistake. `CallFailed` and its children describe one RPC to one
peer that did not produce an answer; lookups absorb them and back the peer off.
"""

from __future__ import annotations

from swarmd.errors import SwarmdError


class DHTError(SwarmdError):
    """Base of everything swarmd.dht raises."""


class DHTUsageError(DHTError):
    """Local misuse: e.g. asked to store a value over the configured size."""


class DHTProtocolError(DHTError):
    """A remote peer's RPC payload does not match the schema (wrong type, length or count)."""


#: Every reason a record is refused for: a closed set, since each is a metric label value.
REJECTION_REASONS = (
    "bad_key", "bad_subkey", "value_too_large", "bad_expiration", "expired",  # schema and limits
    "unsigned", "wrong_owner", "bad_signature",  # forgeries
    "outdated", "quota", "source_quota", "storage_full", "key_full",  # storage policy
)


class RecordRejected(DHTError):
    """A record is refused; `reason` is a short machine-readable tag (sent back in store replies),
    one of REJECTION_REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        if reason not in REJECTION_REASONS:
            raise ValueError(f"unknown record rejection reason {reason!r}")
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class CallFailed(DHTError):
    """One RPC to one peer failed to produce an answer."""


class PeerUnreachable(CallFailed):
    """The peer refused the connection or the connection broke (a dead host answers this fast)."""


class PeerTimeout(CallFailed):
    """No answer within the per-call timeout (a frozen or partitioned host)."""


class RemoteFailure(CallFailed):
    """The peer answered with a typed error (`code`, e.g. "bad_request")."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class WrongPeer(CallFailed):
    """The peer at an address proved a different id than the contact we were told about."""
