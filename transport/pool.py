"""Pool: one persistent connection per peer address, dialled on first use and again after it dies.

A peer that restarts (preempted, upgraded) closes or resets its connections; the pool drops the
dead one when it notices and the next call dials afresh. Concurrent first calls to one address
share a single dial. A call already sent on a connection that dies fails with ConnectionLost and is
not retried here: only the caller knows whether repeating it is safe.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .config import RpcConfig
from .connection import Connection, StreamCall
from .errors import DeadlineExceeded, LocalProtocolError
from .message import Message
from .tasks import TaskSet

Address = str | tuple[str, int]


def parse_address(addr: Address) -> tuple[str, int] | str:
    """("host", port) for TCP or "unix:/path"; accepts "host:port" and "[v6]:port" strings."""
    if isinstance(addr, tuple):
        host, port = addr
        return _resolvable(str(host), repr(addr)), int(port)
    if not isinstance(addr, str):
        raise LocalProtocolError(f"an address is 'host:port', (host, port) or 'unix:/path', got {addr!r}")
    if addr.startswith("unix:"):
        if len(addr) == len("unix:"):
            raise LocalProtocolError("unix: address without a path")
        return addr
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not host or not 0 < int(port) < 65536:
        raise LocalProtocolError(f"address {addr!r} is not host:port (a port in 1..65535)")
    return _resolvable(host.strip("[]"), addr), int(port)


def _resolvable(host: str, addr: str) -> str:
    """`host`, if the resolver can encode it. Addresses come from strangers (DHT contacts, stage
    announcements), and `getaddrinfo` refuses a name with an empty or over-long label (`a..b`) by
    raising UnicodeError (a NUL in it: ValueError), which no caller expects of a dial: one such
    contact made every DHT lookup that met it raise. Here it is refused as the bad address it is."""
    try:
        if "\0" in host:
            raise UnicodeError("NUL in a host name")
        host.encode("idna")
    except UnicodeError:
        raise LocalProtocolError(f"address {addr!r}: the host is not a name the resolver accepts") from None
    return host


class Pool:
    def __init__(self, config: RpcConfig = RpcConfig()) -> None:
        self.config = config
        self._connections: dict[Any, Connection] = {}
        self._dials: dict[Any, asyncio.Task[Connection]] = {}
        self._retired: set[Connection] = set()  # replaced while going away; closed with the pool
        self._tasks = TaskSet("pool")
        self._closed = False

    async def connect(self, addr: Address) -> Connection:
        """The open connection to `addr`, dialling (once, however many callers wait) if needed."""
        key = parse_address(addr)
        conn = self._connections.get(key)
        if conn is not None:
            if conn.is_open:
                return conn
            self._retired.add(conn)
            del self._connections[key]
        if self._closed:
            raise LocalProtocolError("the pool is closed")
        dial = self._dials.get(key)
        if dial is None:
            dial = self._dials[key] = self._tasks.spawn(self._dial(key), f"dial {key}")
        return await asyncio.shield(dial)

    async def call(self, addr: Address, method: str, message: Message = Message(), *,
                   timeout: float | None = None) -> Message:
        """One request, one reply; the timeout covers dialling too."""
        timeout = self.config.default_timeout_s if timeout is None else timeout
        conn = self._connections.get(parse_address(addr))
        if conn is not None and conn.is_open:  # the common case: no dial, no second timer
            return await conn.call(method, message, timeout=timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        conn = await self._connect_by(addr, deadline, method, timeout)
        return await conn.call(method, message, timeout=max(0.0, deadline - loop.time()))

    def stream(self, addr: Address, method: str, message: Message = Message(), *,
               timeout: float | None = None) -> StreamCall:
        """A streamed answer: `async with pool.stream(...) as items: async for m in items`."""
        timeout = self.config.default_timeout_s if timeout is None else timeout
        return StreamCall(lambda: self.connect(addr), method, message, timeout)

    async def close(self) -> None:
        self._closed = True
        await self._tasks.aclose("pool closed")
        connections = [*self._connections.values(), *self._retired]
        self._connections.clear()
        self._retired.clear()
        if connections:
            await asyncio.gather(*(conn.close() for conn in connections))

    async def _connect_by(self, addr: Address, deadline: float, method: str, timeout: float) -> Connection:
        try:
            async with asyncio.timeout_at(deadline):
                return await self.connect(addr)
        except TimeoutError:
            raise DeadlineExceeded(f"{method}: could not reach {addr} within {timeout} s") from None

    async def _dial(self, key: Any) -> Connection:
        try:
            conn = await Connection.open(key, self.config, on_closed=self._forget)
            self._connections[key] = conn
            return conn
        finally:
            self._dials.pop(key, None)

    def _forget(self, conn: Connection) -> None:
        self._retired.discard(conn)
        for key, known in list(self._connections.items()):
            if known is conn:
                del self._connections[key]
