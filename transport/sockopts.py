"""TCP options for long, slow, lossy links between preemptible machines.

What we set and why:
- TCP_NODELAY: a small control message (a cancel, a pong) must not wait for Nagle to coalesce it with
  bytes that are not coming.
- SO_KEEPALIVE with short idle/interval/count: a NAT box or a crashed peer that dropped our state is
  noticed by the kernel even when the application is idle; our own PING/PONG covers the busy case.
- TCP_USER_TIMEOUT: data unacknowledged for this long aborts the connection instead of the kernel
  retransmitting for ~15 minutes, so a vanished peer turns into ConnectionLost promptly.
- TCP_NOTSENT_LOWAT: the socket reports "writable" only while fewer than this many bytes wait unsent
  in the kernel, so bulk tensors sit in *our* queue where a small request can overtake them, instead
  of in a multi-megabyte kernel buffer it would have to wait behind.

What we deliberately do not set: SO_SNDBUF/SO_RCVBUF. Pinning either turns off the kernel's buffer
autotuning, which is what lets one connection fill a 2.5 MB bandwidth-delay product; operators raise
the autotuning ceilings instead (docs/transport-tuning.md).
"""

from __future__ import annotations

import logging
import socket
import struct
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SocketOptions:
    """Per-socket TCP settings; every default is chosen for a ~200 Mb/s, ~100 ms RTT link."""

    nodelay: bool = True
    # Probe after 30 s idle, every 5 s, give up after 4 misses: a dead idle peer is found in ~50 s,
    # well under common NAT idle timeouts (often 60-300 s) so the mapping is also kept alive.
    keepalive_idle_s: int = 30
    keepalive_interval_s: int = 5
    keepalive_count: int = 4
    # 30 s of unacknowledged data is far beyond any healthy RTT (even 1 s satellite links) yet
    # short enough that a preempted peer does not hold a caller for the kernel's ~15 minute default.
    user_timeout_ms: int = 30_000
    # 128 KiB unsent in the kernel keeps the pipe busy between event-loop wakeups (at 200 Mb/s it is
    # ~5 ms of data) while letting a small message overtake a bulk transfer after at most that much.
    notsent_lowat: int = 128 * 1024


def apply_tcp_options(sock: socket.socket, opts: SocketOptions) -> None:
    """Set `opts` on a connected TCP socket; options this OS lacks are skipped with a debug log."""
    settings: list[tuple[int, str, int]] = [
        (socket.SOL_SOCKET, "SO_KEEPALIVE", 1),
        (socket.IPPROTO_TCP, "TCP_NODELAY", int(opts.nodelay)),
        (socket.IPPROTO_TCP, "TCP_KEEPIDLE", opts.keepalive_idle_s),
        (socket.IPPROTO_TCP, "TCP_KEEPINTVL", opts.keepalive_interval_s),
        (socket.IPPROTO_TCP, "TCP_KEEPCNT", opts.keepalive_count),
        (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT", opts.user_timeout_ms),
        (socket.IPPROTO_TCP, "TCP_NOTSENT_LOWAT", opts.notsent_lowat),
    ]
    for level, name, value in settings:
        option = getattr(socket, name, None)
        if option is None:
            log.debug("socket option %s is not available on this platform", name)
            continue
        sock.setsockopt(level, option, value)


def is_tcp(sock: socket.socket | None) -> bool:
    return sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM


def peercred(sock: socket.socket) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of the process at the other end of a Unix socket, where the OS tells us."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None or sock.family != socket.AF_UNIX:
        return None
    raw = sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid
