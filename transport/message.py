"""The application's vocabulary for RPC: what a call carries, what a handler sees, and who called.

Kept apart from the connection machinery so handlers and callers (DHT, stage servers, the control
API) import plain value types, and the router maps method names to handlers without knowing about
sockets.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .codec_names import DEFAULT_CODEC
from .errors import LocalProtocolError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Message:
    """What a call sends and what a handler returns. `meta` must be msgpack-able; tensors travel as
    payload buffers encoded with `codec` (fp16+lz4 by default: activations and gradients tolerate it;
    pass "none" for exact bytes)."""

    meta: dict[str, Any] = field(default_factory=dict)
    tensors: Sequence[torch.Tensor] = ()
    codec: str = DEFAULT_CODEC


@dataclass(frozen=True)
class RemoteInfo:
    """Who is at the other end of a connection, as proven by the handshake."""

    peer_id: bytes | None
    public_key: bytes | None
    app: dict[str, Any]
    address: Any
    peercred: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class Request:
    """What a handler receives. `deadline` is in this process's event-loop time (the caller sends a
    relative timeout, so clocks need not agree), or None when the caller set none."""

    method: str
    meta: dict[str, Any]
    tensors: list[torch.Tensor]
    deadline: float | None
    peer: RemoteInfo


UnaryHandler = Callable[[Request], Awaitable[Message]]
StreamHandler = Callable[[Request], AsyncIterator[Message]]


class Router:
    """Method name → handler. A name is registered once, as unary or as stream."""

    def __init__(self) -> None:
        self._unary: dict[str, UnaryHandler] = {}
        self._stream: dict[str, StreamHandler] = {}

    def unary(self, name: str, handler: UnaryHandler) -> None:
        self._check_new(name)
        self._unary[name] = handler

    def stream(self, name: str, handler: StreamHandler) -> None:
        self._check_new(name)
        self._stream[name] = handler

    def lookup(self, name: str) -> tuple[str, Callable[[Request], Any]] | None:
        """("unary" | "stream", handler), or None for an unknown method."""
        if name in self._unary:
            return "unary", self._unary[name]
        if name in self._stream:
            return "stream", self._stream[name]
        return None

    def _check_new(self, name: str) -> None:
        if name in self._unary or name in self._stream:
            raise LocalProtocolError(f"method {name!r} is already registered")
