"""The control API: the project's RPC on a local Unix socket, admitted by SO_PEERCRED.

Why peer credentials and not only file modes: a socket's 0660 mode is set after bind and can be
loosened by mistake (or by a `.socket` unit's SocketMode); the kernel's SO_PEERCRED says who is
really connecting, so every connection is checked again. Admitted: root, the daemon's own user, and
members of the socket file's group (by the process's group or the user's group list).

Method names and payloads are specified in docs/control-api.md. The job methods are answered by the
daemon's `swarmd.jobs` parts: the registry (submit, list, get, cancel, logs), `Serving` (job.serve)
and `Training` (trainers of job.submit and job.train).
"""

from __future__ import annotations

import errno
import grp
import logging
import os
import pwd
import socket
import stat
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from swarmd.dht import DHTError, dht_key
from swarmd.errors import Busy, LocalError
from swarmd.jobs import JobRegistry, JobRequestError
from swarmd.jobs.exporting import export_messages
from swarmd.jobs.serving import Serving
from swarmd.model.export import ExportError
from swarmd.model.precision import PrecisionError
from swarmd.jobs.training import Training
from transport.errors import RpcError
from transport.message import Message, RemoteInfo, Request, Router

log = logging.getLogger(__name__)

#: Bytes of one key part and number of parts a `dht.get` may name (a DHT key is a short name).
MAX_KEY_PARTS = 8
MAX_KEY_PART_BYTES = 256
#: Pending connections on the control socket before the kernel refuses more.
LISTEN_BACKLOG = 64
SOCKET_MODE = 0o660

#: Trainer shards one `job.submit` may ask this daemon to run.
MAX_LOCAL_TRAINERS = 64


class DaemonView(Protocol):
    """What the control API reads from and asks of the daemon."""

    def status(self) -> dict[str, Any]: ...

    def peers(self) -> list[dict[str, Any]]: ...

    def dht_get(self, key: bytes) -> Awaitable[dict[str, Any]]: ...

    def request_drain(self, reason: str) -> dict[str, Any]: ...

    @property
    def jobs(self) -> JobRegistry: ...

    serving: Serving
    training: Training


