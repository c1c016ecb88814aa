"""The load gossip over real loopback sockets: every peer is its own RpcServer and Pool in this process.

Periods are shortened to ~0.1 s so a dozen rounds take about a second; what is asserted is counted in
rounds and refusals, never in wall-clock speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from waiting import until

from swarmd.directory import StagePeer, StaticDirectory
from swarmd.errors import ConfigError
from swarmd.rebalance.gossip import METHOD, GossipConfig, GossipService, GossipStopped, OwnLoad, TokenBuckets
from swarmd.rebalance.view import LoadEntry, ViewLimits, decode_entries, encode_entries
from transport.errors import ConnectionLost, RemoteError
from transport.identity import Identity
from transport.rpc import Message, Pool, Router, RpcConfig, RpcServer

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]
JOB = bytes(range(32))
STAGES = 3
FAST = GossipConfig(period_s=0.1, jitter=0.2, fanout=3, call_timeout_s=0.5, backoff_base_s=0.5,
                    backoff_max_s=2.0, inbound_rate_per_s=100.0, inbound_burst=20.0, members_ttl_s=0.2)


@dataclasses.dataclass
class Peer:
    identity: Identity
    server: RpcServer
    pool: Pool
    service: GossipService | None
    stage: int

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.server.port}"


@contextlib.asynccontextmanager
async def swarm(n: int, config: GossipConfig = FAST, *, extra_members: list[StagePeer] = ()):
    """n gossiping peers on stages i % STAGES, all listed in one directory (plus `extra_members`)."""
    directory = StaticDirectory()
    peers: list[Peer] = []
    try:
        for i in range(n):
            identity = Identity.from_seed(b"gossip-peer-%d" % i)
            rpc = RpcConfig(identity=identity)
            router = Router()
            server = await RpcServer.serve_tcp(router, config=rpc)
            pool = Pool(rpc)
            stage = i % STAGES
            service = GossipService(JOB, STAGES, identity, lambda i=i, s=stage: OwnLoad(s, 1.0 + i, i, "serving"),
                                    router, pool, directory, config)
            peers.append(Peer(identity, server, pool, service, stage))
        for stage in range(STAGES):
            listed = [StagePeer(p.identity.peer_id, p.addr, p.stage) for p in peers if p.stage == stage]
            directory.set(JOB, stage, listed + [m for m in extra_members if m.stage == stage])
        for p in peers:
            await p.service.start()
        yield peers, directory
    finally:
        for p in peers:
            await p.service.stop()
        for p in peers:
            await p.pool.close()
            await p.server.close()


@contextlib.asynccontextmanager
async def client(seed: bytes):
    """A bare peer with its own identity and pool, to speak the protocol by hand (hostile or not)."""
    identity = Identity.from_seed(seed)
    pool = Pool(RpcConfig(identity=identity))
    try:
        yield identity, pool
    finally:
        await pool.close()


def payload(data: bytes) -> list[torch.Tensor]:
    return [torch.frombuffer(bytearray(data), dtype=torch.uint8)]


def exchange_message(data: bytes, job: bytes = JOB) -> Message:
    return Message({"job": job}, payload(data), codec="none")


def reply_entries(reply: Message) -> list[LoadEntry]:
    return decode_entries(reply.tensors[0].numpy().tobytes())


async def wait_full(peers: list[Peer], expected: set[bytes], timeout: float = 15.0) -> list[int]:
    """Poll until every view holds exactly `expected`; returns the rounds each peer completed meanwhile
    (peers start one by one, so rounds done before the last one was up are not counted)."""
    before = [p.service.stats.rounds for p in peers]
    views: list[set[bytes]] = []

    async def full() -> bool:
        views[:] = [{e.peer_id for e in await p.service.entries()} for p in peers]
        return all(v == expected for v in views)

    await until(full, timeout, "a full view", detail=lambda: f"sizes {[len(v) for v in views]}")
    return [p.service.stats.rounds - b for p, b in zip(peers, before)]


async def test_ten_peers_converge_to_a_full_view_within_a_few_rounds():
    """10 peers start knowing only themselves; push-pull with fanout 3 fills every view in a few rounds,
    and the table built from a full view sums every stage's peers."""
    async with swarm(10) as (peers, _):
        everyone = {p.identity.peer_id for p in peers}
        rounds = await wait_full(peers, everyone)
        print(f"\n10 peers converged after at most {max(rounds)} rounds (per peer: {rounds})")
        assert max(rounds) <= 5
        table = await peers[0].service.table()
        for stage in range(STAGES):
            assert table.serving[stage] == pytest.approx(sum(1.0 + i for i in range(10) if i % STAGES == stage))
        assert all(not p.service.stats.rejected for p in peers), [p.service.stats.rejected for p in peers]


