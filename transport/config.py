"""RpcConfig: every knob of a connection in one frozen object, each default with its reason."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .identity import Identity
from .limits import KiB, MiB, Limits
from .sockopts import SocketOptions
from .traffic import Traffic


@dataclass(frozen=True)
class RpcConfig:
    limits: Limits = field(default_factory=Limits)
    # Ed25519 identity proven in the hello; None is anonymous (the local Unix control socket).
    identity: Identity | None = None
    # Shared secret of a private swarm; both ends must hold the same one or the hello fails.
    swarm_key: bytes | None = None
    # Small dict sent in our hello (e.g. {"announce": "203.0.113.5:7000"}); bounded by the hello size.
    app: dict[str, Any] = field(default_factory=dict)
    socket: SocketOptions = field(default_factory=SocketOptions)
    # A TCP connect across the world takes < 1 s; 10 s covers SYN retransmits on a lossy path.
    connect_timeout_s: float = 10.0
    # The hello is one round trip plus two signatures; a peer that cannot finish it in 10 s is
    # either gone or stalling us on purpose, and holds a slot until then.
    handshake_timeout_s: float = 10.0
    # PING when nothing was sent for this long; drop the connection when nothing at all arrived for
    # heartbeat_timeout_s. A stopped peer is thus found within ~10 s even with a healthy TCP session.
    heartbeat_interval_s: float = 2.5
    heartbeat_timeout_s: float = 10.0
    # Used by Pool.call/stream when the caller passes no timeout: a call never waits forever.
    default_timeout_s: float = 60.0
    # Handlers running at once on one connection; more is refused with code "overloaded" before any
    # task is created, so a peer cannot make us spawn without bound.
    max_concurrent_handlers: int = 4096
    # Calls outstanding at once on one connection from our side; more wait for a slot.
    max_pending_calls: int = 4096
    # Bytes the event-loop transport may hold beyond the kernel before the writer waits: with
    # TCP_NOTSENT_LOWAT this is the whole of what a small frame can find queued ahead of it.
    write_buffer_bytes: int = 256 * KiB
    # Tensors with more payload bytes than this are encoded/decoded in a worker thread; below it the
    # executor hop (~50 us) costs more than the work.
    offload_threshold_bytes: int = 1 * MiB
    # Completed messages received but not yet taken by a handler or a stream consumer; past it we
    # stop reading the socket (TCP then pushes back on the sender) until the application catches up.
    max_undelivered_bytes: int = 256 * MiB
    # Seconds a closing connection waits for queued frames to leave before it aborts.
    close_timeout_s: float = 2.0
    # A connection refused at accept (admit_local) stays half-open this long, its input discarded,
    # so a hello written after our refusal does not meet a closed socket and cost the peer the
    # reason; a peer that reads the refusal hangs up at once. Bounds a refused socket's life.
    refusal_linger_s: float = 1.0
    # Server side: connections still in their hello (not yet welcomed) from one source host. An
    # honest host dials us once per pool plus a few parallel DHT dials; 16 leaves room for NAT'd
    # neighbours while one host cannot hold more than 16 of our slots for handshake_timeout_s.
    max_unproven_per_source: int = 16
    # Server side: connections in their hello from all sources together. Each costs a Connection,
    # a timer and at most one ~32 KiB hello frame, so 256 bound it to ~10 MiB and 256 descriptors.
    # Past either limit a new connection is closed at once, before anything is read from it.
    max_unproven_connections: int = 256
    # Server side: calls per second each peer (its peer id; its source host when anonymous) may
    # start, refilled continuously up to rate_limit_burst; past it calls are answered with code
    # "rate_limited" and no handler runs. None turns it off (the transport's default: the daemon
    # sets it, a library user or benchmark may not want it).
    rate_limit_per_s: float | None = None
    # Calls a peer may start at once after a quiet spell (a pipeline step's burst of microbatches).
    rate_limit_burst: int = 256
    # Peers whose buckets are remembered; the least recently seen is forgotten past it, so a peer
    # inventing identities costs us at most this many small entries.
    rate_limit_peers: int = 4096
    # Seal every frame after the hello with ChaCha20-Poly1305 under keys from an X25519 exchange in
    # the hello. Both ends must agree (a mismatch fails the hello). Off by default: on a trusted
    # network TLS-grade secrecy costs CPU (see bench/transport.py "encryption") for nothing.
    encrypt: bool = False
    # What the user calls `encrypt` where this config comes from, for the error a mismatch gives:
    # an application built on the transport (the daemon: "network.encrypt") names its own setting.
    encrypt_setting: str = "RpcConfig.encrypt"
    # Totals of socket bytes sent and received by every connection built from this config (metrics);
    # None costs nothing per write.
    traffic: Traffic | None = None

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "handshake_timeout_s", "heartbeat_interval_s", "default_timeout_s",
                     "close_timeout_s", "refusal_linger_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RpcConfig.{name} must be positive, got {getattr(self, name)!r}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("RpcConfig.heartbeat_timeout_s must exceed heartbeat_interval_s, or every "
                             "quiet peer would be dropped between two pings")
        for name in ("max_concurrent_handlers", "max_pending_calls", "write_buffer_bytes", "max_undelivered_bytes",
                     "max_unproven_per_source", "max_unproven_connections", "rate_limit_burst",
                     "rate_limit_peers"):
            if getattr(self, name) < 1:
                raise ValueError(f"RpcConfig.{name} must be at least 1, got {getattr(self, name)!r}")
        if self.rate_limit_per_s is not None and not self.rate_limit_per_s > 0:
            raise ValueError(f"RpcConfig.rate_limit_per_s must be positive or None, got {self.rate_limit_per_s!r}")
        if self.swarm_key is not None and len(self.swarm_key) < 16:
            raise ValueError("RpcConfig.swarm_key must be at least 16 bytes of secret")
