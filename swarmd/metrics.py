"""Prometheus metrics of one daemon, on a registry of its own, served over a tiny asyncio HTTP endpoint.

Names carry the `swarmd_` prefix and their unit; label values come only from closed sets (the
methods a router registered, a fixed list of outcomes or refusal reasons), never a peer id, so a
peer cannot grow our series count by calling made-up method names or minting identities. The endpoint runs on the daemon's event loop instead of
prometheus_client's thread server, so it is started and stopped with everything else.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, AsyncIterator, Callable, Sequence

import msgpack
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from swarmd.config import Address
from swarmd.dht.errors import REJECTION_REASONS
from swarmd.values import VALUE_REFUSALS
from swarmd.dht.stats import LOOKUP_KINDS, LOOKUP_OUTCOMES, LookupStats
from transport.errors import HANDSHAKE_FAILURE_REASONS
from transport.message import Message, Request, Router
from transport.traffic import Traffic

log = logging.getLogger(__name__)

#: Request head size and read time for the metrics endpoint: a scrape is one short GET.
MAX_REQUEST_HEAD_BYTES = 8192
REQUEST_READ_TIMEOUT_S = 5.0

#: The closed set of outcome label values.
OUTCOMES = ("ok", "error", "cancelled")
#: Outcomes of a trainer's held-out evaluation ([eval], swarmd/train/evaluation.py).
EVAL_OUTCOMES = ("ok", "given_up")
#: The closed set of direction label values of swarmd_rpc_served_bytes_total.
DIRECTIONS = ("in", "out")


def message_bytes(meta: Any, tensors: Sequence[Any]) -> int:
    """What one message carries: its header map as msgpack plus its tensors' in-memory bytes (before
    the codec; control messages send none, or exact uint8 bytes). Framing and sealing are not
    included: swarmd_transport_*_bytes counts socket bytes, this attributes them to a method."""
    try:
        size = len(msgpack.packb(meta, use_bin_type=True))
    except (TypeError, ValueError, OverflowError):  # the transport refuses it too; counted as nothing
        size = 0
    return size + sum(t.numel() * t.element_size() for t in tensors)


class Metrics:
    """Every series the daemon exports; other parts get this object and update what they own."""

    def __init__(self, version: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        Gauge("swarmd_build_info", "Version of the running daemon (value is always 1).", ["version"],
              registry=r).labels(version).set(1)
        Gauge("swarmd_start_time_seconds", "Unix time the daemon started.", registry=r).set(time.time())
        # Added in this order, which is the order of the scrape's text.
        self._add_rpc_series(r)
        self._add_swarm_series(r)
        self._add_job_series(r)

    def _add_rpc_series(self, r: CollectorRegistry) -> None:
        """The routers' counts (InstrumentedRouter) and the control socket's refusals."""
        self.rpc_requests = Counter(
            "swarmd_rpc_requests_total", "RPC requests handled, by service, method and outcome.",
            ["service", "method", "outcome"], registry=r,
        )
        self.rpc_served_bytes = Counter(
            "swarmd_rpc_served_bytes_total", "Bytes of RPCs this daemon served (a caller's request in, our "
            "replies out), by service, method and direction: msgpack header plus tensor bytes before the codec, "
            "no framing. Puts the transport's byte totals on the methods that spent them.",
            ["service", "method", "direction"], registry=r,
        )
        self.rpc_duration = Histogram(
            "swarmd_rpc_duration_seconds", "Time to handle one RPC request.", ["service", "method"],
            buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0, 60.0), registry=r,
        )
        self.control_refused = Counter(
            "swarmd_control_refused_connections_total",
            "Control socket connections refused by SO_PEERCRED admission.", registry=r,
        )

    def _add_swarm_series(self, r: CollectorRegistry) -> None:
        """Bootstrap, liveness, the DHT and the transport's byte counts."""
        self.bootstrap_attempts = Counter(
            "swarmd_bootstrap_attempts_total", "Bootstrap rounds, by outcome.", ["outcome"], registry=r,
        )
        self.peer_pings = Counter(
            "swarmd_peer_pings_total", "Liveness pings sent to known peers, by outcome.", ["outcome"], registry=r,
        )
        self.peers_alive = Gauge("swarmd_peers_alive", "Peers heard from within the liveness window.", registry=r)
        self.dht_contacts = Gauge("swarmd_dht_contacts", "Contacts in the DHT routing table.", registry=r)
        self.dht_stored_keys = Gauge("swarmd_dht_stored_keys", "Keys this node holds records for.", registry=r)
        self.dht_gets = Counter(
            "swarmd_dht_gets_total", "DHT gets asked through the control API, by outcome.", ["outcome"], registry=r,
        )
        #: Counted by the transport on every peer connection: the daemon passes it in its RpcConfig.
        self.traffic = Traffic()
        #: Counted inside the DHT node; `None` until the node exists (its series then read 0).
        self.dht_lookups: LookupStats | None = None
        #: The DHT node's refused-record counts by reason (its own dict, read live); `None` until then.
        self.dht_refused_records: dict[str, int] | None = None
        r.register(_Counted(self))

    def _add_job_series(self, r: CollectorRegistry) -> None:
        """Rebalancing moves and the trainers' held-out evaluations."""
        self.rebalance_moves = Counter(
            "swarmd_rebalance_moves_total", "Rebalancing moves of a served stage to another, by outcome.",
            ["outcome"], registry=r,
        )
        self.rebalance_moving_seconds = Counter(
            "swarmd_rebalance_moving_seconds_total", "Wall time spent in rebalancing moves (drain and state "
            "download), failed ones included.", registry=r,
        )
        # Not labelled by job: a job id is any submitter's to mint. Per job, the curve is in
        # `job.get` (eval_loss) and the step events; this is the daemon's last word, for alerts.
        self.eval_loss = Gauge("swarmd_trainer_eval_loss", "Held-out loss ([eval]) this daemon's trainers "
                               "measured last, whatever the job; NaN before any.", registry=r)
        self.eval_loss.set(math.nan)
        #: Held-out evaluations by outcome (the trainers' own dict, read live); `None` until they exist.
        self.evaluations: dict[str, int] | None = None
        self.rebalance_jobs = Gauge("swarmd_rebalance_jobs", "Jobs this daemon gossips load and checks moves for.",
                                    registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Counted:
    """Counters kept by parts that do not import prometheus_client (the transport, the DHT), read
    at scrape time: counting stays a plain integer add on the hot path."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list:
        return []  # the families are built at scrape time; nothing to check names against up front

    def collect(self):
        traffic = self._metrics.traffic
        yield CounterMetricFamily("swarmd_transport_sent_bytes", "Bytes written to peer connections "
                                  "(frame headers, hellos and sealed records included).", traffic.sent_bytes)
        yield CounterMetricFamily("swarmd_transport_received_bytes", "Bytes read from peer connections.",
                                  traffic.received_bytes)
        # Security signals, never labelled by peer: a label per peer id would let a peer that mints
        # identities grow our series without bound. Who it was is in the daemon's log.
        yield CounterMetricFamily("swarmd_rpc_rate_limited", "Peer calls refused with rate_limited (over "
                                  "network.rpc_rate_limit_per_s), all peers together.", traffic.rate_limited_calls)
        hellos = CounterMetricFamily("swarmd_transport_handshake_failures", "Peer connections whose hello failed, "
                                     "either direction, by reason.", labels=["reason"])
        for reason in HANDSHAKE_FAILURE_REASONS:
            hellos.add_metric([reason], traffic.hello_failures[reason])
        yield hellos
        refused_records = self._metrics.dht_refused_records or {}
        refused = CounterMetricFamily("swarmd_dht_refused_records", "Records other peers stored here that this "
                                      "node refused, and values read from the DHT that failed their schema "
                                      "(swarmd.values), by reason.", labels=["reason"])
        for reason in (*REJECTION_REASONS, *VALUE_REFUSALS):
            refused.add_metric([reason], refused_records.get(reason, 0))
        yield refused
        evaluations = self._metrics.evaluations or {}
        evaluated = CounterMetricFamily("swarmd_trainer_evaluations", "Held-out evaluations ([eval]) this daemon's "
                                        "trainers ran, by outcome (given_up: the swarm could not answer them).",
                                        labels=["outcome"])
        for outcome in EVAL_OUTCOMES:
            evaluated.add_metric([outcome], evaluations.get(outcome, 0))
        yield evaluated
        stats = self._metrics.dht_lookups or LookupStats()
        lookups = CounterMetricFamily("swarmd_dht_lookups", "Iterative DHT lookups this node ran, by kind "
                                      "(find_node, find_value) and outcome.", labels=["kind", "outcome"])
        for kind in LOOKUP_KINDS:
            for outcome in LOOKUP_OUTCOMES:
                lookups.add_metric([kind, outcome], stats.lookups[(kind, outcome)])
        yield lookups
        rpcs = CounterMetricFamily("swarmd_dht_lookup_rpcs", "Queries sent by DHT lookups, by kind.", labels=["kind"])
        failed = CounterMetricFamily("swarmd_dht_lookup_failed_rpcs",
                                     "Lookup queries that failed (timeout, refusal, bad reply), by kind.",
                                     labels=["kind"])
        for kind in LOOKUP_KINDS:
            rpcs.add_metric([kind], stats.rpcs[kind])
            failed.add_metric([kind], stats.failed_rpcs[kind])
        yield rpcs
        yield failed


class InstrumentedRouter(Router):
    """A Router whose handlers count themselves; the method label is the registered name only."""

    def __init__(self, metrics: Metrics, service: str) -> None:
        super().__init__()
        self._metrics, self._service = metrics, service

    def unary(self, name: str, handler: Callable[[Request], Any]) -> None:
        async def counted(request: Request) -> Message:
            started = time.perf_counter()
            outcome = "error"
            self._bytes(name, "in", request.meta, request.tensors)
            try:
                reply = await handler(request)
                outcome = "ok"
                self._bytes(name, "out", reply.meta, reply.tensors)
                return reply
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            finally:
                self._observe(name, outcome, started)

        super().unary(name, counted)

    def stream(self, name: str, handler: Callable[[Request], AsyncIterator[Message]]) -> None:
        async def counted(request: Request) -> AsyncIterator[Message]:
            started = time.perf_counter()
            outcome = "error"
            self._bytes(name, "in", request.meta, request.tensors)
            try:
                async for item in handler(request):
                    self._bytes(name, "out", item.meta, item.tensors)
                    yield item
                outcome = "ok"
            except (asyncio.CancelledError, GeneratorExit):
                outcome = "cancelled"
                raise
            finally:
                self._observe(name, outcome, started)

        super().stream(name, counted)

    def _bytes(self, name: str, direction: str, meta: Any, tensors: Sequence[Any]) -> None:
        self._metrics.rpc_served_bytes.labels(self._service, name, direction).inc(message_bytes(meta, tensors))

    def _observe(self, name: str, outcome: str, started: float) -> None:
        self._metrics.rpc_requests.labels(self._service, name, outcome).inc()
        self._metrics.rpc_duration.labels(self._service, name).observe(time.perf_counter() - started)


async def serve(metrics: Metrics, address: Address) -> asyncio.Server:
    """Start the scrape endpoint (GET /metrics); the caller owns and closes the returned server."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_READ_TIMEOUT_S)
            parts = head.split(b"\r\n", 1)[0].split()
            if len(parts) == 3 and parts[0] == b"GET" and parts[1].split(b"?")[0] == b"/metrics":
                body, status, ctype = metrics.render(), b"200 OK", CONTENT_TYPE_LATEST.encode()
            else:
                body, status, ctype = b"not found; try /metrics\n", b"404 Not Found", b"text/plain"
            writer.write(
                b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype
                + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body
            )
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a client that sends garbage or nothing gets the connection closed
        finally:
            writer.close()

    server = await asyncio.start_server(handle, address.host, address.port, limit=MAX_REQUEST_HEAD_BYTES)
    log.info("metrics on http://%s/metrics", Address(address.host, server.sockets[0].getsockname()[1]))
    return server

