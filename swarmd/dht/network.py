"""How a DHT node talks to peers: the `Network` interface and an in-memory implementation.

The node needs three things from a network: its own announce address, a way to serve requests
(each tagged with the caller's *proven* id and address), and `call(address, method, meta, timeout)`
returning the reply together with the responder's proven id. `rpc_network.RpcNetwork` provides them
over `transport.rpc`; `InMemoryFabric` provides them inside one process so that a thousand nodes run
on a virtual clock (see swarmd.clock.VirtualEventLoop), with seeded latency, loss, and two kinds of
failure: *dead* (the host's port refuses at once, as a closed socket does) and *frozen* (nothing ever
comes back, as from a preempted host; the caller waits out its timeout).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

from transport.identity import Identity

from .errors import DHTProtocolError, PeerTimeout, PeerUnreachable, RemoteFailure


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request: id and key from the handshake, address they can be reached at (if
    known, and claimed by them), and `source`, the host the request's connection came from (seen
    by us, so storage can share a key's slots by network; None only for our own calls)."""

    peer_id: bytes
    public_key: bytes
    address: str | None
    source: str | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    peer_id: bytes  # the responder's id, proven by the connection, not claimed by the payload
    meta: dict


Handler = Callable[[Caller, str, Any], Awaitable[dict]]


class Network(Protocol):
    @property
    def address(self) -> str: ...

    async def start(self, handler: Handler) -> None: ...

    async def stop(self) -> None: ...

    async def call(self, address: str, method: str, meta: dict, timeout: float) -> Reply:
        """Raises PeerUnreachable, PeerTimeout or RemoteFailure when no answer comes back."""
        ...


UP, DEAD, FROZEN = "up", "dead", "frozen"


def _wire(meta: Any) -> Any:
    """Round-trip through msgpack, as a real transport would: nothing but wire types get through."""
    return msgpack.unpackb(msgpack.packb(meta, use_bin_type=True), raw=False)


class InMemoryFabric:
    """The shared medium for in-memory endpoints; all randomness comes from one seeded generator."""

    def __init__(self, seed: int = 0, latency: tuple[float, float] = (0.005, 0.05), loss: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.latency = latency
        self.loss = loss
        self.calls = 0
        self._endpoints: dict[str, InMemoryNetwork] = {}
        self._state: dict[str, str] = {}

    def endpoint(self, identity: Identity, address: str) -> "InMemoryNetwork":
        if address in self._endpoints:
            raise ValueError(f"address {address} is taken")
        ep = InMemoryNetwork(self, identity, address)
        self._endpoints[address] = ep
        self._state[address] = UP
        return ep

    def kill(self, address: str) -> None:
        self._state[address] = DEAD

    def freeze(self, address: str) -> None:
        self._state[address] = FROZEN

    def revive(self, address: str) -> None:
        self._state[address] = UP

    def state(self, address: str) -> str:
        return self._state.get(address, DEAD)

    def _delay(self) -> float:
        return self.rng.uniform(*self.latency)

    def _lost(self) -> bool:
        return self.loss > 0 and self.rng.random() < self.loss


class InMemoryNetwork:
    """One node's endpoint on an InMemoryFabric."""

    def __init__(self, fabric: InMemoryFabric, identity: Identity, address: str) -> None:
        self._fabric = fabric
        self._identity = identity
        self._address = address
        self._handler: Handler | None = None

    @property
    def address(self) -> str:
        return self._address

    async def start(self, handler: Handler) -> None:
        self._handler = handler

    async def stop(self) -> None:
        self._handler = None

    async def call(self, address: str, method: str, meta: dict, timeout: float) -> Reply:
        fabric = self._fabric
        fabric.calls += 1
        try:
            async with asyncio.timeout(timeout):
                return await self._exchange(address, method, meta)
        except TimeoutError:
            raise PeerTimeout(f"{address}: no answer within {timeout:.2f}s") from None

    async def _exchange(self, address: str, method: str, meta: dict) -> Reply:
        fabric = self._fabric
        silent = asyncio.get_running_loop().create_future()  # never resolved: waits out the timeout
        if fabric.state(self._address) == FROZEN:
            await silent
        if fabric.state(self._address) == DEAD:  # a dead host sends nothing
            raise PeerUnreachable(f"{self._address} is down")
        await asyncio.sleep(fabric._delay())
        target = fabric._endpoints.get(address)
        state = fabric.state(address)
        if target is None or state == DEAD or target._handler is None:
            await asyncio.sleep(fabric._delay())
            raise PeerUnreachable(f"{address}: connection refused")
        if state == FROZEN or fabric._lost():
            await silent
        caller = Caller(self._identity.peer_id, self._identity.public_key, self._address,
                        self._address.rsplit(":", 1)[0].strip("[]"))
        try:
            reply = await target._handler(caller, method, _wire(meta))
        except DHTProtocolError as e:
            await asyncio.sleep(fabric._delay())
            raise RemoteFailure("bad_request", str(e)) from None
        if fabric.state(address) != UP or fabric._lost():
            await silent
        await asyncio.sleep(fabric._delay())
        return Reply(target._identity.peer_id, _wire(reply))
