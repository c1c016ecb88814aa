"""The RPC surface the rest of swarmd programs against (see docs/architecture.md, transport.rpc).

Implementation lives in small modules: `message` (value types and Router), `config`, `handshake`
(sans-IO hello), `connection` (the asyncio shell around `protocol`, with `calls`, the caller's side,
and `dispatch`, the server's), `outbox` (fair writer queue and
byte budget), `server`, `pool`, `sockopts`, `gate` (unproven-connection quotas), `ratelimit`
(per-peer call buckets), `seal` (encrypted records). Use `new_event_loop` (or `run`) to get uvloop when it
is installed and plain asyncio otherwise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from .config import RpcConfig
from .connection import Admit, Connection, StreamCall
from .dispatch import (
    CODE_CANCELLED,
    CODE_DEADLINE,
    CODE_GOING_AWAY,
    CODE_INTERNAL,
    CODE_OVERLOADED,
    CODE_RATE_LIMITED,
    CODE_UNKNOWN_METHOD,
)
from .message import DEFAULT_CODEC, Message, RemoteInfo, Request, Router
from .payload import CODE_BAD_REPLY
from .pool import Address, Pool, parse_address
from .server import RpcServer
from .sockopts import SocketOptions

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed (roughly halves per-call overhead), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on the best available loop."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)


__all__ = [
    "Address",
    "Admit",
    "CODE_BAD_REPLY",
    "CODE_CANCELLED",
    "CODE_DEADLINE",
    "CODE_GOING_AWAY",
    "CODE_INTERNAL",
    "CODE_OVERLOADED",
    "CODE_RATE_LIMITED",
    "CODE_UNKNOWN_METHOD",
    "Connection",
    "DEFAULT_CODEC",
    "Message",
    "Pool",
    "RemoteInfo",
    "Request",
    "Router",
    "RpcConfig",
    "RpcServer",
    "SocketOptions",
    "StreamCall",
    "new_event_loop",
    "parse_address",
    "run",
]