async def wait_rounds(peers: list[Peer], rounds: int, timeout: float = 60.0) -> None:
    """Until every peer has completed `rounds` more gossip rounds."""
    target = [p.service.stats.rounds + rounds for p in peers]
    await until(lambda: all(p.service.stats.rounds >= t for p, t in zip(peers, target)), timeout,
                f"{rounds} more rounds on every peer", interval=0.05)


def dials_allowed(config: GossipConfig, elapsed_s: float) -> int:
    """The most failed dials of one partner that backoff permits in `elapsed_s`: the first at once, the
    k-th after waiting backoff_base_s * 2^(k-2), capped at backoff_max_s (call timeouts only add to
    the gaps, so leaving them out keeps this an upper bound). A loaded machine stretches the test, so
    the bound follows the time taken; without backoff a partner is dialled every round instead."""
    dials, waited = 1, 0.0
    while True:
        waited += min(config.backoff_max_s, config.backoff_base_s * 2 ** (dials - 1))
        if waited > elapsed_s:
            return dials
        dials += 1


async def test_a_peer_that_never_answers_does_not_stall_the_others_and_is_backed_off():
    """A member whose listener accepts TCP and never says a word: every exchange with it times out.
    The 8 live peers still converge within a few rounds, and backoff keeps each from dialling it
    more than a few times."""
    held: list[asyncio.StreamWriter] = []

    async def accept_and_ignore(reader, writer):
        held.append(writer)

    silent = await asyncio.start_server(accept_and_ignore, "127.0.0.1", 0)
    silent_addr = "127.0.0.1:%d" % silent.sockets[0].getsockname()[1]
    silent_member = StagePeer(Identity.from_seed(b"silent").peer_id, silent_addr, 1)
    config = dataclasses.replace(FAST, fanout=2, call_timeout_s=0.3, backoff_base_s=1.0, backoff_max_s=4.0)
    started = time.monotonic()
    try:
        async with swarm(8, config, extra_members=[silent_member]) as (peers, _):
            rounds = await wait_full(peers, {p.identity.peer_id for p in peers})
            print(f"\n8 peers + 1 silent member converged after at most {max(rounds)} rounds (per peer: {rounds})")
            assert max(rounds) <= 6
            # Let 30 more rounds run (~3 s): dialled every round it is picked (2 of 8 partners), the
            # silent member would fail about 7 times per peer; backoff allows 3 in that time.
            await wait_rounds(peers, 30)
            failures = [p.service.stats.exchanges_failed for p in peers]
            assert sum(failures) >= 1 and held, "nobody even tried the silent member"
            # Failed exchanges with the silent member only: those with live peers (a 0.3 s timeout on a
            # loaded machine) are no concern of this test. The backoff's own count is read for that.
            allowed = dials_allowed(config, time.monotonic() - started)
            to_silent = [p.service._failures.get(silent_member.peer_id, 0) for p in peers]
            assert max(to_silent) <= allowed, f"silent member not backed off: failures per peer {to_silent}"
            assert all(p.service.stats.exchanges_ok > 0 for p in peers)
    finally:
        for writer in held:
            writer.close()
        silent.close()
        await silent.wait_closed()


async def test_a_forged_entry_sent_over_the_wire_is_rejected_and_counted():
    """A hostile member pushes an entry carrying the victim's public key but signed with its own key,
    newer than the victim's real one. The target refuses it ("bad signature"), counts it, and keeps
    the victim's genuine entry; the hostile caller still gets an answer (it broke no format)."""
    async with swarm(3) as (peers, _):
        await wait_full(peers, {p.identity.peer_id for p in peers})
        target, victim = peers[0], peers[1]
        async with client(b"gossip-peer-2") as (hostile, pool):  # a member's own key: peer 2 turned hostile
            honest = LoadEntry.create(hostile, JOB.hex(), 0, 999.0, 0, "serving", time.time() + 1.0)
            forged = dataclasses.replace(honest, public_key=victim.identity.public_key)
            assert forged.peer_id == victim.identity.peer_id and not forged.verify()
            reply = await pool.call(target.addr, METHOD, exchange_message(encode_entries([forged])), timeout=2.0)
            assert victim.identity.peer_id in {e.peer_id for e in reply_entries(reply)}
        assert target.service.stats.rejected["bad signature"] == 1
        held = {e.peer_id: e for e in await target.service.entries()}[victim.identity.peer_id]
        assert held.samples_per_s == 2.0 and held.verify()


