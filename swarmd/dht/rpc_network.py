"""The DHT over the project's RPC: `RpcNetwork` puts a DHTNode on a transport Router and Pool.

A caller's id is the one its connection proved in the handshake (`Request.peer.peer_id`), never a
field of the payload; a responder's id is the one `Pool.connect` proved when we dialled. The
caller's reachable address travels in the request's `addr` field (its hello's app dict may also
carry it as "announce"); an unspecified host ("0.0.0.0") is replaced by the host we saw the
connection come from. Transport failures map onto the DHT's CallFailed tree here, and a payload
the schema refuses becomes RpcError("bad_request", ...).

A daemon shares one Router/RpcServer and one Pool between the DHT and everything else and passes
them in; `RpcNetwork.listen` builds its own pair for tests, benchmarks and standalone nodes.
"""

from __future__ import annotations

import asyncio

import swarmd.dht.protocol as P
from transport.errors import (ConnectionLost, DeadlineExceeded, LocalProtocolError, ProtocolError, RemoteError,
                              RpcError, TransportError)
from transport.identity import Identity
from transport.rpc import Message, Pool, Request, Router, RpcConfig, RpcServer

from .config import DHTConfig
from .errors import DHTProtocolError, PeerTimeout, PeerUnreachable, RemoteFailure
from .network import Caller, Handler, Reply

BAD_REQUEST = "bad_request"
NOT_SERVING = "not_serving"


class RpcNetwork:
    def __init__(self, router: Router, pool: Pool, address: str, config: DHTConfig = DHTConfig(), *,
                 owned_server: RpcServer | None = None, owns_pool: bool = False) -> None:
        """`address` is our announce "host:port"; what we are told we own, `stop()` closes."""
        self._router, self._pool, self._address, self._config = router, pool, address, config
        self._server, self._owns_pool = owned_server, owns_pool
        self._handler: Handler | None = None
        for method in P.METHODS:
            router.unary(method, self._serve)

    @classmethod
    async def listen(cls, identity: Identity, host: str = "127.0.0.1", port: int = 0,
                     config: DHTConfig = DHTConfig(), rpc: RpcConfig | None = None) -> "RpcNetwork":
        """A network with its own TCP server and pool (the pool is closed with it too)."""
        rpc = rpc or RpcConfig(identity=identity)
        router = Router()
        server = await RpcServer.serve_tcp(router, host, port, config=rpc)
        bound_host, bound_port = server.address
        address = f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"
        return cls(router, Pool(rpc), address, config, owned_server=server, owns_pool=True)

    @property
    def address(self) -> str:
        return self._address

    async def start(self, handler: Handler) -> None:
        self._handler = handler

    async def stop(self) -> None:
        self._handler = None
        if self._server is not None:
            await self._server.close()
            self._server = None
        if self._owns_pool:
            self._owns_pool = False
            await self._pool.close()

    async def call(self, address: str, method: str, meta: dict, timeout: float) -> Reply:
        meta = P.with_addr(meta, self._address)
        try:
            async with asyncio.timeout(timeout):
                conn = await self._pool.connect(address)
                reply = await conn.call(method, Message(meta=meta), timeout=timeout)
        except (TimeoutError, DeadlineExceeded):
            raise PeerTimeout(f"{address}: no answer to {method} within {timeout:.2f}s") from None
        except RemoteError as e:
            raise RemoteFailure(e.code, e.message) from None
        except (ConnectionLost, ProtocolError, LocalProtocolError, TransportError) as e:
            raise PeerUnreachable(f"{address}: {e}") from None
        peer_id = conn.remote.peer_id if conn.remote is not None else None
        if peer_id is None:
            raise PeerUnreachable(f"{address} did not prove an identity")
        return Reply(peer_id, reply.meta)

    async def _serve(self, req: Request) -> Message:
        handler = self._handler
        if handler is None:
            raise RpcError(NOT_SERVING, "this DHT node is stopped")
        if req.peer.peer_id is None or req.peer.public_key is None:
            raise RpcError(BAD_REQUEST, "the DHT needs an authenticated caller")
        try:
            addr = P.parse_addr(req.meta, self._config) or _announced(req.peer.app)
            caller = Caller(req.peer.peer_id, req.peer.public_key, _fill_host(addr, req.peer.address),
                            _seen_host(req.peer.address))
            return Message(meta=await handler(caller, req.method, req.meta))
        except DHTProtocolError as e:
            raise RpcError(BAD_REQUEST, str(e)) from None


def _announced(app: object) -> str | None:
    value = app.get("announce") if isinstance(app, dict) else None
    return value if isinstance(value, str) and ":" in value else None


def _seen_host(seen: object) -> str | None:
    """The host a connection came from (a Unix socket has none: every local caller is one)."""
    return str(seen[0]) if isinstance(seen, tuple) and seen else "local-socket"


def _fill_host(addr: str | None, seen: object) -> str | None:
    """Replace an unspecified announce host with the address the connection came from."""
    if addr is None:
        return None
    host, _, port = addr.rpartition(":")
    if host.strip("[]") in ("", "0.0.0.0", "::") and isinstance(seen, tuple) and seen:
        observed = str(seen[0])
        return f"[{observed}]:{port}" if ":" in observed else f"{observed}:{port}"
    return addr
