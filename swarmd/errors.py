"""The one root of swarmd's own exceptions, split by whose fault a failure is.

`except SwarmdError` catches every failure swarmd raises on purpose and nothing else, so a broad
catch that means "an expected failure" can say so, and a bug (a `TypeError`, a `KeyError`) still
escapes with its traceback. Below the root, the split that changes what a caller does:

- `LocalError`: our side is wrong (a setting, a spec, a request the operator made). Retrying the
  same thing fails the same way; the message names what to fix.
- `PeerError`: the other side is wrong or failed (a peer's malformed gossip, a daemon that refused a
  client's request). Trying again later or elsewhere may succeed; a peer may deserve a ban.

Errors that are neither (a round that failed for several reasons at once, a DHT lookup that found
nothing) subclass the root directly. The transport package keeps its own tree
(`transport.errors.TransportError`, with the same split as `ProtocolError` / `LocalProtocolError`):
it is standalone and never imports swarmd.
"""

from __future__ import annotations


class SwarmdError(Exception):
    """Root of every exception swarmd raises on purpose."""


class LocalError(SwarmdError):
    """This side's input or state is wrong; the message says what to fix here."""


class PeerError(SwarmdError):
    """The remote side (a peer, or the daemon seen from a client) failed or misbehaved."""


class ConfigError(LocalError, ValueError):
    """A setting could not be accepted: `key` is its dotted name (`batch.global_samples`, `dht.k`),
    `source` where it came from (a file path, `environment`, a flag; empty for a job spec's field),
    so the message names the line to fix. The daemon's config and a job's spec raise this one class."""

    def __init__(self, key: str, message: str, *, source: str = "") -> None:
        super().__init__(": ".join(part for part in (source, key, message) if part))
        self.key, self.message, self.source = key, message, source

    @property
    def field(self) -> str:
        """The key, by the name the spec parsers use."""
        return self.key

    def under(self, prefix: str) -> "ConfigError":
        """The same error with its key placed under a parent table."""
        return type(self)(f"{prefix}.{self.key}" if prefix else self.key, self.message, source=self.source)


class Busy(LocalError):
    """This daemon has no room for the request now (a configured limit is reached, named in the
    message); it may succeed later, or on another daemon."""