FROZEN_PEER = r"""
import asyncio, sys
import torch
from swarmd.directory import StagePeer, StaticDirectory
from swarmd.rebalance.gossip import GossipConfig, GossipService, OwnLoad
from transport.identity import Identity
from transport.rpc import Pool, Router, RpcConfig, RpcServer

torch.set_num_threads(1)

async def main(job, seed, stage, members):
    identity = Identity.from_seed(seed)
    rpc = RpcConfig(identity=identity)
    router = Router()
    server = await RpcServer.serve_tcp(router, config=rpc)
    rows = [m.split("@") for m in members] + [[identity.peer_id.hex(), f"127.0.0.1:{server.port}", str(stage)]]
    directory = StaticDirectory()
    for s in range(3):
        directory.set(job, s, [StagePeer(bytes.fromhex(p), a, int(t)) for p, a, t in rows if int(t) == s])
    config = GossipConfig(period_s=0.1, call_timeout_s=0.5, inbound_rate_per_s=100.0, inbound_burst=20.0,
                          members_ttl_s=0.2)
    service = GossipService(job, 3, identity, lambda: OwnLoad(stage, 7.0, 0, "serving"), router, Pool(rpc),
                            directory, config)
    await service.start()
    print(server.port, flush=True)
    await asyncio.Event().wait()

asyncio.run(main(bytes.fromhex(sys.argv[1]), sys.argv[2].encode(), int(sys.argv[3]), sys.argv[4:]))
"""


@pytest.mark.slow
async def test_a_peer_frozen_by_sigstop_mid_gossip_does_not_stall_the_others():
    """Steps: 6 in-process peers and one peer in its own process gossip until all 7 views are full; then
    SIGSTOP that process (its connections stay open; it just never answers again). Expected: the 6 keep
    completing rounds and exchanges among themselves, and their calls to the frozen peer time out and
    are backed off (a few failures per peer, not one per round)."""
    config = dataclasses.replace(FAST, fanout=2, call_timeout_s=0.3, backoff_base_s=1.0, backoff_max_s=4.0)
    async with swarm(6, config) as (peers, directory):
        members = [f"{p.identity.peer_id.hex()}@{p.addr}@{p.stage}" for p in peers]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", FROZEN_PEER, JOB.hex(), "frozen", "1", *members,
            stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
        try:
            port = int(await asyncio.wait_for(proc.stdout.readline(), 60))
            frozen = Identity.from_seed(b"frozen").peer_id
            stage_1 = [StagePeer(p.identity.peer_id, p.addr, 1) for p in peers if p.stage == 1]
            directory.set(JOB, 1, stage_1 + [StagePeer(frozen, f"127.0.0.1:{port}", 1)])
            await wait_full(peers, {p.identity.peer_id for p in peers} | {frozen})
            proc.send_signal(signal.SIGSTOP)
            before = [(p.service.stats.rounds, p.service.stats.exchanges_ok, p.service.stats.exchanges_failed)
                      for p in peers]

            def progress() -> list[tuple[int, int, int]]:
                return [(p.service.stats.rounds - r, p.service.stats.exchanges_ok - ok,
                         p.service.stats.exchanges_failed - failed) for p, (r, ok, failed) in zip(peers, before)]

            def went_on() -> bool:
                now = progress()
                return all(rounds >= 3 and ok >= 4 for rounds, ok, _ in now) and sum(f for *_, f in now) >= 1

            await until(went_on, 15, "every peer to gossip on past the frozen one")
            print(f"\nwhile frozen, per peer (rounds, ok, failed): {progress()}")
            assert all(failed <= 3 for _, _, failed in progress())
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            await proc.wait()


