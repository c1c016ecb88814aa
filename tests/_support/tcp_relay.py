"""A TCP relay for transport tests that need to see, or spoil, the bytes between a client and a server.

Kept apart from the tests (which put this folder on `sys.path`): pytest's importlib mode gives test
modules no way to import a conftest, and the traffic counters and the encryption tests both need a
relay that sees every byte: one counts them, the other looks for plaintext and flips a bit.
"""

from __future__ import annotations

import asyncio


class Relay:
    """Forwards every connection to `target` and keeps what crossed: `wire` (both directions, in
    order), `to_server` and `to_client` (byte counts). Once `tamper_next_reply` is set it flips one
    bit in the middle of the next server-to-client chunk, then clears the flag."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.wire = bytearray()
        self.to_server = 0
        self.to_client = 0
        self.tamper_next_reply = False
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> "Relay":
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.address = self._server.sockets[0].getsockname()[:2]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._pump(reader, up_writer, reply=False))
                group.create_task(self._pump(up_reader, writer, reply=True))
        finally:
            writer.close()
            up_writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reply: bool) -> None:
        try:
            while data := await reader.read(65536):
                data = bytearray(data)
                if reply and self.tamper_next_reply:
                    self.tamper_next_reply = False
                    data[len(data) // 2] ^= 0x01
                self.wire += data
                if reply:
                    self.to_client += len(data)
                else:
                    self.to_server += len(data)
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass  # one end hung up hard: the other end learns it when its side is closed
        finally:
            writer.close()