class ControlMethods:
    """The handlers of the control methods, one per method, answering from `daemon`."""

    def __init__(self, daemon: DaemonView) -> None:
        self.daemon = daemon

    async def status(self, req: Request) -> Message:
        return Message(self.daemon.status())

    async def peers(self, req: Request) -> Message:
        return Message({"peers": self.daemon.peers()})

    async def dht_get(self, req: Request) -> Message:
        key = dht_key(*_key_parts(req.meta.get("key")))
        try:
            return Message(await self.daemon.dht_get(key))
        except DHTError as exc:
            raise RpcError("dht_failed", str(exc)) from None

    async def drain(self, req: Request) -> Message:
        pid = req.peer.peercred[0] if req.peer.peercred else None
        return Message(self.daemon.request_drain(f"swarmctl drain (pid {pid})"))

    async def job_submit(self, req: Request) -> Message:
        daemon = self.daemon
        data = req.meta.get("data") or []
        base = req.meta.get("base")
        if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
            raise RpcError("bad_request", "data: a list of absolute paths")
        if base is not None and not isinstance(base, str):
            raise RpcError("bad_request", "base: the spec file's directory, an absolute path")
        trainers = req.meta.get("trainers", 1)
        if isinstance(trainers, bool) or not isinstance(trainers, int) or not 0 <= trainers <= MAX_LOCAL_TRAINERS:
            raise RpcError("bad_request", f"trainers: an integer in 0..{MAX_LOCAL_TRAINERS}")
        async def start_trainers(job: Any) -> None:  # before the job is published: a failure publishes nothing
            per_step = job.spec.batch.microbatches_per_step
            if trainers > per_step:
                raise RpcError("bad_request", f"trainers: at most {per_step} (microbatches per step)")
            if trainers and job.job_id not in daemon.training.started:
                await daemon.training.start(job, range(trainers), trainers)

        with _job_errors():
            job = await daemon.jobs.submit(req.meta.get("spec"), data, base, req.peer.peercred, start=start_trainers)
        return Message({"job": job.job_id.hex(), "name": job.spec.name, "stages": job.spec.pipeline.stages})

    async def job_list(self, req: Request) -> Message:
        daemon = self.daemon
        with _job_errors():
            await daemon.jobs.refresh()
            await daemon.jobs.read_progress_of_listed()
        return Message({"jobs": [j.summary() for j in daemon.jobs.jobs.values()]})

    async def job_get(self, req: Request) -> Message:
        daemon = self.daemon
        with _job_errors():
            job = await daemon.jobs.find(req.meta.get("job"))
            reply = await daemon.jobs.describe(job)
        # What this daemon saw itself: its trainers' bans and its stages' all-reduce outliers.
        reply["banned"] = [{"stage": b.stage, "peer": b.peer_id, "addr": b.addr, "reason": b.reason, "at": b.at}
                           for b in daemon.training.bans(job.job_id)]
        reply["outliers"] = [{"stage": stage, "step": step, "peers": list(peers)}
                             for stage, step, peers in daemon.serving.outliers(job.job_id)]
        return Message(printable(reply))

    async def job_cancel(self, req: Request) -> Message:
        daemon = self.daemon
        uid = req.peer.peercred[1] if req.peer.peercred else None
        with _job_errors():
            job = await daemon.jobs.find(req.meta.get("job"))
            await daemon.jobs.cancel(job, by=f"swarmctl cancel (uid {uid})")
        daemon.training.cancel(job)
        return Message({"job": job.job_id.hex(), "state": job.state})

    async def job_logs(self, req: Request) -> AsyncIterator[Message]:
        daemon = self.daemon
        with _job_errors():
            job = await daemon.jobs.find(req.meta.get("job"))
        async for event in daemon.jobs.events(job, bool(req.meta.get("follow"))):
            yield Message(printable(event))

    async def job_serve(self, req: Request) -> Message:
        daemon = self.daemon
        stage = req.meta.get("stage")
        with _job_errors():
            job = await daemon.jobs.find(req.meta.get("job"))
            _refuse_ended(job)
            if stage is None:
                stages = await daemon.jobs.stage_peers(job)
                # Peers that did not answer a probe are claims, not capacity (swarmd.jobs.probing).
                stage = min(stages, key=lambda s: (sum(p["reachable"] for p in s["peers"]), s["stage"]))["stage"]
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < job.spec.pipeline.stages:
            raise RpcError("bad_request", f"stage: an integer in 0..{job.spec.pipeline.stages - 1} or null")
        try:
            await daemon.serving.serve(job.spec, job.job_id, stage, submitter=job.submitter)
        except (ExportError, PrecisionError) as exc:  # the job's init weights or dtype cannot be served here
            raise RpcError("bad_request", f"stage {stage}: {exc}") from None
        except Busy as exc:  # jobs.max_stages reached, or the stage is over jobs.max_stage_memory
            raise RpcError("busy", f"stage: {exc}") from None
        return Message({"job": job.job_id.hex(), "stage": stage})

    async def job_train(self, req: Request) -> Message:
        daemon = self.daemon
        data = req.meta.get("data") or []
        shard, shards = req.meta.get("shard", 0), req.meta.get("shards", 1)
        if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
            raise RpcError("bad_request", "data: a list of absolute paths")
        with _job_errors():
            job = await daemon.jobs.find(req.meta.get("job"))
            _refuse_ended(job)
            await daemon.jobs.attach_data(job, data, req.peer.peercred)
        per_step = job.spec.batch.microbatches_per_step
        for name, value in (("shards", shards), ("shard", shard)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise RpcError("bad_request", f"{name}: an integer")
        if not 1 <= shards <= per_step or not 0 <= shard < shards:
            raise RpcError("bad_request", f"shard: shard in 0..shards-1, shards in 1..{per_step}")
        eval_data = req.meta.get("eval_data") or []
        if not isinstance(eval_data, list) or not all(isinstance(p, str) for p in eval_data):
            raise RpcError("bad_request", "eval_data: a list of absolute paths")
        if shard == 0 and job.spec.eval.files is not None:  # shard 0 evaluates (docs/trainer.md)
            with _job_errors():
                await daemon.jobs.attach_eval_data(job, eval_data, req.peer.peercred)
        await daemon.training.start(job, range(shard, shard + 1), shards)
        return Message({"job": job.job_id.hex(), "trainer": f"{shard}/{shards}"})

    async def job_export(self, req: Request) -> AsyncIterator[Message]:
        daemon = self.daemon
        with _job_errors():
            job = await daemon.jobs.find(req.meta.get("job"))
            peers = await daemon.jobs.stage_peers(job)
        async for message in export_messages(job, peers, daemon.pool, daemon.config.daemon.state_dir):
            yield message


#: Each control method: its name on the wire, "unary" (one reply) or "stream" (replies until the
#: handler ends), and its handler. `register` adds them in this order.
METHODS: tuple[tuple[str, str, Callable[..., Any]], ...] = (
    ("status", "unary", ControlMethods.status),
    ("peers", "unary", ControlMethods.peers),
    ("dht.get", "unary", ControlMethods.dht_get),
    ("drain", "unary", ControlMethods.drain),
    ("job.submit", "unary", ControlMethods.job_submit),
    ("job.export", "stream", ControlMethods.job_export),
    ("job.list", "unary", ControlMethods.job_list),
    ("job.get", "unary", ControlMethods.job_get),
    ("job.cancel", "unary", ControlMethods.job_cancel),
    ("job.logs", "stream", ControlMethods.job_logs),
    ("job.serve", "unary", ControlMethods.job_serve),
    ("job.train", "unary", ControlMethods.job_train),
)


def register(router: Router, daemon: DaemonView) -> None:
    """Add every control method to `router`."""
    methods = ControlMethods(daemon)
    for name, kind, handler in METHODS:
        add = router.stream if kind == "stream" else router.unary
        add(name, types.MethodType(handler, methods))


def _refuse_ended(job: Any) -> None:
    """Serving or training a job that ended would only wait forever for work or for stages."""
    if job.ended is not None:
        raise JobRequestError("bad_request", f"job: {job.spec.name} ({job.job_id.hex()[:16]}) {job.ended.text()}")


class _job_errors:
    """Turn the registry's and the DHT's failures into the control API's typed errors."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        if isinstance(exc, JobRequestError):
            raise RpcError(exc.code, exc.message) from None
        if isinstance(exc, DHTError):
            raise RpcError("dht_failed", str(exc)) from None
        return False


def printable(value: Any) -> Any:
    """`value` with every character of its strings that is not printable escaped as `repr` would
    (`\\x1b`, `\\n`): a job's bans and events quote peers' own error texts, which `swarmctl job` and
    `swarmctl logs` print to an operator's terminal (escape sequences, forged lines)."""
    if isinstance(value, str):
        return value if value.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in value)
    if isinstance(value, dict):
        return {k: printable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [printable(v) for v in value]
    return value


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
        return self.check_peercred(remote.peercred)

    def check_peercred(self, peercred: tuple[int, int, int] | None) -> str | None:
        """`check` on the kernel's credentials alone: what the daemon runs when it accepts a
        connection, so a refused user never holds a slot that root or an admitted user needs."""
        if peercred is None:
            return "no peer credentials on this connection"
        pid, uid, gid = peercred
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


class ControlSocketError(LocalError):
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
