"""Everything one connection writes, in the order it should leave: control frames first, then calls
by the outbox's rule (one chunk at a time), with payload bytes reserved against the in-flight
budget before a message is encoded, so a peer that stops reading makes senders wait instead of
making us buffer their tensors without end.

A frame is written at once when nothing is queued and the socket takes data (a small call then
costs no wake-up of the writer task: half the latency of a ping-pong on loopback); otherwise the
writer task (`run`) drains the outbox whenever the transport's buffer has room.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import transport.payload as payload
from .message import Message
from .outbox import Budget, Dropped, Outbox, payload_bytes
from .wire import ID, Kind, Piece, encode_frame, encode_message

Write = Callable[[list[Piece]], None]


class Sender:
    def __init__(self, capacity: int, offload_threshold_bytes: int) -> None:
        self.outbox = Outbox()
        self.budget = Budget(capacity)
        self.last_tx = asyncio.get_running_loop().time()
        self._offload_threshold = offload_threshold_bytes
        self._writable = asyncio.Event()
        self._writable.set()
        self._write: Write | None = None  # None until connected and after the connection ended

    def attach(self, write: Write | None) -> None:
        """Write through `write` from now on (the socket's, a Sealer's); None: write nothing more."""
        self._write = write

    def pause(self) -> None:
        self._writable.clear()

    def resume(self) -> None:
        self._writable.set()

    def control(self, frame: list[Piece]) -> None:
        """A control frame (hello, ping, pong, cancel, goaway): ahead of every call's frames."""
        if not self._write_now(frame):
            self.outbox.put_control(frame)

    def frames(self, key: int, frames: list[list[Piece]]) -> None:
        """Frames of call `key`, whose payload bytes were reserved from the budget."""
        if len(frames) == 1 and self._write_now(frames[0]):
            self.budget.release(payload_bytes(frames[0]))
        else:
            self.outbox.put(key, frames)

    def drop(self, key: int) -> Dropped:
        """Take back what call `key` still has queued, and give its bytes back to the budget."""
        dropped = self.outbox.drop(key)
        self.budget.release(dropped.payload)
        return dropped

    async def message(self, kind: Kind, rid: int, message: Message, extra: dict[str, Any], limits: Any,
                      check_alive: Callable[[], None]) -> None:
        """Encode `message` and queue its frames under call `rid`, after reserving its bytes."""
        tensors = list(message.tensors)
        if not tensors:  # control-sized: no budget, no codec, one frame
            check_alive()
            self.frames(rid, [encode_frame(kind, {ID: rid, **extra, "meta": message.meta, "x": []}, (), limits)])
            return
        held = min(sum(payload.nbytes(t) for t in tensors), self.budget.capacity)
        await self.budget.acquire(held)
        try:
            metas, buffers = await payload.offload(held, self._offload_threshold, payload.encode_all, tensors,
                                                   message.codec)
            frames = encode_message(kind, {ID: rid, **extra, "meta": message.meta, "x": metas}, buffers, limits)
            actual = sum(memoryview(b).nbytes for b in buffers)
            if actual > held:
                # Grown past the reservation (a codec's framing, or a message over the peer's
                # window): reserve it whole again. A top-up while holding `held` could never be
                # granted past the capacity, since only a lone reservation may be oversized.
                self.budget.release(held)
                held = 0
                await self.budget.acquire(actual)
            else:
                self.budget.release(held - actual)
            held = actual
            check_alive()
            self.frames(rid, frames)
        except BaseException:
            self.budget.release(held)
            raise

    async def run(self) -> None:
        """The writer task: one queued frame at a time, whenever the transport takes more."""
        while True:
            await self._writable.wait()
            item = await self.outbox.get()
            if self._write is not None:
                self._write(item.frame)
                self.last_tx = asyncio.get_running_loop().time()
            if item.payload:
                self.budget.release(item.payload)

    def _write_now(self, frame: list[Piece]) -> bool:
        if self.outbox or not self._writable.is_set() or self._write is None:
            return False
        self._write(frame)
        self.last_tx = asyncio.get_running_loop().time()
        return True
