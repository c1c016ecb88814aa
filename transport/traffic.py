"""Bytes on the wire, counted where they meet the socket, for operators' metrics.

One `Traffic` object is shared by every connection built from the same `RpcConfig`, so a daemon
reads its totals without walking connections. Counts are of socket bytes (sealed records and frame
headers included), which is what a link's capacity is spent on. Everything runs on the event loop,
so plain integers suffice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(eq=False)  # a counter is itself, not its current values
class Traffic:
    sent_bytes: int = 0
    received_bytes: int = 0

    def counting(self, writelines: Callable[[list], None]) -> Callable[[list], None]:
        """`writelines` that adds what it writes to `sent_bytes`."""

        def write(pieces: list) -> None:
            self.sent_bytes += sum(memoryview(piece).nbytes for piece in pieces)
            writelines(pieces)

        return write