async def test_stop_during_a_round_waiting_on_a_silent_partner_returns_at_once_and_leaks_no_task():
    """A round is stuck on a partner that accepted TCP and never speaks (call timeout 30 s). stop()
    cancels the round at that await: it returns well before the timeout and leaves no gossip task."""
    held: list[asyncio.StreamWriter] = []
    silent = await asyncio.start_server(lambda r, w: held.append(w), "127.0.0.1", 0)
    silent_member = StagePeer(Identity.from_seed(b"silent").peer_id,
                              "127.0.0.1:%d" % silent.sockets[0].getsockname()[1], 0)
    config = dataclasses.replace(FAST, fanout=5, call_timeout_s=30.0)
    try:
        async with swarm(2, config, extra_members=[silent_member]) as (peers, _):
            await until(lambda: len(held) >= 2, 30, "both peers to dial the silent partner", interval=0.01)
            started = time.monotonic()
            for p in peers:
                await p.service.stop()
            assert time.monotonic() - started < 2.0
            assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("gossip")]
    finally:
        for writer in held:
            writer.close()
        silent.close()
        await silent.wait_closed()


async def test_forged_or_malformed_replies_from_a_hostile_partner_are_refused_and_it_is_backed_off():
    """A hostile member answers every exchange: first with a forged entry for a real peer (signed by its
    own key), then with garbage. The honest peers reject the forgery ("bad signature"), count the
    garbage as a failed exchange, back the hostile partner off, and still converge among themselves."""
    hostile = Identity.from_seed(b"hostile-server")
    answers: list[bytes] = []

    async def lie(request):
        victim = Identity.from_seed(b"gossip-peer-0")
        honest = LoadEntry.create(hostile, JOB.hex(), 0, 999.0, 0, "serving", time.time() + 1.0)
        forged = dataclasses.replace(honest, public_key=victim.public_key)
        answers.append(b"forged" if not answers else b"garbage")
        data = encode_entries([forged]) if len(answers) == 1 else b"\xc1garbage"
        return exchange_message(data)

    router = Router()
    router.unary(METHOD, lie)
    server = await RpcServer.serve_tcp(router, config=RpcConfig(identity=hostile))
    member = StagePeer(hostile.peer_id, f"127.0.0.1:{server.port}", 0)
    config = dataclasses.replace(FAST, fanout=3, backoff_base_s=5.0, backoff_max_s=5.0)
    try:
        async with swarm(3, config, extra_members=[member]) as (peers, _):
            await wait_full(peers, {p.identity.peer_id for p in peers})
            await until(lambda: len(answers) >= 2, 5, "the hostile partner to be called twice")
            # Its callers merged the forgery and counted the garbage, not merely sent their calls.
            await until(lambda: sum(p.service.stats.rejected["bad signature"] for p in peers) >= 1
                        and sum(p.service.stats.exchanges_failed for p in peers) >= 1, 5,
                        "the forgery refused and the garbage counted as a failed exchange")
            await asyncio.sleep(0.3)  # a window in which nothing may happen: no backed-off caller dials the liar
            assert sum(p.service.stats.rejected["bad signature"] for p in peers) == 1
            assert sum(p.service.stats.exchanges_failed for p in peers) >= 1
            assert len(answers) <= 3  # every caller refused by a lie backs the liar off for 5 s
            for p in peers:
                held = {e.peer_id: e for e in await p.service.entries()}[peers[0].identity.peer_id]
                assert held.samples_per_s == 1.0 and held.verify()
    finally:
        await server.close()


async def test_a_non_members_entries_are_refused_whether_it_calls_or_a_member_relays_them():
    """An outsider with a valid key but absent from the directory pushes its own signed entry; then a
    member relays the same entry. Both times the target refuses it ("not a member")."""
    async with swarm(3) as (peers, _):
        target = peers[0]
        async with client(b"outsider") as (outsider, pool):
            own = LoadEntry.create(outsider, JOB.hex(), 0, 5.0, 0, "serving", time.time())
            await pool.call(target.addr, METHOD, exchange_message(encode_entries([own])), timeout=2.0)
        async with client(b"gossip-peer-1") as (_, pool):
            await pool.call(target.addr, METHOD, exchange_message(encode_entries([own])), timeout=2.0)
        assert target.service.stats.rejected["not a member"] == 2
        assert outsider.peer_id not in {e.peer_id for e in await target.service.entries()}


