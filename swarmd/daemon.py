"""The composition root: every part of a daemon is built here from one Config, and owned here.

Start order is transport server → DHT node → control API → metrics, then bootstrap, then READY=1;
stop order is the reverse, each step bounded by what is left of `drain_timeout_s`, so a spot VM's
notice is honoured even when one part hangs. Background work (watchdog pings, liveness pings,
bootstrap retries) runs in one TaskGroup that is cancelled when the drain begins.

Signals (uvicorn's shape): the first SIGTERM/SIGINT starts the drain; a second one exits at once
with EXIT_FORCED. SIGHUP re-reads the configuration and applies what can change live (log level).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

from swarmd import config as configuration
from swarmd import control, liveness, logs, metrics, notify
from swarmd.jobs import JobRegistry
from swarmd.jobs.directory import DHTStageDirectory
from swarmd.jobs.joining import Joining
from swarmd.jobs.probing import Prober
from swarmd.jobs.registry import IndexLimits
from swarmd.jobs.remembered import RememberedStages
from swarmd.jobs.rebalancing import RebalanceSettings, Rebalancing
from swarmd.jobs.serving import Serving
from swarmd.jobs.training import Training
from swarmd.job.sources import GlobLimits
from swarmd.stage.limits import StageLimits
from swarmd.version import package_version
from swarmd.supervisor import Faults, Supervisor
from swarmd.values import DHTValues
from swarmd.config import Address, Config
from swarmd.dht import DHTError, DHTNode, Record
from swarmd.dht.protocol import PING
from swarmd.dht.rpc_network import RpcNetwork
from swarmd.errors import LocalError
from swarmd.exitcodes import EXIT_BOOTSTRAP, EXIT_CONFIG, EXIT_FAILURE, EXIT_FORCED, EXIT_OK
from transport.config import RpcConfig
from transport.identity import Identity
from transport.pool import Pool
from transport.traffic import Traffic
from transport.rpc import RpcServer, new_event_loop

log = logging.getLogger(__name__)

IDENTITY_FILE = "identity.key"
#: Time each part still gets to close once the drain timeout is spent: closing a listening socket
#: or a pool takes milliseconds, and skipping it would leave a socket file or peers' connections
#: half-open. A few parts times this stays well inside TimeoutStopSec's margin over the drain.
CLOSE_GRACE_S = 0.5

#: The close step of each part started so far, (name, async close), run in reverse when the daemon stops.
Closers = list[tuple[str, Callable[[], Awaitable[Any]]]]


class StartupError(LocalError):
    """The daemon cannot start; `status` is the exit code, the message one line for the operator."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def resolve_device(requested: str) -> str:
    """The device the daemon computes on; asking for CUDA without one is a configuration error."""
    import torch  # deferred: --check-config and --version must not pay for it

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(requested.partition(":")[2] or 0)
        if index >= count:
            raise StartupError(EXIT_CONFIG, f"daemon.device: {requested} requested but {count} CUDA devices are visible")
    return requested


def load_identity(state_dir: Path) -> Identity:
    """The peer's Ed25519 key from the state dir, created (0600, in a 0700 dir) on first start."""
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = state_dir / IDENTITY_FILE
        identity = Identity.load_or_create(path)
        mode = path.stat().st_mode & 0o777
    except (OSError, ValueError) as exc:
        raise StartupError(EXIT_CONFIG, f"identity key in {state_dir}: {exc}") from None
    if mode & 0o077:
        log.warning("%s is readable by others (mode %o): anyone who read it can impersonate this peer", path, mode)
    return identity


def admit_peer(remote: Any) -> str | None:
    """The peer port serves proven identities only: an anonymous hello (no public key) could call
    anything a peer can without being named, banned or rate-limited by id (docs/security.md)."""
    if remote.public_key is None or remote.peer_id is None:
        return "anonymous hellos are not served on the peer port: prove a peer identity"
    return None


