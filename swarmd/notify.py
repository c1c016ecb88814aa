"""The systemd service protocol spoken directly, without libsystemd.

sd_notify is one datagram of `KEY=value` lines to the AF_UNIX socket named by `NOTIFY_SOCKET` (a
path, or `@name` for the abstract namespace). The watchdog ping is sent from a task on the event
loop, not from a thread, so a loop that is stuck stops the pings and systemd restarts the daemon.
Socket activation passes listening sockets as fds 3.. with `LISTEN_FDS`/`LISTEN_PID` (sd_listen_fds).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Mapping, MutableMapping

log = logging.getLogger(__name__)

SD_LISTEN_FDS_START = 3


class Notifier:
    """Sends sd_notify messages; every method is a no-op when not started by systemd."""

    def __init__(self, env: Mapping[str, str] = os.environ) -> None:
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]
        self._address = address or None
        self._sock: socket.socket | None = None
        if self._address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, **fields: str) -> None:
        """Send one datagram; a full or vanished receiver is logged, never raised into the daemon."""
        if self._sock is None:
            return
        payload = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            self._sock.sendto(payload, socket.MSG_DONTWAIT, self._address)
        except OSError as exc:
            log.warning("sd_notify to %s failed: %s", self._address.lstrip("\0"), exc)

    def ready(self, status: str) -> None:
        self.send(READY="1", STATUS=status, MAINPID=str(os.getpid()))

    def status(self, text: str) -> None:
        self.send(STATUS=text)

    def watchdog(self) -> None:
        self.send(WATCHDOG="1")

    def reloading(self) -> None:
        self.send(RELOADING="1", MONOTONIC_USEC=str(time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000))

    def stopping(self, status: str) -> None:
        self.send(STOPPING="1", STATUS=status)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval(env: Mapping[str, str] = os.environ) -> float | None:
    """Seconds between pings (half of WATCHDOG_USEC, as sd_watchdog_enabled advises), or None.

    WATCHDOG_PID, when set, must be ours: a child that inherited the variables must not ping.
    """
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not an integer", usec)
        return None
    return value / 2 / 1e6 if value > 0 else None


async def watchdog_loop(notifier: Notifier, interval: float) -> None:
    """Ping forever at `interval`; runs as a task the daemon owns and cancels."""
    while True:
        notifier.watchdog()
        await asyncio.sleep(interval)


def listen_fds(env: MutableMapping[str, str] = os.environ) -> list[socket.socket]:
    """Take the sockets systemd passed (sd_listen_fds), clearing the variables so children don't.

    Only a process whose pid matches LISTEN_PID owns them; otherwise there are none.
    """
    count, pid = env.get("LISTEN_FDS", ""), env.get("LISTEN_PID", "")
    for name in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"):
        env.pop(name, None)
    if not count or pid != str(os.getpid()):
        return []
    try:
        n = int(count)
    except ValueError:
        log.warning("ignoring LISTEN_FDS=%r: not an integer", count)
        return []
    sockets = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + n):
        os.set_inheritable(fd, False)
        sockets.append(socket.socket(fileno=fd))
    return sockets


def unix_listener(sockets: list[socket.socket]) -> socket.socket | None:
    """The passed AF_UNIX stream listener (the control socket), if systemd gave one."""
    for sock in sockets:
        if sock.family == socket.AF_UNIX and sock.type == socket.SOCK_STREAM:
            return sock
    return None
