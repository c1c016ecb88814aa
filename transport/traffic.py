"""What came over the wire, counted where it meets the socket, for operators' metrics.

One `Traffic` object is shared by every connection built from the same `RpcConfig`, so a daemon
reads its totals without walking connections. Byte counts are of socket bytes (sealed records and
frame headers included), which is what a link's capacity is spent on. Next to them are the signs
of a hostile or misconfigured peer that the transport sees first: calls refused by the rate
limiter and hellos that failed, by a reason from a closed set (never by peer, whose number a
peer controls). Everything runs on the event loop, so plain integers suffice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import HANDSHAKE_FAILURE_REASONS


@dataclass(eq=False)  # a counter is itself, not its current values
class Traffic:
    sent_bytes: int = 0
    received_bytes: int = 0
    #: Calls answered "rate_limited" by a server built from this config (its peers' calls only).
    rate_limited_calls: int = 0
    #: Failed hellos, both directions, by HandshakeError.reason; every reason is present.
    hello_failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(HANDSHAKE_FAILURE_REASONS, 0))

    def failed_hello(self, reason: str) -> None:
        self.hello_failures[reason] += 1

    def counting(self, writelines: Callable[[list], None]) -> Callable[[list], None]:
        """`writelines` that adds what it writes to `sent_bytes`."""

        def write(pieces: list) -> None:
            self.sent_bytes += sum(memoryview(piece).nbytes for piece in pieces)
            writelines(pieces)

        return write