def peer_rpc_config(net: configuration.NetworkSection, identity: Identity, traffic: Traffic) -> RpcConfig:
    """The one RpcConfig of peer connections, for the server and the pool alike: a connection's two
    ends must agree on the swarm key and on encryption, whichever of them dialled."""
    try:
        swarm_key = configuration.load_swarm_key(net)
    except configuration.ConfigError as exc:
        raise StartupError(EXIT_CONFIG, str(exc)) from None
    log.info("%s swarm%s, peer traffic %s, per-peer RPC limit %s", "private" if swarm_key else "open",
             f" (key {net.swarm_key_file})" if swarm_key else "", "encrypted" if net.encrypt else "not encrypted",
             f"{net.rpc_rate_limit_per_s:g}/s" if net.rpc_rate_limit_per_s else "off")
    return RpcConfig(
        identity=identity, swarm_key=swarm_key, encrypt=net.encrypt, encrypt_setting="network.encrypt (--encrypt)",
        rate_limit_per_s=net.rpc_rate_limit_per_s or None, rate_limit_burst=net.rpc_rate_limit_burst,
        rate_limit_peers=net.rpc_rate_limit_peers, max_unproven_per_source=net.max_unproven_per_source,
        max_unproven_connections=net.max_unproven_connections, handshake_timeout_s=net.handshake_timeout_s,
        traffic=traffic,
    )


def announce_address(config: Config, bound_port: int) -> Address:
    """What peers should dial: `announce` if set, else the listen address with the bound port.

    An unspecified listen host (0.0.0.0, ::) is no address to dial; the host's primary address is
    taken from the routing table (a UDP connect sends no packet).
    """
    if config.network.announce is not None:
        return config.network.announce
    host = config.network.listen.host
    try:
        unspecified = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        unspecified = False
    if unspecified:
        family, probe = (socket.AF_INET6, "2001:db8::1") if ":" in host else (socket.AF_INET, "192.0.2.1")
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as udp:
                udp.connect((probe, 9))
                host = udp.getsockname()[0]
        except OSError:
            host = "127.0.0.1" if family == socket.AF_INET else "::1"
            log.warning("no route to find this host's address; announcing %s (set network.announce)", host)
    return Address(host, bound_port)


