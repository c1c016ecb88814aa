"""DHTNode: the Kademlia node that serves peers, looks things up, stores and announces records.

A node owns its background work (record pruning, announcement refresh, bucket refresh and
re-bootstrap, hand-off of records to newly joined closer nodes) in one TaskGroup run by the task
`start()` creates; `stop()` cancels it and waits. Nothing is fire-and-forget.

Time: `clock.monotonic()` drives timeouts and schedules, `clock.time()` (wall) the absolute record
expirations that other machines compare.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import swarmd.dht.protocol as P
from swarmd.clock import Clock, RealClock
from swarmd.supervisor import Supervisor
from transport.identity import Identity

from .config import DHTConfig
from .errors import CallFailed, DHTProtocolError, DHTUsageError, RecordRejected, RemoteFailure, WrongPeer
from .lookup import Lookup, LookupResult
from .network import Caller, Network, Reply
from .records import Record, check_record, key_id, namespace_of, sign_record
from .routing import Contact, RoutingTable, distance
from .stats import LookupStats
from .storage import Storage, source_of

log = logging.getLogger(__name__)

#: Refusals that mean the sender tried to write what its key does not cover: named in the log.
FORGERY_REASONS = frozenset({"bad_signature", "wrong_owner", "unsigned"})
FORGERS_REMEMBERED = 1024

#: Self-lookups a bootstrap makes while its table is still filling (each one learns from the last).
BOOTSTRAP_LOOKUPS = 3


@dataclass(slots=True)
class Announcement:
    """A record this node keeps alive by re-storing it every refresh period until withdrawn."""

    key: bytes
    subkey: bytes
    value_fn: Callable[[], bytes]
    ttl: float
    next_due: float = 0.0
    last_expiration: float = 0.0
    withdrawn: bool = False


def _value_task(ann: Announcement) -> str:
    """The announcement's name in the supervisor's faults (its key, as far as people tell keys apart)."""
    return f"value of announcement {ann.key.hex()[:16]}"


class DHTNode:
    def __init__(self, identity: Identity, network: Network, config: DHTConfig = DHTConfig(),
                 clock: Clock | None = None, supervisor: Supervisor | None = None) -> None:
        self.identity = identity
        # The maintenance loops (prune, announce, refresh, hand-off) run as one task group: one that
        # dies of a bug takes the others with it. Under a supervisor the group is restarted with
        # backoff and the failure shown in `swarmctl status`; without one (simulations) the failure
        # is logged with its traceback when the task ends.
        self.supervisor = supervisor
        self.peer_id = identity.peer_id
        self.network = network
        self.config = config
        self.clock = clock or RealClock()
        self.table = RoutingTable(self.peer_id, config, self.clock.monotonic())
        self.storage = Storage(config)
        #: Statistics of the most recent lookup (tests and benchmarks read it).
        self.last_lookup: LookupResult | None = None
        #: Every lookup this node ran, by kind and outcome (the daemon's metrics read it).
        self.lookup_stats = LookupStats()
        #: Records refused from other peers' stores, by RecordRejected reason (a closed set).
        self.refused_records: dict[str, int] = {}
        #: Senders of forged records most recently reported (see _report_forger), oldest first.
        self.forgers: OrderedDict[bytes, None] = OrderedDict()
        self._rng = random.Random(self.peer_id)
        self._backoff: OrderedDict[bytes, tuple[float, int]] = OrderedDict()
        self._cache: dict[bytes, tuple[float, dict[bytes, Record]]] = {}
        self._gets: dict[bytes, asyncio.Future[dict[bytes, Record]]] = {}
        self._announcements: dict[tuple[bytes, bytes], Announcement] = {}
        self._announce_wake = asyncio.Event()
        self._bootstrap_addrs: list[str] = []
        self._handoffs: asyncio.Queue[tuple[bytes, str, bytes]] = asyncio.Queue(config.max_pending_handoffs)
        self._main: asyncio.Task[None] | None = None

    # ----- lifecycle -----

    async def start(self) -> None:
        await self.network.start(self._handle)
        name = f"dht-{self.peer_id.hex()[:8]}"
        if self.supervisor is not None:
            self._main = asyncio.create_task(self.supervisor.run(f"{name} maintenance", self._run), name=name)
        else:
            self._main = asyncio.create_task(self._run(), name=name)
        self._main.add_done_callback(self._main_ended)

    def _main_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("DHT maintenance of %s stopped", self.peer_id.hex()[:8], exc_info=task.exception())

    async def stop(self) -> None:
        """Cancel every background task, then stop serving."""
        if self._main is not None:
            self._main.cancel()
            try:
                await self._main
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise
            self._main = None
        await self.network.stop()

    async def _run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._prune_loop())
            tg.create_task(self._announce_loop())
            tg.create_task(self._maintenance_loop())
            tg.create_task(self._handoff_loop())

    # ----- public API -----

    @property
    def address(self) -> str:
        return self.network.address

    def contacts(self) -> list[Contact]:
        return self.table.contacts()

    async def bootstrap(self, addrs: Iterable[str]) -> int:
        """Ping the given peers, look ourselves up through them; returns routing-table size."""
        self._bootstrap_addrs = [a for a in addrs if a != self.address]

        async def ping(addr: str) -> None:
            try:
                await self._call(None, addr, P.PING, {})
            except CallFailed as e:
                log.info("bootstrap peer %s: %s", addr, e)

        async with asyncio.TaskGroup() as tg:
            for addr in self._bootstrap_addrs:
                tg.create_task(ping(addr))
        for _ in range(BOOTSTRAP_LOOKUPS):  # a lost reply must not leave a newcomer half-joined
            if not len(self.table):
                break
            await self.find_nearest(self.peer_id)
            if len(self.table) >= self.config.k:
                break
        return len(self.table)

    async def find_nearest(self, target: bytes, k: int | None = None) -> list[Contact]:
        """The k live nodes closest to a 32-byte id, found by an iterative lookup."""
        k = k or self.config.k

        async def query(peer_id: bytes, address: str) -> list[tuple[bytes, str]]:
            reply = await self._call(peer_id, address, P.FIND_NODE, P.find_node_request(target, k))
            return P.parse_contacts(reply.meta, self.config)

        result = await self._lookup("find_node", target, k, query)
        return [Contact(c.peer_id, c.address) for c in result.nearest]

    async def store(self, key: bytes, subkey: bytes, value: bytes, expiration: float) -> int:
        """Sign and store one record on the closest nodes; returns how many replicas accepted it."""
        record = sign_record(self.identity, key, subkey, value, expiration)
        try:
            check_record(record, self.config, self.clock.time())
        except RecordRejected as e:
            raise DHTUsageError(f"cannot store this record: {e}") from e
        return await self._replicate(key, record)

    async def get(self, key: bytes, latest: bool = False) -> dict[bytes, Record]:
        """Every live, verified subkey under `key`, merged across replicas (newest wins).

        Concurrent gets of one key share one lookup; results are cached briefly unless `latest`."""
        if not latest:
            cached = self._cache.get(key)
            if cached is not None and cached[0] > self.clock.monotonic():
                return dict(cached[1])
        while True:
            pending = self._gets.get(key)
            if pending is None:
                return dict(await self._get_owned(key))
            try:
                return dict(await asyncio.shield(pending))
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling() or not pending.cancelled():
                    raise
                # The get we joined was cancelled by its own caller: run our own.

    def announce(self, key: bytes, value_fn: Callable[[], bytes], *, subkey: bytes | None = None,
                 ttl: float | None = None) -> Announcement:
        """Keep (key, subkey -> value_fn()) alive: stored now and every refresh period until withdrawn.

        `subkey` defaults to our peer id (the only subkey a peer-rule namespace accepts from us)."""
        try:
            namespace_of(key)
        except RecordRejected as e:
            raise DHTUsageError(f"not a DHT key (make keys with dht_key): {e}") from e
        ann = Announcement(key, subkey or self.peer_id, value_fn, ttl or self.config.announce_ttl,
                           next_due=self.clock.monotonic())
        self._announcements[(ann.key, ann.subkey)] = ann
        self._announce_wake.set()
        return ann

    async def withdraw(self, ann: Announcement) -> int:
        """Stop refreshing and overwrite the entry with a tombstone that outlives the last record.

        Readers never see tombstones; without this the entry would linger until its expiration."""
        ann.withdrawn = True
        self._announcements.pop((ann.key, ann.subkey), None)
        if not ann.last_expiration:
            return 0
        expiration = max(ann.last_expiration + 1e-3, self.clock.time() + 1.0)
        record = sign_record(self.identity, ann.key, ann.subkey, b"", expiration)
        return await self._replicate(ann.key, record)

    # ----- lookups -----

    async def _lookup(self, kind: str, target: bytes, k: int, query,
                      enough: Callable[[Lookup], bool] = lambda lookup: False) -> LookupResult:
        self.table.touch(target, self.clock.monotonic())
        lookup = Lookup(target, self.peer_id, k, self.config.alpha, self.config.lookup_patience, query,
                        self._backed_off, self._slow, lambda: enough(lookup))
        for c in self.table.nearest(target, 2 * k):
            lookup.add(c.peer_id, c.address, 1)
        try:
            result = await lookup.run()
        except asyncio.CancelledError:
            self.lookup_stats.ended(kind, "cancelled")
            raise
        except Exception:
            self.lookup_stats.ended(kind, "error")
            raise
        self.lookup_stats.finished(kind, result)
        self.last_lookup = result
        return result

    async def _get_owned(self, key: bytes) -> dict[bytes, Record]:
        future: asyncio.Future[dict[bytes, Record]] = asyncio.get_running_loop().create_future()
        self._gets[key] = future
        try:
            result = await self._get_from_network(key)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                future.cancel()
            else:
                future.set_exception(e)
                future.exception()  # joined waiters re-raise it; mark it retrieved for the owner
            raise
        else:
            future.set_result(result)
            return result
        finally:
            self._gets.pop(key, None)

    async def _get_from_network(self, key: bytes) -> dict[bytes, Record]:
        cfg = self.config
        merged: dict[bytes, Record] = {}
        checked: set[tuple[bytes, float, bytes]] = set()
        replicas = confirmations = 0

        def merge(records: list[Record]) -> None:
            """Fold one replica's records in; count it as a confirmation if it taught us nothing."""
            nonlocal replicas, confirmations
            now = self.clock.time()
            changed = False
            for r in records:
                ident = (r.subkey, r.expiration, r.signature)
                if ident not in checked:
                    try:
                        check_record(r, cfg, now)
                    except RecordRejected as e:
                        log.info("dropping a record for %r from a replica: %s", key, e)
                        continue
                    checked.add(ident)
                held = merged.get(r.subkey)
                if held is None or r.supersedes(held):
                    merged[r.subkey] = r
                    changed = True
            replicas += 1
            confirmations = 0 if changed else confirmations + 1

        width = min(cfg.get_width, cfg.k)

        def enough(lookup: Lookup) -> bool:
            if replicas >= cfg.get_quorum and confirmations >= cfg.get_confirmations:
                return True
            # A miss settles: nothing found, and the closest nodes (where the records would be) said so.
            return not merged and lookup.closest_answered(min(cfg.get_miss_settle, width))

        local = self.storage.get(key, self.clock.time())
        if local:
            merge(local)

        async def query(peer_id: bytes, address: str) -> list[tuple[bytes, str]]:
            reply = await self._call(peer_id, address, P.FIND_VALUE, P.find_value_request(key, width))
            records, contacts = P.parse_find_value_reply(key, reply.meta, cfg)
            if records:
                merge(records)
            return contacts

        await self._lookup("find_value", key_id(key), width, query, enough)
        wall = self.clock.time()
        result = {s: r for s, r in merged.items() if not r.is_tombstone and r.expiration > wall}
        if merged:
            until = min(min(r.expiration for r in merged.values()) - wall, cfg.get_cache_max_s)
            self._cache[key] = (self.clock.monotonic() + until, result)
            self._trim_cache()
        return result

    def _trim_cache(self) -> None:
        now = self.clock.monotonic()
        if len(self._cache) > self.config.max_keys:
            for stale in [k for k, (until, _) in self._cache.items() if until <= now]:
                del self._cache[stale]

    async def _replicate(self, key: bytes, record: Record) -> int:
        """Store `record` on the `replication` closest live nodes (ourselves included if we are one)."""
        kid = key_id(key)
        self._cache.pop(key, None)  # our own write must show in our next get
        nearest = await self.find_nearest(kid, self.config.k)
        own = distance(self.peer_id, kid)
        targets = nearest[: self.config.replication]
        store_here = len(targets) < self.config.replication or own < distance(targets[-1].peer_id, kid)
        if store_here:
            targets = targets[: self.config.replication - 1]
        accepted = 0
        if store_here:
            try:
                self.storage.put(record, self.peer_id, self.clock.time())
                accepted += 1
            except RecordRejected as e:
                log.info("not holding our own record for %r: %s", key, e)

        async def send(contact: Contact) -> None:
            nonlocal accepted
            try:
                reply = await self._call(contact.peer_id, contact.address, P.STORE, P.store_request(key, [record]))
                if P.parse_store_reply(reply.meta, 1) == ["ok"]:
                    accepted += 1
            except (CallFailed, DHTProtocolError) as e:
                log.debug("store to %s failed: %s", contact.address, e)

        async with asyncio.TaskGroup() as tg:
            for c in targets:
                tg.create_task(send(c))
        return accepted

    # ----- calls and liveness -----

    async def _call(self, peer_id: bytes | None, address: str, method: str, meta: dict) -> Reply:
        """One RPC; a failure backs the peer off, an answer refreshes its contact."""
        try:
            reply = await self.network.call(address, method, meta, self.config.rpc_timeout)
        except RemoteFailure:
            raise
        except CallFailed:
            if peer_id is not None:
                self._failed(peer_id)
            raise
        self._saw(reply.peer_id, address)
        if peer_id is not None and reply.peer_id != peer_id:
            self.table.remove(peer_id)
            raise WrongPeer(f"{address} is not the peer we were told about")
        return reply

    def _backed_off(self, peer_id: bytes) -> bool:
        entry = self._backoff.get(peer_id)
        return entry is not None and entry[0] > self.clock.monotonic()

    def _failed(self, peer_id: bytes) -> None:
        self.table.failed(peer_id)
        _, failures = self._backoff.pop(peer_id, (0.0, 0))
        delay = min(self.config.backoff_initial * 2 ** failures, self.config.backoff_max)
        self._backoff[peer_id] = (self.clock.monotonic() + delay, failures + 1)
        while len(self._backoff) > self.config.max_backoff_entries:
            self._backoff.popitem(last=False)

    def _slow(self, peer_id: bytes) -> None:
        """A query outlived the lookup's patience and was abandoned: skip the peer in lookups for
        a while, without counting a routing-table failure (it may only be far away)."""
        if not self._backed_off(peer_id):
            self._backoff[peer_id] = (self.clock.monotonic() + self.config.backoff_initial, 0)
            while len(self._backoff) > self.config.max_backoff_entries:
                self._backoff.popitem(last=False)

    def _saw(self, peer_id: bytes, address: str) -> None:
        self._backoff.pop(peer_id, None)
        if self.table.seen(peer_id, address, self.clock.monotonic()):
            self._plan_handoffs(peer_id, address)

    def _plan_handoffs(self, peer_id: bytes, address: str) -> None:
        """Queue the keys a newly seen node should now hold, when we are their closest holder.

        Only the closest current holder hands over, so one join does not trigger k copies."""
        for key in self.storage.keys():
            kid = key_id(key)
            own = distance(self.peer_id, kid)
            if distance(peer_id, kid) >= own:
                continue
            others = [c for c in self.table.nearest(kid, self.config.k) if c.peer_id != peer_id]
            if others and distance(others[0].peer_id, kid) < own:
                continue
            try:
                self._handoffs.put_nowait((peer_id, address, key))
            except asyncio.QueueFull:
                return

    # ----- serving -----

    async def _handle(self, caller: Caller, method: str, meta: object) -> dict:
        """Answer one request; malformed payloads raise DHTProtocolError (-> "bad_request")."""
        cfg = self.config
        if method == P.PING:
            reply: dict = {}
        elif method == P.FIND_NODE:
            target = P.parse_find_node(meta, cfg)
            reply = P.contacts_reply(self.table.nearest(target, P.parse_wanted(meta, cfg), include_failing=False))
        elif method == P.FIND_VALUE:
            key = P.parse_find_value(meta, cfg)
            records = self.storage.sample(key, self.clock.time(), cfg.max_message_record_bytes, P.record_wire_bytes)
            nearest = self.table.nearest(key_id(key), P.parse_wanted(meta, cfg), include_failing=False)
            reply = P.find_value_reply(records, nearest)
        elif method == P.STORE:
            key, records = P.parse_store(meta, cfg)
            source = source_of(caller.source, cfg)
            reply = P.store_reply([self._accept(r, caller.peer_id, source) for r in records])
        else:
            raise DHTProtocolError(f"unknown method {method!r}")
        if caller.address is not None:
            self._saw(caller.peer_id, caller.address)
        return reply

    def _accept(self, record: Record, sender: bytes, source: str) -> str:
        try:
            self.storage.put(record, sender, self.clock.time(), source)
        except RecordRejected as e:
            self.refused_records[e.reason] = self.refused_records.get(e.reason, 0) + 1
            if e.reason in FORGERY_REASONS:
                self._report_forger(sender, record, e)
            return e.reason
        return "ok"

    def _report_forger(self, sender: bytes, record: Record, error: RecordRejected) -> None:
        """Name a peer that stored a record it could not have signed honestly: once per sender
        among the last FORGERS_REMEMBERED, so a forger cannot flood the log either."""
        if sender in self.forgers:
            self.forgers.move_to_end(sender)
            return
        self.forgers[sender] = None
        while len(self.forgers) > FORGERS_REMEMBERED:
            self.forgers.popitem(last=False)
        log.warning("peer %s stored a forged record (%s) under subkey %s of %r; refused", sender.hex(),
                    error, record.subkey.hex()[:64], record.key[:64])

    # ----- background work -----

    async def _prune_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.prune_interval)
            self.storage.prune(self.clock.time())

    async def _announce_loop(self) -> None:
        while True:
            now = self.clock.monotonic()
            due = [a for a in self._announcements.values() if a.next_due <= now]
            if due:
                async with asyncio.TaskGroup() as tg:
                    for ann in due:
                        tg.create_task(self._announce_once(ann))
                continue
            wait = min((a.next_due for a in self._announcements.values()), default=now + 3600.0) - now
            self._announce_wake.clear()
            try:
                async with asyncio.timeout(wait):
                    await self._announce_wake.wait()
            except TimeoutError:
                pass

    async def _announce_once(self, ann: Announcement) -> None:
        cfg = self.config
        ann.next_due = self.clock.monotonic() + cfg.refresh_interval
        try:
            value = ann.value_fn()
        except Exception as exc:  # noqa: BLE001 - the caller's bug must not stop our other announcements
            self._value_fn_failed(ann, exc)
            return
        if self.supervisor is not None:
            self.supervisor.recovered(_value_task(ann))
        try:
            if not isinstance(value, bytes) or not value:
                raise DHTUsageError("an announcement's value_fn returns non-empty bytes")
            expiration = self.clock.time() + ann.ttl
            record = sign_record(self.identity, ann.key, ann.subkey, value, expiration)
            check_record(record, cfg, self.clock.time())
        except (DHTUsageError, RecordRejected) as e:
            log.error("announcement under %r skipped: %s", ann.key, e)
            return
        ann.last_expiration = expiration  # before storing, so a concurrent withdraw outlives it
        accepted = await self._replicate(ann.key, record)
        if not accepted and not ann.withdrawn:  # isolated: try again soon rather than a whole period later
            ann.next_due = self.clock.monotonic() + cfg.rebootstrap_interval

    def _value_fn_failed(self, ann: Announcement, exc: Exception) -> None:
        """Logged with its traceback and, under a supervisor, shown in its faults (`swarmctl
        status`): the announcement is missing from the DHT until its value_fn is fixed."""
        if self.supervisor is None:
            log.error("value_fn of the announcement under %r failed; retrying next period", ann.key, exc_info=exc)
        else:
            self.supervisor.record(_value_task(ann), exc, self.config.refresh_interval)

    async def _maintenance_loop(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.rebootstrap_interval)
            live = any(c.failures < cfg.max_failures for c in self.table.contacts())
            if not live and self._bootstrap_addrs:
                log.info("no live contacts left: bootstrapping again")
                await self.bootstrap(self._bootstrap_addrs)
                continue
            quiet = self.table.quiet_buckets(self.clock.monotonic())
            if quiet:
                await self.find_nearest(self._rng.choice(quiet).random_id(self._rng))

    async def _handoff_loop(self) -> None:
        while True:
            peer_id, address, key = await self._handoffs.get()
            for chunk in P.store_batches(self.storage.get(key, self.clock.time()), self.config):
                try:
                    await self._call(peer_id, address, P.STORE, P.store_request(key, chunk))
                except (CallFailed, DHTProtocolError) as e:
                    log.debug("hand-off of %r to %s failed: %s", key, address, e)
                    break
