"""RpcServer: accept connections on TCP or a Unix socket and serve a Router on each.

The server owns its connections (and through them every handler task); `close()` stops accepting,
asks each connection to go away, lets running handlers finish within `close_timeout_s`, then
cancels the rest, in that order.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from pathlib import Path
from typing import Any

from .config import RpcConfig
from .connection import Admit, AdmitLocal, Connection
from .gate import HelloGate
from .message import Router
from .ratelimit import PeerCalls, RateLimiter

log = logging.getLogger(__name__)


class RpcServer:
    def __init__(self, router: Router, config: RpcConfig, admit: Admit | None,
                 admit_local: AdmitLocal | None = None) -> None:
        self._router, self._config, self._admit, self._admit_local = router, config, admit, admit_local
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[Connection] = set()
        self._unix_path: str | None = None
        self.address: Any = None
        # Shared by all connections: a peer's quota does not reset when it reconnects.
        self._gate = HelloGate(config.max_unproven_per_source, config.max_unproven_connections)
        self._limiter = (
            None
            if config.rate_limit_per_s is None
            else RateLimiter(
                config.rate_limit_per_s,
                config.rate_limit_burst,
                config.rate_limit_peers,
                asyncio.get_running_loop().time,
            )
        )

    @classmethod
    async def serve_tcp(
        cls,
        router: Router,
        host: str = "127.0.0.1",
        port: int = 0,
        config: RpcConfig = RpcConfig(),
        admit: Admit | None = None,
    ) -> "RpcServer":
        """Listen on host:port (port 0 picks a free one; see `.port`)."""
        self = cls(router, config, admit)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._make_connection, host, port, reuse_address=True)
        self.address = self._server.sockets[0].getsockname()[:2]
        return self

    @classmethod
    async def serve_unix(
        cls,
        router: Router,
        path: str | os.PathLike | None = None,
        sock: socket.socket | None = None,
        config: RpcConfig = RpcConfig(),
        admit: Admit | None = None,
        admit_local: AdmitLocal | None = None,
    ) -> "RpcServer":
        """Listen on a Unix socket at `path`, or on an already bound `sock` (systemd socket
        activation hands us one); admission can use `RemoteInfo.peercred` after the hello, and
        `admit_local` the same credentials at accept, before the connection takes any slot."""
        if (path is None) == (sock is None):
            raise ValueError("serve_unix takes exactly one of path= and sock=")
        self = cls(router, config, admit, admit_local)
        loop = asyncio.get_running_loop()
        if path is not None:
            self._unix_path = str(Path(path))
            self._server = await loop.create_unix_server(self._make_connection, path=self._unix_path)
            self.address = f"unix:{self._unix_path}"
        else:
            self._server = await loop.create_unix_server(self._make_connection, sock=sock)
            self.address = f"unix:{sock.getsockname()}"
        return self

    @property
    def port(self) -> int | None:
        return self.address[1] if isinstance(self.address, tuple) else None

    @property
    def connections(self) -> int:
        return len(self._connections)

    @property
    def unproven_connections(self) -> int:
        """Connections still in their hello (what `max_unproven_connections` bounds)."""
        return self._gate.pending

    def peer_calls(self) -> dict[Any, PeerCalls]:
        """Per-peer call counts of the rate limiter (peer id bytes, or ("source", host) when
        anonymous): who was refused how often; empty when rate limiting is off."""
        return {} if self._limiter is None else self._limiter.calls()

    def _make_connection(self) -> Connection:
        conn = Connection(
            self._config,
            initiator=False,
            router=self._router,
            admit=self._admit,
            on_closed=self._connections.discard,
            gate=self._gate,
            limiter=self._limiter,
            admit_local=self._admit_local,
        )
        self._connections.add(conn)
        return conn

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        connections = list(self._connections)
        if connections:
            await asyncio.gather(*(conn.close() for conn in connections))
        if self._server is not None:
            await self._server.wait_closed()
        if self._unix_path is not None:
            try:
                os.unlink(self._unix_path)
            except FileNotFoundError:
                pass
            self._unix_path = None
