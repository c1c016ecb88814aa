"""A local swarm of real `swarmd` processes on loopback, none of which may outlive the program.

The demo, the convergence benchmark and the chaos tests all need the same thing: several daemons,
each its own peer (own state dir, so own identity; own control socket; own port), chained by
`--bootstrap`, and the means to preempt, hang, resume, restart and drain a chosen one. What they
need above all is that every process is gone when they exit, however they exit:

- each daemon is started in its own session (`start_new_session`), so the terminal's Ctrl-C reaches
  only us and the teardown is ours to order, and `killpg` also takes anything the daemon forked;
- `close()` SIGKILLs every process group; it runs from `with`, from `atexit`, and from the SIGINT,
  SIGTERM and SIGHUP handlers `install_signal_handlers()` puts in place (each then defers to the
  handler that was there before, so Ctrl-C still raises KeyboardInterrupt);
- for the one exit no handler sees (our own SIGKILL), each daemon is exec'd through a trampoline that
  sets `PR_SET_PDEATHSIG` = SIGKILL first: the kernel kills it when the thread that started it dies.
  Start peers from a thread that lives as long as the swarm (the main thread; the demo's event loop).

Readiness is what `swarmctl status --json` reports, read through the same client call: the socket
answers and the daemon has joined the swarm (or is its first node). With `SwarmSettings.metrics` each
daemon also serves its Prometheus endpoint on a port of its own, and `PeerProcess.counters()` reads
it: a bench counts what the daemons themselves counted (their bytes on the wire, say).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Callable, Iterable, Mapping

from swarmd.client import Client, ControlError, DaemonUnavailable, SyncClient
from swarmd.errors import SwarmdError

#: Liveness and discovery tuned for a swarm that lives minutes on one machine: deaths are noticed in
#: seconds and a newcomer is found by everyone in about a second, instead of the WAN defaults. No
#: automatic joining (`jobs.serve = "none"`): the demo, the benches and the chaos tests place every
#: peer on its stage themselves, and a daemon joining jobs on its own would serve more than asked;
#: a caller that wants automatic joining sets SWARMD_JOBS_SERVE back in its own env.
FAST_ENV: Mapping[str, str] = {
    "SWARMD_PEERS_PING_INTERVAL_S": "0.5", "SWARMD_PEERS_LIVENESS_WINDOW_S": "3",
    "SWARMD_PEERS_PING_TIMEOUT_S": "1", "SWARMD_PEERS_DISCOVERY_INTERVAL_S": "1",
    "SWARMD_NETWORK_BOOTSTRAP_RETRY_INITIAL_S": "0.3", "SWARMD_NETWORK_BOOTSTRAP_RETRY_MAX_S": "1",
    "SWARMD_JOBS_SERVE": "none",
}

# Runs in the child before the daemon: ask for SIGKILL when the starting thread dies, then check
# that it has not died already (the race between fork and prctl), then become the daemon.
_TRAMPOLINE = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]): os._exit(1)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)


class SwarmError(SwarmdError):
    """A daemon of the local swarm did not start, join or stop as asked; the message quotes its log."""


@dataclass(frozen=True)
class SwarmSettings:
    # A daemon imports torch before it listens: tens of seconds on a loaded 2-core machine.
    start_timeout_s: float = 120.0
    # A drain is bounded by the daemon's own drain timeout; this adds room for a slow machine.
    drain_wait_s: float = 60.0
    # The kernel reaps a SIGKILLed process in milliseconds; longer means something is badly wrong.
    reap_timeout_s: float = 10.0
    poll_s: float = 0.2
    log_level: str = "info"
    device: str = "cpu"
    env: Mapping[str, str] = field(default_factory=lambda: dict(FAST_ENV))
    # Appended to every daemon's command line (e.g. ("--drain-timeout", "5")).
    flags: tuple[str, ...] = ()
    # Serve each daemon's metrics (`--metrics`) on a port of its own, kept across restarts.
    metrics: bool = False


@dataclass
class PeerProcess:
    """One daemon: where it lives, and its current process (a restart replaces `proc`)."""

    name: str
    home: Path
    port: int
    bootstrap: tuple[str, ...]
    proc: subprocess.Popen | None = None
    status: dict = field(default_factory=dict)
    restarts: int = 0
    # Where it listens, and the network namespace (`ip netns`) it runs in, None for the caller's:
    # a chaos test puts peers on both ends of a shaped link.
    host: str = "127.0.0.1"
    netns: str | None = None
    metrics_port: int | None = None

    @property
    def socket(self) -> Path:
        return self.home / "swarmd.sock"

    @property
    def state_dir(self) -> Path:
        return self.home / "state"

    @property
    def log_path(self) -> Path:
        return self.home / "stderr.log"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def peer_id(self) -> str:
        return self.status.get("peer_id", "")

    def client(self, timeout: float = 20.0) -> SyncClient:
        return SyncClient(self.socket, timeout=timeout)

    def counters(self, timeout: float = 10.0) -> dict[str, float]:
        """Its unlabelled metrics (`GET /metrics`), name to value: counters restart from zero when
        the daemon does. Reachable from the caller's network namespace only."""
        if self.metrics_port is None:
            raise SwarmError(f"{self.name} serves no metrics (SwarmSettings.metrics is off)")
        with urllib.request.urlopen(f"http://{self.host}:{self.metrics_port}/metrics", timeout=timeout) as reply:
            text = reply.read().decode()
        samples = (line.split() for line in text.splitlines() if line and not line.startswith("#"))
        return {fields[0]: float(fields[1]) for fields in samples if len(fields) == 2}

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


