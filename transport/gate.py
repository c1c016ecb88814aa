"""HelloGate: how many connections may sit unproven (before the welcome) at once, per source
address and in total.

An unproven connection costs us a Connection object, a strict hello decoder and a handshake timer
for up to `handshake_timeout_s`, and costs the peer one TCP connect. Without a cap one host could
open thousands and starve honest peers of file descriptors and of the accept loop. The gate is
checked in `connection_made`, before a byte is read or our hello is sent, and a slot is given back
the moment the hello succeeds or the connection ends, so honest peers get in again as soon as the
deadline clears the stalling ones.
"""

from __future__ import annotations

from collections import Counter
from typing import Any


def source_of(address: Any, peercred: tuple[int, int, int] | None = None) -> str:
    """The key a connection counts under: the remote host for TCP (every port of one host shares a
    quota), the connecting user for Unix sockets (one local user cannot use up root's slots)."""
    if isinstance(address, tuple) and address:
        return str(address[0])
    return f"uid {peercred[1]}" if peercred is not None else "unix"


class HelloGate:
    def __init__(self, per_source: int, total: int) -> None:
        self._per_source, self._total = per_source, total
        self._by_source: Counter[str] = Counter()
        self._count = 0

    @property
    def pending(self) -> int:
        return self._count

    def enter(self, source: str) -> str | None:
        """Take a slot for `source`; returns why not when it is over a limit (nothing is taken)."""
        if self._count >= self._total:
            return f"{self._count} connections already in their hello (max_unproven_connections)"
        if self._by_source[source] >= self._per_source:
            return f"{source} already has {self._by_source[source]} connections in their hello " \
                   f"(max_unproven_per_source)"
        self._by_source[source] += 1
        self._count += 1
        return None

    def leave(self, source: str) -> None:
        self._count -= 1
        self._by_source[source] -= 1
        if self._by_source[source] <= 0:
            del self._by_source[source]