class Daemon:
    """One running daemon; `run()` returns its exit status."""

    def __init__(self, config: Config, *, reload: Callable[[], Config], env: Mapping[str, str] = os.environ) -> None:
        self.config = config
        self._reload = reload
        self._env = env
        self.started = time.monotonic()
        self.metrics = metrics.Metrics(package_version())
        self.notifier = notify.Notifier(env)
        self.identity: Identity | None = None
        self.device = "cpu"
        self.listen: Address | None = None
        self.announce: Address | None = None
        self.control_socket: Path | None = None
        self.metrics_address: Address | None = None
        self.dht: DHTNode | None = None
        self.job_registry: JobRegistry | None = None
        self.serving: Serving | None = None
        self.training: Training | None = None
        self.joining: Joining | None = None
        self.rebalancing: Rebalancing | None = None
        #: Failures of the supervised job loops (trainers, joining, gossip, move checks), for status.
        self.faults = Faults()
        self.pool: Pool | None = None
        self.router: metrics.InstrumentedRouter | None = None  # the peer-facing methods (DHT, later stages)
        self.book = liveness.PeerBook(config.peers.liveness_window_s, config.peers.max_peers_reported)
        self.joined = False
        self.bootstrap_state = "not started"
        self.draining = False
        self._stop: asyncio.Event | None = None
        self._signals = 0
        self._stopping_sent = False
        self._control_server: RpcServer | None = None

    # ------------------------------------------------------------------------------- lifecycle

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._on_reload)
        closers: Closers = []
        status = EXIT_OK
        try:
            await self._start(closers)
            status = await self._serve()
        except StartupError as exc:
            log.error("%s", exc)
            status = exc.status
        finally:
            self.draining = True
            self._stopping("stopping")
            await self._close(closers)
            self.notifier.close()
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
        log.info("stopped (exit status %d)", status)
        return status

    async def _start(self, closers: Closers) -> None:
        """Start the parts phase by phase; each appends its close step as soon as it is up, so a
        failure in a later phase still closes what started."""
        cfg = self.config
        self.notifier.status("starting")
        self.device = resolve_device(cfg.daemon.device)
        self.identity = load_identity(cfg.daemon.state_dir)
        log.info("peer id %s, device %s, state in %s", self.identity.peer_id.hex(), self.device, cfg.daemon.state_dir)
        await self._start_transport(closers)
        await self._start_dht(closers)
        directory = self._start_jobs(closers)
        self._start_job_loops(closers, directory)
        self.metrics.peers_alive.set_function(lambda: self.book.count_alive(time.monotonic()))
        await self._start_control(closers)
        await self._start_metrics(closers)

    async def _start_transport(self, closers: Closers) -> None:
        """1. The transport server, where peers reach us, and the pool we dial them from."""
        cfg = self.config
        router = self.router = metrics.InstrumentedRouter(self.metrics, "peer")
        rpc_config = peer_rpc_config(cfg.network, self.identity, self.metrics.traffic)
        try:
            server = await RpcServer.serve_tcp(router, cfg.network.listen.host, cfg.network.listen.port, config=rpc_config,
                                               admit=admit_peer)
        except OSError as exc:
            raise StartupError(EXIT_FAILURE, f"cannot listen on {cfg.network.listen}: {exc.strerror or exc}") from None
        closers.append(("transport server", server.close))
        self.listen = Address(cfg.network.listen.host, server.port)
        self.announce = announce_address(cfg, server.port)
        self.pool = Pool(dataclasses.replace(rpc_config, app={"announce": str(self.announce)}))
        closers.append(("connection pool", self.pool.close))
        log.info("listening on %s, announcing %s", self.listen, self.announce)

    async def _start_dht(self, closers: Closers) -> None:
        """2. The DHT node, on the peer router and pool."""
        cfg = self.config
        network = RpcNetwork(self.router, self.pool, str(self.announce), cfg.dht)
        self.dht = DHTNode(self.identity, network, cfg.dht, supervisor=Supervisor("dht", self.faults))
        await self.dht.start()
        closers.append(("DHT node", self.dht.stop))
        self.metrics.dht_contacts.set_function(lambda: len(self.dht.contacts()))
        self.metrics.dht_stored_keys.set_function(lambda: len(self.dht.storage.keys()))
        self.metrics.dht_lookups = self.dht.lookup_stats
        self.metrics.dht_refused_records = self.dht.refused_records

    def _start_jobs(self, closers: Closers) -> DHTStageDirectory:
        """The job registry, the served stages and the trainers; returns the stage directory they
        share. Jobs publish through the DHT, so their announcements are withdrawn before the node stops."""
        cfg = self.config
        values = DHTValues(self.dht)  # every DHT value read by the jobs parts is decoded and checked here
        prober = Prober(self.pool, self.identity.peer_id)  # one cache of answered probes for joins and moves
        self.job_registry = JobRegistry(
            self.dht, self.identity, accept_from=cfg.jobs.accept_jobs_from,
            glob_limits=GlobLimits(max_files=cfg.jobs.data_max_files, max_entries=cfg.jobs.data_max_entries),
            index_limits=IndexLimits(cfg.jobs.max_jobs_per_submitter, cfg.jobs.index_lookups_per_refresh,
                                     cfg.jobs.index_miss_ttl_s, cfg.jobs.index_forget_after_s),
            values=values, prober=prober)
        closers.append(("job announcements", self.job_registry.withdraw))
        directory = DHTStageDirectory(self.dht, cfg.jobs.directory_ttl_s, values)
        self.serving = Serving(self.dht, self.router, self.pool, directory, peer_id=self.identity.peer_id,
                               address=str(self.announce), device=self.device, state_dir=cfg.daemon.state_dir,
                               limits=StageLimits(torch_threads=cfg.jobs.torch_threads),
                               max_stages=cfg.jobs.max_stages, max_stage_memory=cfg.jobs.max_stage_memory,
                               supervisor=Supervisor("stages", self.faults), prober=prober)
        closers.append(("served stages", self.serving.close))
        self.training = Training(self.pool, directory, cfg.trainer.trainer_config(),
                                 supervisor=Supervisor("trainers", self.faults))
        closers.append(("trainers", self.training.close))
        self.metrics.evaluations = self.training.evaluations
        self.metrics.eval_loss.set_function(lambda: self.training.last_eval_loss)
        return directory

    def _start_job_loops(self, closers: Closers, directory: DHTStageDirectory) -> None:
        """Automatic joining and rebalancing, which change the served stages on their own."""
        cfg = self.config
        # Stopped before the stages close, so a drain is not remembered as "serves nothing".
        self.joining = Joining(self.job_registry, self.serving, RememberedStages(cfg.daemon.state_dir),
                               peer_id=self.identity.peer_id, serve=cfg.jobs.serve, max_stages=cfg.jobs.max_stages,
                               interval_s=cfg.jobs.join_interval_s, rejoin_wait_s=cfg.jobs.rejoin_wait_s,
                               settle_s=cfg.jobs.join_settle_s, min_stage_peers=cfg.jobs.min_stage_peers,
                               supervisor=Supervisor("joining", self.faults))
        self.joining.start()
        closers.append(("automatic joining", self.joining.close))
        try:
            settings = RebalanceSettings.from_section(cfg.rebalance)
        except configuration.ConfigError as exc:
            raise StartupError(EXIT_CONFIG, str(exc)) from None
        # Closed first of the job parts: a move under way is undone before its stages stop.
        self.rebalancing = Rebalancing(self.serving, self.identity, self.router, self.pool, directory, settings,
                                       self.metrics, Supervisor("rebalancing", self.faults))
        self.rebalancing.start()
        closers.append(("rebalancing", self.rebalancing.close))
        self.metrics.rebalance_jobs.set_function(lambda: len(self.rebalancing.jobs))

    async def _start_control(self, closers: Closers) -> None:
        """3. The control API on its Unix socket (passed by systemd, else bound here)."""
        bound = self._bind_control()
        closers.append(("control socket", _awaitable(bound.close)))
        admission = control.Admission.for_socket(bound.path)
        control_router = metrics.InstrumentedRouter(self.metrics, "control")
        control.register(control_router, self)
        self._control_server = await RpcServer.serve_unix(
            control_router, sock=bound.sock, config=RpcConfig(), admit=self._admit,
            admit_local=lambda peercred: self._admit_local(admission, peercred),
        )
        closers.append(("control API", self._control_server.close))
        self.control_socket = bound.path
        log.info("control socket %s", bound.path)

    async def _start_metrics(self, closers: Closers) -> None:
        """4. The metrics endpoint, if `metrics.listen` is set."""
        cfg = self.config
        if cfg.metrics.listen is not None:
            try:
                scrape = await metrics.serve(self.metrics, cfg.metrics.listen)
            except OSError as exc:
                raise StartupError(EXIT_FAILURE, f"cannot serve metrics on {cfg.metrics.listen}: {exc.strerror or exc}")
            closers.append(("metrics endpoint", lambda: _close_server(scrape)))
            self.metrics_address = Address(cfg.metrics.listen.host, scrape.sockets[0].getsockname()[1])

    def _bind_control(self) -> control.BoundSocket:
        passed = notify.unix_listener(notify.listen_fds(os.environ))
        if passed is not None:
            log.info("using the control socket passed by systemd")
            return control.adopt(passed)
        try:
            return control.bind(self.config.control.socket)
        except control.ControlSocketError as exc:
            raise StartupError(EXIT_FAILURE, str(exc)) from None

    def _admit_local(self, admission: control.Admission, peercred: tuple[int, int, int] | None) -> str | None:
        """Who may use the control socket, by SO_PEERCRED when the connection is accepted."""
        return self._refused_control(peercred, admission.check_peercred(peercred))

    def _admit(self, remote: Any) -> str | None:
        """After the hello of an admitted user: the cap on connections (those of refused users
        were closed at accept and never counted)."""
        reason = None
        if self._control_server is not None and self._control_server.connections > self.config.control.max_connections:
            reason = f"too many control connections (control.max_connections = {self.config.control.max_connections})"
        return self._refused_control(remote.peercred, reason)

    def _refused_control(self, peercred: tuple[int, int, int] | None, reason: str | None) -> str | None:
        if reason is not None:
            self.metrics.control_refused.inc()
            pid, uid, _ = peercred or (None, None, None)
            log.warning("refused control connection from pid %s uid %s: %s", pid, uid, reason,
                        extra={"source": f"uid {uid}"})
        return reason

    async def _serve(self) -> int:
        """Background work until a stop is asked for; returns the exit status."""
        async with asyncio.TaskGroup() as tg:
            background: list[asyncio.Task[Any]] = []
            try:
                return await self._until_stopped(tg, background)
            finally:
                for task in background:
                    task.cancel()

    async def _until_stopped(self, tg: asyncio.TaskGroup, background: list[asyncio.Task[Any]]) -> int:
        assert self._stop is not None
        interval = notify.watchdog_interval(self._env)
        if interval is not None:
            background.append(tg.create_task(notify.watchdog_loop(self.notifier, interval), name="watchdog"))
        background.append(tg.create_task(self._ping_peers(), name="liveness"))
        background.append(tg.create_task(self._discover(), name="discovery"))
        first = tg.create_task(self._bootstrap_first(), name="bootstrap")
        stopped = tg.create_task(self._stop.wait(), name="stop")
        background += [first, stopped]
        await asyncio.wait([first, stopped], return_when=asyncio.FIRST_COMPLETED)
        if self._stop.is_set():
            return EXIT_OK
        if not first.result():
            if self.config.network.require_bootstrap:
                log.error("no bootstrap peer answered within %g s and network.require_bootstrap is set",
                          self.config.network.require_bootstrap_timeout_s)
                return EXIT_BOOTSTRAP
            background.append(tg.create_task(self._bootstrap_retry(), name="bootstrap retry"))
        self.notifier.ready(self._status_line())
        log.info("ready: %s", self._status_line())
        await stopped
        return EXIT_OK

    async def _close(self, closers: Closers) -> None:
        """Stop every part in reverse start order within what is left of the drain timeout."""
        deadline = time.monotonic() + self.config.daemon.drain_timeout_s
        while closers:
            name, close = closers.pop()
            left = deadline - time.monotonic()
            try:
                async with asyncio.timeout(max(left, CLOSE_GRACE_S)):
                    await close()
            except TimeoutError:
                log.warning("%s did not stop within the drain timeout; abandoned", name)
            except Exception:
                log.exception("%s failed to stop cleanly", name)

    # ----------------------------------------------------------------------------- background

    def _bootstrap_peers(self) -> list[str]:
        return [str(a) for a in self.config.network.bootstrap if a != self.announce]

    async def _bootstrap_round(self, peers: list[str]) -> bool:
        """One join attempt; joined means a bootstrap peer itself answered.

        The routing table's size is no test: a peer that bootstrapped through us may already sit in
        it, and counting that as joined would leave us (and it) cut off from the swarm for good.
        """
        assert self.dht is not None
        self.bootstrap_state = "bootstrapping"
        async with asyncio.TaskGroup() as tg:
            pings = {addr: tg.create_task(self._answers(addr)) for addr in peers}
        answered = [addr for addr, ping in pings.items() if ping.result()]
        if not answered:
            self.metrics.bootstrap_attempts.labels("failed").inc()
            self.bootstrap_state = "no bootstrap peer answers yet"
            return False
        size = await self.dht.bootstrap(answered)
        self.metrics.bootstrap_attempts.labels("joined").inc()
        self.joined = True
        self.bootstrap_state = "joined"
        log.info("joined the swarm through %s: %d contacts", ", ".join(answered), size)
        self.notifier.status(self._status_line())
        return True

    async def _answers(self, address: str) -> bool:
        assert self.dht is not None
        try:
            await self.dht.network.call(address, PING, {}, self.config.peers.ping_timeout_s)
        except DHTError as exc:
            log.debug("bootstrap peer %s: %s", address, exc)
            return False
        return True

    async def _bootstrap_first(self) -> bool:
        """Join through the bootstrap peers: one round, or with require_bootstrap, rounds with backoff
        until its timeout. True when joined or when there is nobody to join (a new swarm)."""
        net = self.config.network
        peers = self._bootstrap_peers()
        if not peers:
            self.bootstrap_state = "first node of a new swarm"
            return True
        deadline = time.monotonic() + net.require_bootstrap_timeout_s
        delay = net.bootstrap_retry_initial_s
        while not await self._bootstrap_round(peers):
            left = deadline - time.monotonic()
            if not net.require_bootstrap or left <= 0:
                return False
            log.warning("bootstrap: none of %s answered; retrying in %.1f s (giving up in %.0f s)",
                        ", ".join(peers), min(delay, left), left)
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, net.bootstrap_retry_max_s)
        return True

    async def _bootstrap_retry(self) -> None:
        """Keep trying to join with backoff while running alone; the first success ends it."""
        net = self.config.network
        peers = self._bootstrap_peers()
        delay = net.bootstrap_retry_initial_s
        while True:
            log.warning("bootstrap: none of %s answered; running alone, retrying in %.1f s", ", ".join(peers), delay)
            self.notifier.status(f"running alone: no bootstrap peer answers; retrying in {delay:.0f} s")
            await asyncio.sleep(delay)
            if await self._bootstrap_round(peers):
                return
            delay = min(delay * 2, net.bootstrap_retry_max_s)

    async def _discover(self) -> None:
        """Look up our own id now and then, so peers that joined elsewhere reach our table."""
        assert self.dht is not None and self.identity is not None
        while True:
            await asyncio.sleep(self.config.peers.discovery_interval_s)
            try:
                await self.dht.find_nearest(self.identity.peer_id, self.config.peers.discovery_nearest)
            except DHTError as exc:
                log.debug("discovery lookup failed: %s", exc)

    async def _ping_peers(self) -> None:
        """The liveness loop under its own `Supervisor`: a bug in a ping is shown in status
        (`supervision`) and the loop restarted, instead of ending the daemon's task group."""
        await Supervisor("liveness", self.faults).run("ping peers", self._ping_forever)

    async def _ping_forever(self) -> None:
        assert self.dht is not None and self.pool is not None
        dht, peers = self.dht, self.config.peers

        async def ping(address: str) -> bytes:
            reply = await dht.network.call(address, PING, {}, peers.ping_timeout_s)
            return reply.peer_id

        await liveness.ping_loop(
            self.book, lambda: [(c.peer_id, c.address) for c in dht.contacts()], ping,
            interval_s=peers.ping_interval_s, timeout_s=peers.ping_timeout_s, sample=peers.ping_sample,
            clock=time.monotonic,
            on_result=lambda ok: self.metrics.peer_pings.labels("ok" if ok else "failed").inc(),
        )

    # ------------------------------------------------------------------------------- signals

    def _on_stop_signal(self, sig: signal.Signals) -> None:
        assert self._stop is not None
        self._signals += 1
        if self._signals > 1:
            log.warning("second %s: exiting now without finishing the drain", sig.name)
            logging.shutdown()
            os._exit(EXIT_FORCED)
        log.info("%s: draining (up to %g s); send it again to exit at once", sig.name, self.config.daemon.drain_timeout_s)
        self._stopping(f"draining after {sig.name}")
        self._stop.set()

    def _on_reload(self) -> None:
        self.notifier.reloading()
        try:
            fresh = self._reload()
        except configuration.ConfigError as exc:
            log.error("SIGHUP: configuration not reloaded: %s", exc)
        else:
            if fresh.log != self.config.log:
                logs.set_level(fresh.log.level)
                log.warning("SIGHUP: log level is now %s", fresh.log.level)
            changed = [name for name, _ in configuration.sections()
                       if name != "log" and getattr(fresh, name) != getattr(self.config, name)]
            if changed:
                log.warning("SIGHUP: changes to [%s] take effect at the next restart", "], [".join(changed))
            self.config = dataclasses.replace(self.config, log=dataclasses.replace(self.config.log, level=fresh.log.level))
        self.notifier.ready(self._status_line())

    def _stopping(self, status: str) -> None:
        """STOPPING=1 once, as early as the drain is known."""
        if not self._stopping_sent:
            self._stopping_sent = True
            self.notifier.stopping(status)

    # ------------------------------------------------------------------------ control API view

    def status(self) -> dict[str, Any]:
        assert self.identity is not None
        now = time.monotonic()
        return {
            "peer_id": self.identity.peer_id.hex(),
            "version": package_version(),
            "pid": os.getpid(),
            "uptime_s": round(now - self.started, 3),
            "listen": str(self.listen),
            "announce": str(self.announce),
            "control_socket": str(self.control_socket),
            "metrics": str(self.metrics_address or ""),
            "state_dir": str(self.config.daemon.state_dir),
            "device": self.device,
            "bootstrap": {"peers": [str(a) for a in self.config.network.bootstrap], "joined": self.joined,
                          "state": self.bootstrap_state},
            "peers": {"known": len(self.peers()) - 1, "alive": self.book.count_alive(now)},
            "dht": {"contacts": len(self.dht.contacts()) if self.dht else 0},
            "serving": {"stages": self.serving.stages() if self.serving else []},
            "rebalance": self.rebalancing.status() if self.rebalancing else None,
            "supervision": self.faults.status(),
            "joining": {"ticks": self.joining.ticks} if self.joining else None,
            "draining": self.draining,
        }

    def peers(self) -> list[dict[str, Any]]:
        assert self.identity is not None and self.dht is not None
        me = {"peer_id": self.identity.peer_id.hex(), "address": str(self.announce), "last_seen_s_ago": 0.0,
              "alive": True, "self": True}
        known = [(c.peer_id, c.address) for c in self.dht.contacts()]
        return [me] + self.book.view(known, time.monotonic())

    async def dht_get(self, key: bytes) -> dict[str, Any]:
        assert self.dht is not None
        try:
            records: dict[bytes, Record] = await self.dht.get(key, latest=True)
        except Exception:
            self.metrics.dht_gets.labels("error").inc()
            raise
        self.metrics.dht_gets.labels("ok").inc()
        wall = time.time()
        return {"records": [
            {"subkey": r.subkey, "value": r.value, "expires_in_s": round(r.expiration - wall, 3)}
            for r in sorted(records.values(), key=lambda r: r.subkey)
        ]}

    @property
    def jobs(self) -> JobRegistry:
        assert self.job_registry is not None
        return self.job_registry

    def request_drain(self, reason: str) -> dict[str, Any]:
        assert self._stop is not None
        if not self._stop.is_set():
            log.info("%s: draining (up to %g s)", reason, self.config.daemon.drain_timeout_s)
            self._stopping(f"draining: {reason}")
            self._stop.set()
        return {"draining": True, "drain_timeout_s": self.config.daemon.drain_timeout_s}

    def _status_line(self) -> str:
        contacts = len(self.dht.contacts()) if self.dht else 0
        return f"listening on {self.announce}, {contacts} DHT contacts, {self.bootstrap_state}"


def _awaitable(close: Callable[[], None]) -> Callable[[], Awaitable[None]]:
    """A synchronous close as a closer step (all steps are awaited in one loop)."""

    async def step() -> None:
        close()

    return step


async def _close_server(server: asyncio.Server) -> None:
    server.close()
    await server.wait_closed()


def run(config: Config, reload: Callable[[], Config] | None = None) -> int:
    """Run a daemon on the best event loop; returns the exit status for `sys.exit`."""
    logs.configure(config.log.level, config.log.format,
                   limit=logs.WarningLimit(config.log.warnings_per_source, config.log.warning_window_s))
    daemon = Daemon(config, reload=reload or (lambda: config))
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            return runner.run(daemon.run())
    except Exception:
        log.exception("swarmd failed")
        return EXIT_FAILURE