#: Listening ports are drawn below the kernel's ephemeral range: a port the OS hands out for an
#: outgoing connection (the daemons make many) can never collide with a daemon's chosen port, nor
#: take a restarted daemon's port while it is down.
LISTEN_PORT_FLOOR = 10000
_handed_out: set[int] = set()
_ports_lock = threading.Lock()
_ports_rng = random.Random()


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port nothing listens on, outside the ephemeral range, not handed out before by this process,
    so peers can be told each other's address before they start."""
    low, _ = ephemeral_range()
    with _ports_lock:
        for _ in range(1000):
            port = _ports_rng.randrange(LISTEN_PORT_FLOOR, max(low, LISTEN_PORT_FLOOR + 1000))
            if port in _handed_out:
                continue
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    raise SwarmError("no free port below the ephemeral range after 1000 tries")


class LocalSwarm:
    """`with LocalSwarm(root) as swarm: swarm.start(4); swarm.kill(swarm.peers[2]); swarm.add()`."""

    def __init__(self, root: str | os.PathLike, settings: SwarmSettings = SwarmSettings()) -> None:
        self.root = Path(root)
        self.settings = settings
        self.peers: list[PeerProcess] = []
        # Re-entrant: `close` runs from signal handlers (install_signal_handlers), which Python runs
        # in the main thread between bytecodes, possibly while that thread holds this lock in
        # `spawn` (a Ctrl-C during a daemon's Popen deadlocked the demo under load).
        self._lock = threading.RLock()
        self._closed = False
        _register(self)

    # ------------------------------------------------------------------------------ starting

    def start(self, n: int, wait: bool = True) -> list[PeerProcess]:
        """n daemons at once, peer i bootstrapping through peer i-1 (the first starts a new swarm);
        they start in parallel and join through the bootstrap retry as their predecessors come up."""
        ports = [free_port() for _ in range(n)]
        started = []
        for i, port in enumerate(ports):
            before = (f"127.0.0.1:{ports[i - 1]}",) if i else self._live_addresses()[-1:]
            started.append(self.spawn(port=port, bootstrap=tuple(before)))
        if wait:
            self.wait_ready(started)
        return started

    def add(self, wait: bool = True) -> PeerProcess:
        """A fresh peer (new identity, new port) joining through every live peer."""
        peer = self.spawn(bootstrap=tuple(self._live_addresses()))
        if wait:
            self.wait_ready([peer])
        return peer

    def spawn(self, port: int | None = None, bootstrap: tuple[str, ...] = (), name: str | None = None,
              host: str = "127.0.0.1", netns: str | None = None) -> PeerProcess:
        """Start one daemon and return at once (see `wait_ready`). Call from a long-lived thread:
        the daemon is SIGKILLed by the kernel when the calling thread exits. With `netns` it runs
        inside that namespace (`ip netns exec` execs in place, so the pid, the session and the
        death signal are still the daemon's) and listens on `host` there."""
        with self._lock:
            if self._closed:
                raise SwarmError("this local swarm is closed")
            name = name or f"peer{len(self.peers)}"
            peer = PeerProcess(name, self.root / name, port or free_port(), bootstrap, host=host, netns=netns,
                               metrics_port=free_port() if self.settings.metrics else None)
            self.peers.append(peer)
            self._launch(peer)
            if self._closed:  # closed by a signal handler while this thread launched it
                self._reap(peer)
                raise SwarmError("this local swarm was closed while a peer started")
        return peer

    def _launch(self, peer: PeerProcess) -> None:
        peer.home.mkdir(parents=True, exist_ok=True)
        s = self.settings
        enter = ["ip", "netns", "exec", peer.netns] if peer.netns else []
        cmd = [*enter, sys.executable, "-c", _TRAMPOLINE, str(os.getpid()), "-m", "swarmd.cli",
               "--listen", peer.address, "--socket", str(peer.socket), "--state-dir", str(peer.state_dir),
               "--device", s.device, "--log-level", s.log_level]
        for addr in peer.bootstrap:
            cmd += ["--bootstrap", addr]
        if peer.metrics_port is not None:
            cmd += ["--metrics", f"{peer.host}:{peer.metrics_port}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **s.env}
        env.pop("SWARMD_CONTROL_SOCKET", None)
        with open(peer.log_path, "ab") as log:
            peer.proc = subprocess.Popen([*cmd, *s.flags], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=log, env=env, start_new_session=True, close_fds=True)
        peer.status = {}

    def wait_ready(self, peers: Iterable[PeerProcess], timeout: float | None = None) -> None:
        """Until each answers `status` and has joined (or is the first node), else SwarmError with its log."""
        deadline = time.monotonic() + (timeout or self.settings.start_timeout_s)
        for peer in peers:
            while not self._ready(peer):
                if not peer.alive:
                    raise SwarmError(f"{peer.name} exited with {peer.proc.returncode if peer.proc else None}:\n"
                                     f"{peer.log_tail()}")
                if time.monotonic() > deadline:
                    raise SwarmError(f"{peer.name} not ready within {timeout or self.settings.start_timeout_s:g} s:\n"
                                     f"{peer.log_tail()}")
                time.sleep(self.settings.poll_s)

    async def wait_ready_async(self, peers: Iterable[PeerProcess], timeout: float | None = None) -> None:
        """`wait_ready` for an event loop: polls without a thread, so cancelling it leaves nothing behind."""
        limit = timeout or self.settings.start_timeout_s
        deadline = time.monotonic() + limit
        for peer in peers:
            while not await self._ready_async(peer):
                if not peer.alive:
                    raise SwarmError(f"{peer.name} exited with {peer.proc.returncode if peer.proc else None}:\n"
                                     f"{peer.log_tail()}")
                if time.monotonic() > deadline:
                    raise SwarmError(f"{peer.name} not ready within {limit:g} s:\n{peer.log_tail()}")
                await asyncio.sleep(self.settings.poll_s)

    async def _ready_async(self, peer: PeerProcess) -> bool:
        if not peer.socket.exists():
            return False
        try:
            async with Client(peer.socket, timeout=5.0) as client:
                status = await client.status()
        except (DaemonUnavailable, ControlError):
            return False
        return self._joined(peer, status)

    def _ready(self, peer: PeerProcess) -> bool:
        if not peer.socket.exists():
            return False
        try:
            status = peer.client(timeout=5.0).status()
        except (DaemonUnavailable, ControlError):
            return False
        return self._joined(peer, status)

    @staticmethod
    def _joined(peer: PeerProcess, status: dict) -> bool:
        peer.status = status
        boot = status["bootstrap"]
        return bool(boot["joined"]) or not boot["peers"]

    def _live_addresses(self) -> list[str]:
        return [p.address for p in self.peers if p.alive]

    def live(self) -> list[PeerProcess]:
        return [p for p in self.peers if p.alive]

    # ------------------------------------------------------------------------------ chaos

    def signal(self, peer: PeerProcess, sig: int) -> None:
        if peer.alive:
            os.killpg(peer.proc.pid, sig)

    def kill(self, peer: PeerProcess) -> None:
        """Preemption: SIGKILL, no drain, nothing withdrawn; reaped before returning."""
        self._reap(peer)

    def stop(self, peer: PeerProcess) -> None:
        """A hung peer: SIGSTOP keeps its sockets open but answers nothing."""
        self.signal(peer, signal.SIGSTOP)

    def cont(self, peer: PeerProcess) -> None:
        self.signal(peer, signal.SIGCONT)

    def restart(self, peer: PeerProcess, wait: bool = True) -> PeerProcess:
        """Kill it and start it again with the same state dir and port: the same peer comes back."""
        self._reap(peer)
        with self._lock:
            if self._closed:
                raise SwarmError("this local swarm is closed")
            peer.bootstrap = tuple(a for a in self._live_addresses() if a != peer.address) or peer.bootstrap
            peer.restarts += 1
            self._launch(peer)
            if self._closed:  # closed by a signal handler while this thread launched it
                self._reap(peer)
                raise SwarmError("this local swarm was closed while a peer restarted")
        if wait:
            self.wait_ready([peer])
        return peer

    def drain(self, peer: PeerProcess, timeout: float | None = None) -> int:
        """Ask it to leave gracefully (`swarmctl drain`) and wait for it to exit; its exit status."""
        peer.client().drain()
        try:
            return peer.proc.wait(timeout or self.settings.drain_wait_s)
        except subprocess.TimeoutExpired:
            raise SwarmError(f"{peer.name} did not exit within {timeout or self.settings.drain_wait_s:g} s "
                             f"of a drain:\n{peer.log_tail()}") from None

    # ------------------------------------------------------------------------------ teardown

    def _reap(self, peer: PeerProcess) -> None:
        proc = peer.proc
        if proc is None:
            return
        # Only while the leader is unreaped is its pid (hence the group id) surely still ours.
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(self.settings.reap_timeout_s)
        except subprocess.TimeoutExpired:
            raise SwarmError(f"{peer.name} (pid {proc.pid}) survived SIGKILL for "
                             f"{self.settings.reap_timeout_s:g} s") from None

    def close(self) -> None:
        """SIGKILL every daemon this swarm started and reap it. Idempotent; safe in a signal handler."""
        with self._lock:
            self._closed = True
            peers = list(self.peers)
        for peer in peers:
            try:
                self._reap(peer)
            except SwarmError:
                continue
        _unregister(self)

    def __enter__(self) -> "LocalSwarm":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------- process-wide

_swarms: set[LocalSwarm] = set()
_swarms_lock = threading.RLock()
_installed = False


def _register(swarm: LocalSwarm) -> None:
    global _installed
    with _swarms_lock:
        _swarms.add(swarm)
        if not _installed:
            atexit.register(close_all)
            _installed = True


def _unregister(swarm: LocalSwarm) -> None:
    with _swarms_lock:
        _swarms.discard(swarm)


def close_all() -> None:
    """Tear down every local swarm of this process (atexit and the signal handlers call it)."""
    with _swarms_lock:
        swarms = list(_swarms)
    for swarm in swarms:
        swarm.close()


def install_signal_handlers(signals: Iterable[int] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)) -> None:
    """On each signal: tear every swarm down, then do what was done before (Ctrl-C still raises
    KeyboardInterrupt; SIGTERM's default still ends the process, with its usual status).
    A signal this process ignores stays ignored: a shell starts a background job (`make demo &`)
    with SIGINT ignored, and a handler there would tear the swarm down on a Ctrl-C meant for the
    foreground while the program went on without it. Main thread only, as Python requires."""
    for sig in signals:
        previous = signal.getsignal(sig)
        if previous == signal.SIG_IGN:
            continue
        signal.signal(sig, _chain(sig, previous))


def _chain(sig: int, previous: Callable | int | None) -> Callable[[int, FrameType | None], None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        close_all()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)

    return handler