@pytest.mark.parametrize("name, message", [
    ("not msgpack", exchange_message(b"\xc1\xc1\xc1")),
    ("wrong shape of rows", exchange_message(encode_entries([])[:0] + b"\x91\x93\x01\x02\x03")),
    ("oversized", exchange_message(b"\x90" + bytes(80 * 1024))),
    ("no payload", Message({"job": JOB}, codec="none")),
    ("float payload", Message({"job": JOB}, [torch.zeros(8)], codec="none")),
    ("two payloads", Message({"job": JOB}, payload(b"\x90") * 2, codec="none")),
    ("another job", exchange_message(b"\x90", job=b"\x00" * 32)),
    ("meta without job", Message({}, payload(b"\x90"), codec="none")),
])
async def test_a_malformed_exchange_gets_bad_request_and_the_server_keeps_serving(name, message):
    """Each malformed exchange is refused with the typed code `bad_request` (the oversized one against
    a 64 KiB batch limit, before parsing); the same connection then completes a valid exchange."""
    config = dataclasses.replace(FAST, limits=ViewLimits(max_encoded_bytes=64 * 1024))
    async with swarm(2, config) as (peers, _):
        target = peers[0]
        async with client(b"gossip-peer-1") as (_, pool):
            with pytest.raises(RemoteError) as caught:
                await pool.call(target.addr, METHOD, message, timeout=2.0)
            assert caught.value.code == "bad_request", name
            reply = await pool.call(target.addr, METHOD, exchange_message(encode_entries([])), timeout=2.0)
            assert target.identity.peer_id in {e.peer_id for e in reply_entries(reply)}
        assert target.service.stats.refused == {"bad_request": 1}


async def test_a_flood_from_one_peer_is_rate_limited_while_others_still_exchange():
    """One caller fires 40 exchanges at once at a target allowing a burst of 5 at 5/s per caller: most
    are refused `rate_limited`. Meanwhile another caller's exchanges all succeed (its bucket is its own),
    and so do the target's gossip rounds with its members."""
    config = dataclasses.replace(FAST, period_s=0.5, inbound_rate_per_s=5.0, inbound_burst=5.0)
    async with swarm(3, config) as (peers, _):
        target = peers[0]
        empty = exchange_message(encode_entries([]))
        async with client(b"flooder") as (_, flooder), client(b"bystander") as (_, other):
            async def one(pool: Pool) -> str:
                try:
                    await pool.call(target.addr, METHOD, empty, timeout=2.0)
                except RemoteError as exc:
                    return exc.code
                return "ok"

            flood = asyncio.gather(*(one(flooder) for _ in range(40)))
            others = [await one(other) for _ in range(3)]
            outcomes = await flood
        print(f"\nflood outcomes: {outcomes.count('ok')} ok, {outcomes.count('rate_limited')} rate_limited")
        assert others == ["ok"] * 3
        assert outcomes.count("rate_limited") >= 30 and outcomes.count("ok") >= 5
        assert set(outcomes) == {"ok", "rate_limited"}
        # Every refusal went to the flooder: the members' own rounds with the target were never limited.
        assert target.service.stats.refused["rate_limited"] == outcomes.count("rate_limited")


async def test_a_stopped_service_refuses_exchanges_as_unavailable():
    async with swarm(2) as (peers, _):
        await peers[0].service.stop()
        async with client(b"gossip-peer-1") as (_, pool):
            with pytest.raises(RemoteError) as caught:
                await pool.call(peers[0].addr, METHOD, exchange_message(b"\x90"), timeout=2.0)
        assert caught.value.code == "unavailable"


def test_token_bucket_refills_at_its_rate_and_forgets_the_least_recent_caller():
    buckets = TokenBuckets(rate_per_s=2.0, burst=2.0, max_callers=2)
    assert [buckets.admit(b"a", 0.0) for _ in range(3)] == [True, True, False]
    assert not buckets.admit(b"a", 0.25) and buckets.admit(b"a", 0.75)
    buckets.admit(b"b", 1.0)
    buckets.admit(b"c", 1.0)  # evicts "a", the least recently seen
    assert [buckets.admit(b"a", 1.0) for _ in range(3)] == [True, True, False]


def test_config_refuses_settings_that_cannot_work():
    for bad in ({"period_s": 0}, {"jitter": 1.0}, {"fanout": 0}, {"inbound_burst": 0.5},
                {"backoff_base_s": 10.0, "backoff_max_s": 5.0}, {"call_timeout_s": -1}):
        with pytest.raises(ValueError):
            GossipConfig(**bad)


