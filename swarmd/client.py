"""A small Python client of the local daemon's control API; `swarmctl` is built on it.

`Client` is async (`async with Client(path) as c: await c.status()`); `SyncClient` runs each call
on its own short event loop for scripts and the CLI. Connection problems become
`DaemonUnavailable` with a sentence that says what to check; typed refusals from the daemon
become `ControlError(code, message)`.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, AsyncIterator, Mapping, Sequence

from swarmd.config import default_socket, env_name
from swarmd.errors import PeerError, SwarmdError
from transport.config import RpcConfig
from transport.connection import Connection
from transport.errors import ConnectionLost, DeadlineExceeded, HandshakeError, RemoteError, TransportError
from transport.message import Message

#: Most control calls answer from memory; a DHT get may take a few lookup round trips.
DEFAULT_TIMEOUT_S = 30.0
#: A followed log lasts as long as its job; the transport wants a deadline on every stream, so it
#: gets one longer than any job we expect (the user ends it with Ctrl-C).
FOLLOW_TIMEOUT_S = 30 * 86400.0
SOCKET_ENV = env_name("control", "socket")


class ControlError(PeerError):
    """The daemon answered with a typed error (e.g. `not_available`, `bad_request`)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class DaemonUnavailable(SwarmdError):
    """No usable daemon at the socket: not running, not permitted, or the connection failed."""


def socket_path(explicit: str | os.PathLike | None = None, env: Mapping[str, str] = os.environ) -> Path:
    """--socket, else $SWARMD_CONTROL_SOCKET, else where a daemon would put it by default."""
    if explicit:
        return Path(explicit)
    if env.get(SOCKET_ENV):
        return Path(env[SOCKET_ENV])
    return default_socket(env, client=True)


def _unavailable(path: Path, exc: BaseException) -> DaemonUnavailable:
    cause = exc.__cause__
    if isinstance(exc, HandshakeError) and "refused" in str(exc):
        return DaemonUnavailable(f"the daemon at {path} refused this connection: {str(exc).split(': ', 1)[-1]}")
    if isinstance(cause, FileNotFoundError):
        return DaemonUnavailable(f"no daemon socket at {path} (is swarmd running? see --socket or ${SOCKET_ENV})")
    if isinstance(cause, PermissionError):
        return DaemonUnavailable(
            f"permission denied on {path}: your user must be in the socket's group to use this daemon"
        )
    if isinstance(cause, ConnectionRefusedError):
        return DaemonUnavailable(f"nothing listens on {path} (a stale socket: swarmd is not running)")
    return DaemonUnavailable(f"cannot talk to the daemon at {path}: {exc}")


