"""Which peers are alive: the last time each one proved it, and a loop that keeps asking.

Kademlia only learns that a contact died when it next talks to it, which on a quiet swarm can be
minutes. Operators asking `swarmctl peers` want to know now, so the daemon pings routing-table
contacts each `ping_interval_s` and calls a peer alive while its last answer is younger than
`liveness_window_s`. Each interval pings at most `ping_sample` contacts, those tried longest ago
first (never tried before all others), so every contact is pinged once per ceil(contacts /
ping_sample) intervals and a daemon's ping traffic stays the same however large the swarm (pinging
every contact made each daemon's control traffic grow with the swarm). Keep `liveness_window_s`
above `ping_interval_s` x ceil(contacts / ping_sample), or a live peer may show dead between pings.
The answer's peer id comes from the connection's handshake, so a host that took over a dead peer's
address does not keep that peer "alive".
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable

from swarmd.dht.errors import CallFailed
from transport.errors import TransportError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sighting:
    address: str
    at: float  # monotonic seconds


class PeerBook:
    """Last sighting per peer id, bounded: the oldest sightings go first when it is full."""

    def __init__(self, window_s: float, max_peers: int) -> None:
        self.window_s = window_s
        self.max_peers = max_peers
        self._seen: OrderedDict[bytes, Sighting] = OrderedDict()

    def heard(self, peer_id: bytes, address: str, now: float) -> None:
        self._seen.pop(peer_id, None)
        self._seen[peer_id] = Sighting(address, now)
        while len(self._seen) > self.max_peers:
            self._seen.popitem(last=False)

    def alive(self, peer_id: bytes, now: float) -> bool:
        seen = self._seen.get(peer_id)
        return seen is not None and now - seen.at <= self.window_s

    def count_alive(self, now: float) -> int:
        return sum(now - s.at <= self.window_s for s in self._seen.values())

    def view(self, known: Iterable[tuple[bytes, str]], now: float) -> list[dict]:
        """One entry per peer known to the routing table or heard from, newest sighting first."""
        entries: dict[bytes, dict] = {}
        for peer_id, address in known:
            entries[peer_id] = {"peer_id": peer_id.hex(), "address": address, "last_seen_s_ago": None,
                                "alive": False, "self": False}
        for peer_id, seen in self._seen.items():
            entries[peer_id] = {"peer_id": peer_id.hex(), "address": seen.address,
                                "last_seen_s_ago": round(now - seen.at, 3),
                                "alive": now - seen.at <= self.window_s, "self": False}
        ordered = sorted(entries.values(), key=lambda e: (e["last_seen_s_ago"] is None, e["last_seen_s_ago"] or 0))
        return ordered[: self.max_peers]


Ping = Callable[[str], Awaitable[bytes]]
"""Ping an address; returns the peer id the connection proved, raises one of `PING_FAILURES` when
the peer did not answer."""

#: What a ping that found no live peer raises: the DHT call's failure (`dht.network.call`), a
#: transport error or OSError that reached us unwrapped, our own timeout. Anything else is a bug in
#: the ping or the loop and goes to the loop's owner (the daemon runs it under a `Supervisor`).
PING_FAILURES = (CallFailed, TransportError, TimeoutError, OSError)


async def ping_loop(
    book: PeerBook,
    contacts: Callable[[], list[tuple[bytes, str]]],
    ping: Ping,
    *,
    interval_s: float,
    timeout_s: float,
    sample: int,
    clock: Callable[[], float],
    on_result: Callable[[bool], None] = lambda ok: None,
) -> None:
    """Forever: ping the `sample` known contacts tried longest ago at once, each bounded by
    `timeout_s`, then wait. A failed ping means "not heard from" (its reason only logged at debug:
    dead peers are common); an unexpected error ends the loop, so its owner shows it."""

    async def one(address: str) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                peer_id = await ping(address)
        except PING_FAILURES as exc:
            log.debug("ping %s: %s", address, exc)
            on_result(False)
            return
        book.heard(peer_id, address, clock())
        on_result(True)

    tried: dict[str, int] = {}  # address -> the round it was last pinged in; only current contacts
    rounds = 0
    while True:
        known = list(dict.fromkeys(address for _, address in contacts()[: book.max_peers]))
        tried = {address: tried[address] for address in known if address in tried}
        targets = sorted(known, key=lambda address: tried.get(address, -1))[:sample]
        rounds += 1
        for address in targets:
            tried[address] = rounds
        async with asyncio.TaskGroup() as tg:
            for address in targets:
                tg.create_task(one(address))
        await asyncio.sleep(interval_s)
