"""The control API: the project's RPC on a local Unix socket, admitted by SO_PEERCRED.

Why peer credentials and not only file modes: a socket's 0660 mode is set after bind and can be
loosened by mistake (or by a `.socket` unit's SocketMode); the kernel's SO_PEERCRED says who is
really connecting, so every connection is checked again. Admitted: root, the daemon's own user, and
members of the socket file's group (by the process's group or the user's group list).

Method names and payloads are specified in docs/control-api.md. The job methods are reserved here
and answer the typed error `not_available` until the training issue implements them.
"""

from __future__ import annotations

import errno
import grp
import logging
import os
import pwd
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Protocol

from swarmd.dht import DHTError, dht_key
from transport.errors import RpcError
from transport.message import Message, RemoteInfo, Request, Router

log = logging.getLogger(__name__)

#: Bytes of one key part and number of parts a `dht.get` may name (a DHT key is a short name).
MAX_KEY_PARTS = 8
MAX_KEY_PART_BYTES = 256
#: Pending connections on the control socket before the kernel refuses more.
LISTEN_BACKLOG = 64
SOCKET_MODE = 0o660

#: Job methods that the training issue implements; until then each answers `not_available`.
JOB_METHODS = ("job.submit", "job.list", "job.get", "job.cancel", "job.train", "job.serve")
JOB_STREAM_METHODS = ("job.logs",)
NOT_AVAILABLE = "not_available"


class DaemonView(Protocol):
    """What the control API reads from and asks of the daemon."""

    def status(self) -> dict[str, Any]: ...

    def peers(self) -> list[dict[str, Any]]: ...

    def dht_get(self, key: bytes) -> Awaitable[dict[str, Any]]: ...

    def request_drain(self, reason: str) -> dict[str, Any]: ...


def _not_available(method: str) -> RpcError:
    return RpcError(
        NOT_AVAILABLE,
        f"{method} is not available until the training issue lands: this daemon runs no jobs yet",
    )


def register(router: Router, daemon: DaemonView) -> None:
    """Add every control method to `router`."""

    async def status(req: Request) -> Message:
        return Message(daemon.status())

    async def peers(req: Request) -> Message:
        return Message({"peers": daemon.peers()})

    async def dht_get(req: Request) -> Message:
        key = dht_key(*_key_parts(req.meta.get("key")))
        try:
            return Message(await daemon.dht_get(key))
        except DHTError as exc:
            raise RpcError("dht_failed", str(exc)) from None

    async def drain(req: Request) -> Message:
        pid = req.peer.peercred[0] if req.peer.peercred else None
        return Message(daemon.request_drain(f"swarmctl drain (pid {pid})"))

    async def job_unary(req: Request) -> Message:
        raise _not_available(req.method)

    async def job_stream(req: Request):
        raise _not_available(req.method)
        yield  # an async generator, as stream handlers are

    router.unary("status", status)
    router.unary("peers", peers)
    router.unary("dht.get", dht_get)
    router.unary("drain", drain)
    for name in JOB_METHODS:
        router.unary(name, job_unary)
    for name in JOB_STREAM_METHODS:
        router.stream(name, job_stream)


def _key_parts(raw: object) -> list[str | int | bytes]:
    """Check a `dht.get` key before it reaches the DHT: a short list of short str/int/bytes parts."""
    if not isinstance(raw, list) or not raw or len(raw) > MAX_KEY_PARTS or not isinstance(raw[0], str):
        raise RpcError("bad_request", f"key is a list of 1..{MAX_KEY_PARTS} parts starting with a namespace string")
    for part in raw:
        if isinstance(part, bool) or not isinstance(part, (str, int, bytes)):
            raise RpcError("bad_request", "key parts are strings, integers or bytes")
        if isinstance(part, (str, bytes)) and len(part) > MAX_KEY_PART_BYTES:
            raise RpcError("bad_request", f"a key part is at most {MAX_KEY_PART_BYTES} bytes")
    return raw


# ---------------------------------------------------------------------------------------------------
# Admission


@dataclass(frozen=True)
class Admission:
    """Who may use the socket at `path`: root, `daemon_uid`, and members of the file's group.

    The group is read from the file at each connection, so `chgrp` on a running daemon's socket
    takes effect at once, as it would for the file mode."""

    daemon_uid: int
    path: Path

    @classmethod
    def for_socket(cls, path: Path) -> "Admission":
        return cls(os.geteuid(), path)

    def check(self, remote: RemoteInfo) -> str | None:
        """None to admit, else the reason the client is told."""
        if remote.peercred is None:
            return "no peer credentials on this connection"
        pid, uid, gid = remote.peercred
        if uid in (0, self.daemon_uid):
            return None
        try:
            socket_gid = os.stat(self.path).st_gid
        except OSError as exc:
            return f"cannot check the socket's group: {exc.strerror or exc}"
        if gid == socket_gid or self._in_group(uid, socket_gid):
            return None
        return (
            f"uid {uid} may not use this daemon: only root, uid {self.daemon_uid} and members of group "
            f"{_group_name(socket_gid)} are admitted (ask an admin to add you to that group)"
        )

    @staticmethod
    def _in_group(uid: int, gid: int) -> bool:
        try:
            user = pwd.getpwuid(uid)
        except KeyError:
            return False
        return gid in os.getgrouplist(user.pw_name, user.pw_gid)


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


# ---------------------------------------------------------------------------------------------------
# Binding the socket ourselves (when systemd did not pass one)


class ControlSocketError(Exception):
    """The control socket path cannot be used; the message says why and what to do."""


@dataclass
class BoundSocket:
    """A listening socket we created at `path`; we unlink it on close only if it is still ours."""

    sock: socket.socket
    path: Path
    inode: int | None  # None: passed by systemd, which owns the file

    def close(self) -> None:
        self.sock.close()
        if self.inode is None:
            return
        try:
            if os.stat(self.path).st_ino == self.inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass


def bind(path: Path) -> BoundSocket:
    """Listen at `path`, replacing a stale socket file but never a live daemon's socket."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(str(path))
        os.chmod(path, SOCKET_MODE)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise ControlSocketError(f"cannot listen on {path}: {exc.strerror or exc}") from None
    return BoundSocket(sock, path, os.stat(path).st_ino)


def adopt(sock: socket.socket) -> BoundSocket:
    """Use a socket systemd passed (LISTEN_FDS); systemd set its mode and removes it."""
    return BoundSocket(sock, Path(sock.getsockname()), None)


def _clear_stale(path: Path) -> None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise ControlSocketError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(2.0)
    try:
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise ControlSocketError(f"cannot check {path}: {exc.strerror or exc}") from None
        log.info("removing stale control socket %s (nothing listens on it)", path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    finally:
        probe.close()
    raise ControlSocketError(f"another daemon is listening on {path}; refusing to take over its socket")
