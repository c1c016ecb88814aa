"""The networked half of the load gossip: one job's push-pull exchange of signed load entries.

`swarmd.rebalance.view` is pure; this module is the thin asyncio shell that moves its bytes. Every
`period_s` (jittered, so a swarm's rounds do not align) a peer re-signs its own entry, picks `fanout`
random members of the job and, in one `gossip.exchange` call each, pushes its own entry and a random
sample of at most `max_exchange_entries` others from its view, and merges what comes back (the
partner answers the same way). Sending the whole view made every exchange, and so each peer's
gossip bytes, grow with the job; a fixed sample still spreads every entry in a few rounds, each
peer's own entry going out first-hand to `fanout` partners every round. Newest-per-peer and
signatures make the exchange idempotent and safe to relay, so a lost call costs nothing but freshness.

Membership comes from the `StageDirectory` (the DHT in the daemon): entries of peers it does not list
are refused, and only listed peers are dialled. Entries are signed by the peer they describe, so the
caller's own identity matters only for the per-caller inbound rate limit, which uses the id the
transport handshake proved. The view's job name is the job id in hex: each signed entry names one job
id, so it cannot be replayed into another job's gossip.

Signature checks cost ~0.1-0.5 ms each and a full batch holds thousands, so decoding, merging and
encoding run on one worker thread that owns the view: that keeps the event loop free and serialises
every access to the view without a lock.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from swarmd.clock import Clock, RealClock
from swarmd.dht.errors import DHTError
from swarmd.directory import StageDirectory
from swarmd.errors import ConfigError
from swarmd.rebalance.table import StageTable
from swarmd.supervisor import Supervisor
from swarmd.rebalance.view import (
    DEFAULT_LIMITS,
    GossipView,
    LoadEntry,
    MalformedEntry,
    MergeResult,
    RebalanceError,
    ViewLimits,
    decode_entries,
    encode_entries,
)
from transport.errors import RpcError, TransportError
from transport.identity import Identity
from transport.message import Message, Request, Router
from transport.pool import Pool
from transport.tasks import TaskSet

log = logging.getLogger(__name__)

METHOD = "gossip.exchange"
CODE_BAD_REQUEST = "bad_request"
CODE_RATE_LIMITED = "rate_limited"
CODE_UNAVAILABLE = "unavailable"


class GossipStopped(RebalanceError):
    """The service is not running (not started yet, or stopped): its view is not to be read or merged."""


@dataclass(frozen=True)
class GossipConfig:
    """Knobs of one job's gossip; every limit is checked before work or allocation is spent on it."""

    # Seconds between rounds: "every few seconds" (issue 6). With fanout 3 a new entry reaches a
    # swarm of hundreds in ~log3(n) rounds, far inside the view's 120 s max_age.
    period_s: float = 5.0
    # Each round's delay is scaled by a factor in [1 - jitter, 1 + jitter] so rounds of peers
    # started together drift apart instead of hitting the same partners at once.
    jitter: float = 0.2
    # Partners per round: push-pull with 3 partners converges in a handful of rounds and costs
    # 3 views per period on the wire.
    fanout: int = 3
    # One exchange, dial and handshake included. A partner slower than this is skipped for the
    # round; its entries arrive through others.
    call_timeout_s: float = 3.0
    # A partner that failed is not dialled again for backoff_base_s * 2^(failures - 1), capped at
    # backoff_max_s (the view's max_age: by then its entry is gone from every view anyway).
    backoff_base_s: float = 10.0
    backoff_max_s: float = 120.0
    # Inbound exchanges per caller: a token bucket. A well-behaved member calls at most once per
    # round (>= period_s * (1 - jitter) = 4 s), so 1/s with a burst of 4 leaves wide headroom
    # while a flood costs us at most that many decodes and signature checks per second per caller.
    inbound_rate_per_s: float = 1.0
    inbound_burst: float = 4.0
    # Callers whose buckets are remembered (least recently seen forgotten first): bounds the
    # limiter's memory; one view's max_peers by default.
    max_tracked_callers: int = 4096
    # Directory answers are reused for this long: membership changes on the scale of joins and
    # preemptions (minutes), and each refresh costs a lookup per stage.
    members_ttl_s: float = 15.0
    # Entries besides our own in one exchange (a request or a reply): a random sample of the view.
    # 16 keeps an exchange at ~3 KB whatever the job's size; with fanout 3 push-pull a peer meets
    # ~100 sampled entries per round, so a swarm of dozens converges in a few rounds all the same.
    max_exchange_entries: int = 16
    # Bounds of the view and of every batch on the wire (encoded bytes, entries, age).
    limits: ViewLimits = DEFAULT_LIMITS

    def __post_init__(self) -> None:
        """Raises `ConfigError` keyed by the field's name (`RebalanceSettings` maps it to its
        `[rebalance]` key), so a refused setting is reported as configuration, not as a bug."""
        positive = ("period_s", "call_timeout_s", "backoff_base_s", "backoff_max_s", "inbound_rate_per_s",
                    "members_ttl_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be positive, got {getattr(self, name)!r}")
        if not 0 <= self.jitter < 1:
            raise ConfigError("jitter", f"must be in [0, 1), got {self.jitter!r}")
        for name in ("fanout", "max_tracked_callers"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be at least 1, got {getattr(self, name)!r}")
        if not 0 <= self.max_exchange_entries < self.limits.max_batch:
            raise ConfigError("max_exchange_entries", f"must be in [0, limits.max_batch - 1], got "
                              f"{self.max_exchange_entries!r}: an exchange carries them and our own entry")
        if self.inbound_burst < 1:
            raise ConfigError("inbound_burst", "must be at least 1, or no call is ever admitted")
        if self.backoff_max_s < self.backoff_base_s:
            raise ConfigError("backoff_max_s", "must be at least backoff_base_s")


@dataclass(frozen=True)
class OwnLoad:
    """What this peer says about itself this round (signed and timestamped by the service)."""

    stage: int
    samples_per_s: float
    queue_depth: int
    state: str


@dataclass
class GossipStats:
    """Counters for logs, metrics and tests: what went out, what came in, what was refused and why."""

    rounds: int = 0
    exchanges_ok: int = 0
    exchanges_failed: int = 0
    served: int = 0
    accepted: int = 0
    stale: int = 0
    rejected: collections.Counter = field(default_factory=collections.Counter)  # merge reason -> count
    refused: collections.Counter = field(default_factory=collections.Counter)  # inbound error code -> count

    def count_merge(self, result: MergeResult) -> None:
        self.accepted += len(result.accepted)
        self.stale += result.stale
        self.rejected.update(reason for _, reason in result.rejected)


class TokenBuckets:
    """Per-caller token buckets on a monotonic clock, least recently seen callers forgotten first."""

    def __init__(self, rate_per_s: float, burst: float, max_callers: int) -> None:
        self.rate_per_s, self.burst, self.max_callers = rate_per_s, burst, max_callers
        self._buckets: collections.OrderedDict[bytes, tuple[float, float]] = collections.OrderedDict()

    def admit(self, caller: bytes, now: float) -> bool:
        tokens, at = self._buckets.pop(caller, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate_per_s)
        admitted = tokens >= 1.0
        self._buckets[caller] = (tokens - 1.0 if admitted else tokens, now)
        while len(self._buckets) > self.max_callers:
            self._buckets.popitem(last=False)
        return admitted


class GossipService:
    """Gossip of one job's load view, on one peer.

    The handler is registered at construction (a Router cannot unregister) and answers
    `unavailable` outside start()..stop(). `view` is owned by the worker thread while running:
    read it through `table()` / `entries()`, or directly only once stopped. The rounds run under
    `supervisor` (the daemon's): an unexpected error in one is logged, shown and the rounds restarted.
    """

    def __init__(self, job_id: bytes, num_stages: int, identity: Identity, own_load: Callable[[], OwnLoad],
                 router: Router, pool: Pool, directory: StageDirectory, config: GossipConfig = GossipConfig(),
                 clock: Clock = RealClock(), supervisor: Supervisor | None = None) -> None:
        if num_stages < 1:
            raise ValueError(f"a pipeline has at least one stage, got {num_stages}")
        self.job_id, self.num_stages, self.identity = job_id, num_stages, identity
        self.own_load, self.pool, self.directory = own_load, pool, directory
        self.config, self.clock = config, clock
        self.view = GossipView(job_id.hex(), config.limits)
        self.stats = GossipStats()
        self._buckets = TokenBuckets(config.inbound_rate_per_s, config.inbound_burst, config.max_tracked_callers)
        self._rng = random.Random(identity.peer_id)  # deterministic per peer, different across peers
        self._sample_rng = random.Random(identity.peer_id + b"sample")  # the worker thread's own
        self._members: dict[bytes, str] = {}  # peer id -> address, from the directory
        self._members_at: float | None = None
        self._failures: dict[bytes, int] = {}
        self._retry_at: dict[bytes, float] = {}
        self._own_timestamp = 0.0
        self._tasks = TaskSet(f"gossip {job_id.hex()[:8]}")
        self._supervisor = supervisor or Supervisor("rebalancing")
        self._worker: ThreadPoolExecutor | None = None
        self._serving = False
        router.unary(METHOD, self._handle)

    # ------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Learn the members, publish our own entry, then gossip every period until stop(); once only."""
        if self._worker is not None:
            raise RuntimeError("the gossip service is already running")
        await self._refresh_members()  # first: a call served before it would refuse every entry
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gossip-view")
        await self._publish_own()
        self._serving = True
        self._tasks.spawn(self._supervisor.run(f"gossip rounds {self.job_id.hex()[:16]}", self._run), "rounds")

    async def stop(self) -> None:
        """Refuse new calls, cancel the rounds and wait for them, then retire the worker (in that
        order, so a round never finds its worker gone; a call already inside gets `unavailable`)."""
        self._serving = False
        await self._tasks.aclose("gossip stopping")
        worker, self._worker = self._worker, None
        if worker is not None:  # a merge may be running: wait for it off the loop
            await asyncio.to_thread(worker.shutdown, wait=True, cancel_futures=True)

    # ------------------------------------------------------------------------ reading the view

    async def table(self) -> StageTable:
        """The policy's input, built from the live entries."""
        return await self._in_view(self.view.table, self.num_stages, self.clock.time())

    async def entries(self) -> list[LoadEntry]:
        return await self._in_view(self.view.entries)

    # ------------------------------------------------------------------------ rounds

    async def _run(self) -> None:
        while True:
            started = self.clock.monotonic()
            await self.round()
            delay = self.config.period_s * self._rng.uniform(1 - self.config.jitter, 1 + self.config.jitter)
            await asyncio.sleep(max(0.0, started + delay - self.clock.monotonic()))

    async def round(self) -> None:
        """One round: refresh members if due, re-sign our entry, exchange with `fanout` partners at once."""
        if self._members_at is None or self.clock.monotonic() - self._members_at >= self.config.members_ttl_s:
            await self._refresh_members()
        await self._publish_own()
        partners = self._pick_partners()
        payload = await self._in_view(self._encode_view)
        async with asyncio.TaskGroup() as group:
            for peer_id, address in partners:
                group.create_task(self._exchange(peer_id, address, payload))
        self.stats.rounds += 1

    def _pick_partners(self) -> list[tuple[bytes, str]]:
        now = self.clock.monotonic()
        candidates = sorted(
            (peer_id, address) for peer_id, address in self._members.items()
            if peer_id != self.identity.peer_id and self._retry_at.get(peer_id, now) <= now
        )
        return self._rng.sample(candidates, min(self.config.fanout, len(candidates)))

    async def _exchange(self, peer_id: bytes, address: str, payload: bytes) -> None:
        """Push our view, merge theirs; any failure of the partner only backs it off."""
        try:
            reply = await self.pool.call(address, METHOD, self._message(payload),
                                         timeout=self.config.call_timeout_s)
            data = self._payload_of(reply)
            result = await self._in_view(self._decode_and_merge, data, self._members)
        except (TransportError, MalformedEntry, OSError) as exc:
            self._back_off(peer_id, f"{address}: {exc}")
            return
        self.stats.count_merge(result)
        if any(reason == "bad signature" for _, reason in result.rejected):
            # Honest peers verify before they store, so only a liar (or a broken peer) relays these.
            self._back_off(peer_id, f"{address} sent entries with bad signatures")
            return
        self._failures.pop(peer_id, None)
        self._retry_at.pop(peer_id, None)
        self.stats.exchanges_ok += 1

    def _back_off(self, peer_id: bytes, why: str) -> None:
        self.stats.exchanges_failed += 1
        failures = self._failures[peer_id] = self._failures.get(peer_id, 0) + 1
        backoff = min(self.config.backoff_max_s, self.config.backoff_base_s * 2 ** (failures - 1))
        self._retry_at[peer_id] = self.clock.monotonic() + backoff
        log.debug("gossip with %s failed (%s); next try in %.1f s", peer_id.hex()[:8], why, backoff)

    async def _refresh_members(self) -> None:
        """Ask the directory for every stage's peers; on failure keep the previous answer (a
        failed ask cancels the others: a TaskGroup, not a gather that would leave them running)."""
        failure: BaseException | None = None
        try:
            async with asyncio.timeout(self.config.call_timeout_s), asyncio.TaskGroup() as group:
                asks = [group.create_task(self.directory.peers(self.job_id, s)) for s in range(self.num_stages)]
        except* (TransportError, DHTError, TimeoutError, OSError) as failed:
            failure = failed.exceptions[0]
        if failure is not None:
            log.warning("gossip: the directory did not answer (%s); keeping %d known members", failure,
                        len(self._members))
            return
        members = {peer.peer_id: peer.addr for ask in asks for peer in ask.result()}
        self._members = members
        self._members_at = self.clock.monotonic()
        for table in (self._failures, self._retry_at):
            for gone in [p for p in table if p not in members]:
                del table[gone]

    async def _publish_own(self) -> None:
        """Re-sign our entry with a strictly newer timestamp (so it wins even if the wall clock stepped back)."""
        load = self.own_load()
        self._own_timestamp = max(self.clock.time(), self._own_timestamp + 1e-3)
        entry = LoadEntry.create(self.identity, self.view.job, load.stage, load.samples_per_s, load.queue_depth,
                                 load.state, self._own_timestamp)
        await self._in_view(self.view.merge, [entry], self._own_timestamp)

    # ------------------------------------------------------------------------ inbound

    async def _handle(self, request: Request) -> Message:
        if not self._serving:
            raise self._refuse(CODE_UNAVAILABLE, "gossip for this job is not running here")
        caller = request.peer.peer_id
        if caller is None:
            raise self._refuse(CODE_BAD_REQUEST, "gossip needs an authenticated caller")
        if not self._buckets.admit(caller, self.clock.monotonic()):
            raise self._refuse(CODE_RATE_LIMITED, "too many gossip exchanges from this peer")
        if not isinstance(request.meta, dict) or request.meta.get("job") != self.job_id:
            raise self._refuse(CODE_BAD_REQUEST, "the exchange names another job or none")
        try:
            data = self._payload_of(request)
            result = await self._in_view(self._decode_and_merge, data, self._members)
            reply = await self._in_view(self._encode_view)
        except MalformedEntry as exc:
            raise self._refuse(CODE_BAD_REQUEST, str(exc)) from None
        except GossipStopped:
            raise self._refuse(CODE_UNAVAILABLE, "gossip for this job stopped during the call") from None
        self.stats.served += 1
        self.stats.count_merge(result)
        return self._message(reply)

    def _refuse(self, code: str, message: str) -> RpcError:
        self.stats.refused[code] += 1
        return RpcError(code, message)

    # ------------------------------------------------------------------------ wire and worker

    def _message(self, payload: bytes) -> Message:
        """The batch travels as one uint8 tensor: it can outgrow the 64 KiB header, and codec `none`
        keeps the bytes exact."""
        return Message({"job": self.job_id}, [torch.frombuffer(bytearray(payload), dtype=torch.uint8)],
                       codec="none")

    def _payload_of(self, message: Any) -> bytes:
        """The encoded batch of a request or reply, its size checked before it is copied or parsed."""
        tensors = message.tensors
        if len(tensors) != 1:
            raise MalformedEntry(f"an exchange carries exactly one payload, got {len(tensors)}")
        tensor = tensors[0]
        if tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise MalformedEntry(f"the payload must be 1-D uint8, got {tensor.dtype} of shape {list(tensor.shape)}")
        if tensor.numel() > self.config.limits.max_encoded_bytes:
            raise MalformedEntry(f"payload of {tensor.numel()} bytes exceeds "
                                 f"max_encoded_bytes={self.config.limits.max_encoded_bytes}")
        return tensor.numpy().tobytes()

    def _decode_and_merge(self, data: bytes, members: dict[bytes, str]) -> MergeResult:
        """Worker thread: parse strictly, then merge under the directory's membership (a snapshot:
        the loop replaces the members dict, never mutates it)."""
        entries = decode_entries(data, self.config.limits)
        return self.view.merge(entries, self.clock.time(), members)

    def _encode_view(self) -> bytes:
        """Worker thread: our own entry first, then a random sample of at most max_exchange_entries
        other live entries, cut to what a receiver with our limits accepts (by bytes, should an odd
        configuration make entries outgrow them; our own entry goes last)."""
        limits = self.config.limits
        self.view.expire(self.clock.time())
        own = self.view.get(self.identity.peer_id)
        others = sorted((e for e in self.view.entries() if e.peer_id != self.identity.peer_id),
                        key=lambda e: e.peer_id)
        sample = self._sample_rng.sample(others, min(self.config.max_exchange_entries, len(others)))
        entries = ([own] if own is not None else []) + sample
        while len(data := encode_entries(entries)) > limits.max_encoded_bytes:
            entries = entries[: len(entries) // 2]
        return data

    async def _in_view(self, fn: Callable[..., Any], *args: Any) -> Any:
        worker = self._worker
        if worker is None:
            raise GossipStopped("the gossip service is not running")
        return await asyncio.get_running_loop().run_in_executor(worker, fn, *args)