class Client:
    """One connection to the daemon, opened by `async with`."""

    def __init__(self, path: str | os.PathLike | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.path = socket_path(path)
        self.timeout = timeout
        self._conn: Connection | None = None

    async def __aenter__(self) -> "Client":
        # The hello may wait for a socket-activated daemon to start: give it the whole call timeout.
        config = RpcConfig(connect_timeout_s=min(self.timeout, RpcConfig().connect_timeout_s),
                           handshake_timeout_s=self.timeout)
        try:
            self._conn = await Connection.open(f"unix:{self.path}", config)
        except (ConnectionLost, HandshakeError) as exc:
            raise _unavailable(self.path, exc) from None
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def call(self, method: str, **meta: Any) -> dict[str, Any]:
        assert self._conn is not None, "use `async with Client(...)`"
        try:
            reply = await self._conn.call(method, Message(meta), timeout=self.timeout)
        except RemoteError as exc:
            raise ControlError(exc.code, exc.message) from None
        except DeadlineExceeded:
            raise DaemonUnavailable(f"the daemon at {self.path} did not answer {method} within {self.timeout} s")
        except TransportError as exc:
            raise _unavailable(self.path, exc) from None
        return reply.meta

    async def stream(self, method: str, *, timeout: float | None = None, **meta: Any) -> AsyncIterator[dict[str, Any]]:
        assert self._conn is not None, "use `async with Client(...)`"
        try:
            async with self._conn.stream(method, Message(meta), timeout=timeout or self.timeout) as items:
                async for item in items:
                    yield item.meta
        except RemoteError as exc:
            raise ControlError(exc.code, exc.message) from None
        except TransportError as exc:
            raise _unavailable(self.path, exc) from None

    async def stream_messages(self, method: str, *, timeout: float, **meta: Any) -> AsyncIterator[Message]:
        """As `stream`, but whole messages: for the methods that answer with tensors (job.export)."""
        assert self._conn is not None, "use `async with Client(...)`"
        try:
            async with self._conn.stream(method, Message(meta, codec="none"), timeout=timeout) as items:
                async for item in items:
                    yield item
        except RemoteError as exc:
            raise ControlError(exc.code, exc.message) from None
        except DeadlineExceeded:
            raise DaemonUnavailable(f"the daemon at {self.path} did not finish {method} within {timeout} s")
        except TransportError as exc:
            raise _unavailable(self.path, exc) from None

    # --- node ---
    async def status(self) -> dict[str, Any]:
        return await self.call("status")

    async def peers(self) -> list[dict[str, Any]]:
        return (await self.call("peers"))["peers"]

    async def dht_get(self, key: Sequence[str | int | bytes]) -> dict[str, Any]:
        return await self.call("dht.get", key=list(key))

    async def drain(self) -> dict[str, Any]:
        return await self.call("drain")

    # --- jobs (docs/control-api.md; `job.train`/`job.serve` answer `not_available` until stages run in the daemon) ---
    async def submit(self, spec: dict[str, Any], data: Sequence[str] = (), base: str | None = None,
                     trainers: int = 1) -> dict[str, Any]:
        """`base`: the spec file's directory, where the spec's relative data paths start;
        `trainers`: shards this daemon runs (0: publish only, trainers join with `train`)."""
        return await self.call("job.submit", spec=spec, data=list(data), base=base, trainers=trainers)

    async def jobs(self) -> list[dict[str, Any]]:
        return (await self.call("job.list"))["jobs"]

    async def job(self, job: str) -> dict[str, Any]:
        return await self.call("job.get", job=job)

    async def cancel(self, job: str) -> dict[str, Any]:
        return await self.call("job.cancel", job=job)

    async def train(self, job: str, data: Sequence[str], shard: int = 0, shards: int = 1,
                    eval_data: Sequence[str] = ()) -> dict[str, Any]:
        """`eval_data`: the data of the job's `eval.files` for shard 0 (default: the spec's
        patterns, absolute ones only)."""
        return await self.call("job.train", job=job, data=list(data), shard=shard, shards=shards,
                               eval_data=list(eval_data))

    async def serve(self, job: str, stage: int | None = None) -> dict[str, Any]:
        return await self.call("job.serve", job=job, stage=stage)

    def logs(self, job: str, follow: bool = False) -> AsyncIterator[dict[str, Any]]:
        return self.stream("job.logs", timeout=FOLLOW_TIMEOUT_S if follow else None, job=job, follow=follow)


class SyncClient:
    """Blocking wrappers: each call opens a connection on a fresh loop, makes the call, closes."""

    def __init__(self, path: str | os.PathLike | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.path = socket_path(path)
        self.timeout = timeout

    def _run(self, name: str, *args: Any, **kwargs: Any) -> Any:
        async def once() -> Any:
            async with Client(self.path, timeout=self.timeout) as client:
                return await getattr(client, name)(*args, **kwargs)

        return asyncio.run(once())

    def status(self) -> dict[str, Any]:
        return self._run("status")

    def peers(self) -> list[dict[str, Any]]:
        return self._run("peers")

    def dht_get(self, key: Sequence[str | int | bytes]) -> dict[str, Any]:
        return self._run("dht_get", key)

    def drain(self) -> dict[str, Any]:
        return self._run("drain")

    def submit(self, spec: dict[str, Any], data: Sequence[str] = (), base: str | None = None,
               trainers: int = 1) -> dict[str, Any]:
        return self._run("submit", spec, data, base, trainers)

    def jobs(self) -> list[dict[str, Any]]:
        return self._run("jobs")

    def job(self, job: str) -> dict[str, Any]:
        return self._run("job", job)

    def cancel(self, job: str) -> dict[str, Any]:
        return self._run("cancel", job)

    def train(self, job: str, data: Sequence[str], shard: int = 0, shards: int = 1,
              eval_data: Sequence[str] = ()) -> dict[str, Any]:
        return self._run("train", job, data, shard, shards, eval_data)

    def serve(self, job: str, stage: int | None = None) -> dict[str, Any]:
        return self._run("serve", job, stage)

    def logs(self, job: str, follow: bool = False) -> list[dict[str, Any]]:
        """Every log event until the daemon ends the stream (with `follow`, until the job ends)."""

        async def collect() -> list[dict[str, Any]]:
            async with Client(self.path, timeout=self.timeout) as client:
                return [event async for event in client.logs(job, follow)]

        return asyncio.run(collect())