async def test_a_peer_dropped_from_the_directory_is_no_longer_dialled_and_its_entries_are_refused():
    """Steps: 4 peers converge; peer 3 is withdrawn from the directory (as when its DHT announcement
    lapses). Expected: after one members refresh nobody calls it any more, and its own pushes to the
    others are refused as "not a member"."""
    async with swarm(4) as (peers, directory):
        await wait_full(peers, {p.identity.peer_id for p in peers})
        gone = peers[3]
        directory.set(JOB, gone.stage, [StagePeer(p.identity.peer_id, p.addr, p.stage) for p in peers[:3]
                                         if p.stage == gone.stage])
        # A peer refreshes its members at the start of a round, after its previous round's calls ended:
        # once none of the others lists it, no call to it is in flight.
        await until(lambda: all(gone.identity.peer_id not in p.service._members for p in peers[:3]), 10,
                    "every remaining peer to drop the withdrawn one from its members")
        served = gone.service.stats.served
        await asyncio.sleep(0.5)  # a window in which nothing may happen: nobody calls the withdrawn peer
        assert gone.service.stats.served == served
        await until(lambda: sum(p.service.stats.rejected["not a member"] for p in peers[:3]) >= 1, 5,
                    "the withdrawn peer's own pushes to be refused as not a member")


async def test_a_failing_directory_keeps_the_last_members_and_gossip_goes_on(caplog):
    async with swarm(4) as (peers, directory):
        async def unreachable(job_id, stage):
            raise ConnectionLost("the DHT is unreachable")

        directory.peers = unreachable
        before = [p.service.stats.exchanges_ok for p in peers]
        await until(lambda: "the directory did not answer" in caplog.text, 10, "a members refresh to fail")
        await wait_full(peers, {p.identity.peer_id for p in peers})
        # Gossip goes on with the last members: every peer completes exchanges after the failure.
        # (The views may be full already when it fails, so wait_full alone proves nothing new:
        # asserted at once, a peer whose next round had not come yet failed a loaded CI run.)
        await until(lambda: all(p.service.stats.exchanges_ok > b for p, b in zip(peers, before)), 10,
                    "every peer to complete an exchange after the directory failed",
                    detail=lambda: f"exchanges {[p.service.stats.exchanges_ok for p in peers]} from {before}")
        assert "the directory did not answer" in caplog.text


async def test_stopping_peers_one_by_one_under_traffic_logs_no_error(caplog):
    """Peers are stopped one after another while the rest keep calling them: calls caught mid-stop get
    `unavailable` (or fail as transport errors), never an internal error or a crashed round; a stopped
    service's view can no longer be read through the service."""
    async with swarm(8, dataclasses.replace(FAST, period_s=0.05)) as (peers, _):
        await wait_full(peers, {p.identity.peer_id for p in peers})
        for p in peers:
            await p.service.stop()
            await asyncio.sleep(0.05)
        with pytest.raises(GossipStopped):
            await peers[0].service.table()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_an_exchange_carries_the_own_entry_and_a_bounded_sample_and_views_still_fill():
    """12 peers whose exchanges carry at most 3 entries besides the sender's own: every view still
    fills; a full view's holder then answers an exchange with its own entry first and 3 others,
    a different sample each time, never its whole view (which made gossip bytes grow with the job)."""
    config = dataclasses.replace(FAST, max_exchange_entries=3)
    async with swarm(12, config) as (peers, _):
        everyone = {p.identity.peer_id for p in peers}
        rounds = await wait_full(peers, everyone, timeout=30.0)
        print(f"\n12 peers, 3 sampled entries per exchange: full views after at most {max(rounds)} rounds")
        target = peers[0]
        samples = set()
        async with client(b"gossip-peer-5") as (_, pool):
            for _ in range(4):
                reply = await pool.call(target.addr, METHOD, exchange_message(encode_entries([])), timeout=2.0)
                got = reply_entries(reply)
                assert len(got) == 4 and got[0].peer_id == target.identity.peer_id
                assert len({e.peer_id for e in got}) == 4 and {e.peer_id for e in got} <= everyone
                samples.add(frozenset(e.peer_id for e in got[1:]))
        assert len(samples) > 1


def test_the_exchange_cap_is_checked():
    with pytest.raises(ConfigError) as refused:
        GossipConfig(max_exchange_entries=-1)
    assert refused.value.key == "max_exchange_entries"
    with pytest.raises(ValueError):
        GossipConfig(max_exchange_entries=64, limits=ViewLimits(max_batch=64))
