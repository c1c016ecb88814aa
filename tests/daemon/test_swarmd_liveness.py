"""PeerBook and the ping loop: alive while the last answer is inside the window, bounded memory."""

from __future__ import annotations

import asyncio

import pytest
from waiting import until

from swarmd.dht.errors import PeerTimeout
from swarmd.liveness import PeerBook, ping_loop
from swarmd.supervisor import Backoff, Supervisor
from transport.errors import ConnectionLost

A, B, C = b"a" * 32, b"b" * 32, b"c" * 32


def test_alive_only_inside_the_window() -> None:
    book = PeerBook(window_s=5.0, max_peers=10)
    book.heard(A, "h:1", now=100.0)
    assert book.alive(A, 105.0) and not book.alive(A, 105.1)
    assert not book.alive(B, 100.0)


def test_view_merges_contacts_never_heard_from() -> None:
    book = PeerBook(window_s=5.0, max_peers=10)
    book.heard(A, "h:1", now=100.0)
    book.heard(B, "h:2", now=90.0)
    view = book.view([(A, "h:1"), (C, "h:3")], now=101.0)
    assert [(e["peer_id"], e["alive"], e["last_seen_s_ago"]) for e in view] == [
        (A.hex(), True, 1.0), (B.hex(), False, 11.0), (C.hex(), False, None)]


def test_book_is_bounded_and_forgets_the_oldest_first() -> None:
    book = PeerBook(window_s=5.0, max_peers=2)
    for i, peer in enumerate((A, B, C)):
        book.heard(peer, f"h:{i}", now=float(i))
    assert not book.alive(A, 2.0) and book.alive(B, 2.0) and book.alive(C, 2.0)
    assert len(book.view([], 2.0)) == 2


async def test_ping_loop_records_the_proven_id_and_skips_failures() -> None:
    """Two contacts: one answers (proving id B although listed as A), one times out."""
    book = PeerBook(window_s=5.0, max_peers=10)
    results: list[bool] = []

    async def ping(address: str) -> bytes:
        if address == "slow:1":
            await asyncio.sleep(10)
        return B

    task = asyncio.create_task(ping_loop(
        book, lambda: [(A, "fast:1"), (C, "slow:1")], ping, interval_s=0.01, timeout_s=0.05, sample=8,
        clock=lambda: 50.0, on_result=results.append))
    await until(lambda: True in results and False in results and book.alive(B, 50.0), 10,
                "a good answer and a failed ping")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert book.alive(B, 50.0) and not book.alive(A, 50.0) and not book.alive(C, 50.0)
    assert True in results and False in results


async def test_each_round_pings_a_bounded_sample_and_every_contact_in_turn() -> None:
    """20 contacts, a sample of 8: every round pings at most 8 (a daemon's ping traffic does not grow
    with the swarm), those pinged longest ago first, so 3 rounds reach all 20 and none twice."""
    contacts = [(bytes([i]) * 32, f"h:{i}") for i in range(20)]
    log: list[str | None] = []  # None marks the start of a round, then the addresses it pinged

    def listing() -> list[tuple[bytes, str]]:
        log.append(None)
        return contacts

    async def ping(address: str) -> bytes:
        log.append(address)
        return dict((a, p) for p, a in contacts)[address]

    book = PeerBook(window_s=5.0, max_peers=100)
    task = asyncio.create_task(ping_loop(book, listing, ping, interval_s=0.001, timeout_s=1.0, sample=8,
                                         clock=lambda: 50.0))
    await until(lambda: log.count(None) >= 5, 10, "four full rounds")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    rounds: list[list[str]] = []
    for entry in log:
        if entry is None:
            rounds.append([])
        else:
            rounds[-1].append(entry)
    assert [len(r) for r in rounds[:4]] == [8, 8, 8, 8]
    first_three = rounds[0] + rounds[1] + rounds[2]
    assert sorted(set(first_three)) == sorted(a for _, a in contacts)  # all 20 reached ...
    assert len(first_three) == 24 and set(rounds[2][4:]) <= set(rounds[0])  # ... before any twice


@pytest.mark.parametrize("failure", [PeerTimeout("no answer"), ConnectionLost("reset"), ConnectionRefusedError()])
async def test_a_ping_that_found_no_peer_is_not_heard_from(failure: Exception) -> None:
    """The expected failures of a ping (the DHT call's, the transport's, the socket's) mark the
    peer as not heard from, and the loop goes on."""
    results: list[bool] = []

    async def ping(address: str) -> bytes:
        raise failure

    task = asyncio.create_task(ping_loop(PeerBook(5.0, 10), lambda: [(A, "a:1")], ping, interval_s=0.001,
                                         timeout_s=1.0, sample=8, clock=lambda: 50.0, on_result=results.append))
    await until(lambda: results.count(False) >= 3, 10, "three failed rounds")
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_unexpected_ping_error_reaches_the_supervisor_and_its_faults() -> None:
    """A bug in the ping (here a KeyError) is no "not heard from": it ends the loop, and the
    Supervisor the daemon runs it under records it (shown by `swarmctl status`) and restarts it."""
    calls: list[str] = []

    async def ping(address: str) -> bytes:
        calls.append(address)
        raise KeyError("a bug")

    supervisor = Supervisor("liveness", backoff=Backoff(initial_s=0.01, max_s=0.01))
    task = asyncio.create_task(supervisor.run("ping peers", lambda: ping_loop(
        PeerBook(5.0, 10), lambda: [(A, "a:1")], ping, interval_s=0.001, timeout_s=1.0, sample=8,
        clock=lambda: 50.0)))
    await until(lambda: (fault := supervisor.faults.get("liveness: ping peers")) is not None and fault.restarts >= 2,
                10, "two restarts")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "KeyError" in supervisor.faults.get("liveness: ping peers").last_error
