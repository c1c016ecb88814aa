"""Stage all-reduce rounds forged by a stranger, over real loopback sockets.

The round RPCs (`stage.sync.round`, `stage.sync.reduce`, `stage.sync.gather`) name their members
and the sender's index in the message; nothing checks that the connection's proven peer id is the
leader or the member it claims to be, nor that the members are the stage's announced peers. A
stranger that announced nothing, with a fresh identity, reads a peer's step and digest with
`stage.sync.progress` (answered to anyone) and then:

- invites every peer of a stage into phantom rounds led by a made-up id smaller than theirs: each
  joins, takes its gradient sum out of the accumulator, sends its shard to a made-up address, and
  defers leading for `defer_s`; re-invited every few tenths of a second, no peer ever leads a real
  round and the stage never commits (one RPC per peer per `defer_s`);
- sends round parts under another member's index, opening one of the `max_open_rounds` boxes;
- names, as a member's address, a socket of the victim's own host (`unix:...`) that it then dials.

Closed (adversary R1): every round RPC checks the connection's proven id against the member it
acts for, and a member's address is the one its announcement gave, never the invitation's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest
import torch
from adversary_kit import (FAST, JOB, STAGE, backward, committed_within, fake_id, progress, spec, start_peer,
                           ordered_identities, stranger_pool)
from waiting import until

from swarmd.directory import StagePeer, StaticDirectory
from swarmd.stage.sync import ROUND_PROTOCOL
from transport.errors import RemoteError, TransportError
from transport.rpc import Message


def invitation(step: int, digest: bytes, members: list[tuple[bytes, str]]) -> Message:
    members = sorted(members)
    return Message({"job": JOB, "stage": STAGE, "protocol": ROUND_PROTOCOL, "round": os.urandom(16), "step": step,
                    "digest": digest,
                    "members": [p for p, _ in members], "addrs": [a for _, a in members]}, codec="none")


@pytest.fixture
async def stage_peers():
    directory = StaticDirectory()
    job_spec = spec()
    made = []

    async def start(n: int, identities=None):
        for i in range(n):
            made.append(await start_peer(job_spec, STAGE, directory, identity=identities[i] if identities else None))
        return made, directory

    try:
        yield start
    finally:
        for peer in made:
            await peer.close()


@pytest.fixture
async def stranger():
    pool, identity = stranger_pool()
    try:
        yield pool, identity
    finally:
        await pool.close()


async def test_an_invitation_whose_caller_is_not_its_leader_is_refused(stage_peers, stranger):
    """Expected: the victim answers a RemoteError (the caller is not members[0]) and runs no round."""
    (victim,), _ = await stage_peers(1)
    pool, _ = stranger
    seen = await progress(pool, victim)
    message = invitation(seen["step"], seen["digest"], [(fake_id(), "127.0.0.1:9"), (victim.peer_id, victim.addr)])
    with pytest.raises(RemoteError):
        await pool.call(victim.addr, "stage.sync.round", message, timeout=5)


async def test_phantom_rounds_from_a_stranger_do_not_stop_a_stage(stage_peers, stranger):
    """Two honest peers hold step 0's four microbatches between them (a real round commits it in
    well under a second here); a stranger invites both into phantom rounds every 0.3 s.
    Expected: the stage commits step 0 within 8 s all the same."""
    peers, _ = await stage_peers(2)
    pool, _ = stranger
    trainer, _ = stranger_pool()
    invited: list[bytes] = []  # the victims each phantom invitation went to, answered or refused

    async def invite_forever() -> None:
        while True:
            for victim in peers:
                with contextlib.suppress(TransportError, RemoteError):
                    seen = await progress(pool, victim)
                    try:
                        await pool.call(victim.addr, "stage.sync.round", invitation(
                            seen["step"], seen["digest"], [(fake_id(), "127.0.0.1:9"), (victim.peer_id, victim.addr)]),
                            timeout=2)
                    finally:
                        invited.append(victim.peer_id)
            await asyncio.sleep(0.3)

    attack = asyncio.create_task(invite_forever())
    try:
        await until(lambda: {p.peer_id for p in peers} <= set(invited), 10, "the stranger to invite both peers")
        await asyncio.gather(*(backward(trainer, peers[m % 2], 0, m) for m in range(4)))
        assert await committed_within(peers, 1, 8.0), "the stage did not commit step 0 under phantom rounds"
    finally:
        attack.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await attack
        await trainer.close()


async def test_a_part_sent_under_another_members_index_is_refused(stage_peers, stranger):
    """A stranger sends a reduce part as member 0 of a made-up round (members: a made-up id and the
    victim). Expected: refused (the caller is not members[src]) and no round box opened for it (a
    box holds a full gradient's worth of buffers and `max_open_rounds` is 2)."""
    (victim,), _ = await stage_peers(1)
    pool, _ = stranger
    members = sorted([fake_id(), victim.peer_id])
    meta = {"job": JOB, "stage": STAGE, "protocol": ROUND_PROTOCOL, "round": os.urandom(16),
            "step": victim.service.committed,
            "members": members, "src": members.index(members[0] if members[0] != victim.peer_id else members[1]),
            "offset": 0, "ids": [], "samples": 0}
    with pytest.raises(RemoteError):
        await pool.call(victim.addr, "stage.sync.reduce", Message(meta, [torch.zeros(1)], codec="none"), timeout=5)
    assert victim.service.sync.mailbox.open_rounds == 0


async def test_round_members_must_be_the_stages_announced_peers(stage_peers):
    """A leader that is an announced peer of the stage (a Sybil may be) names a third member at a
    Unix socket of the victim's host. Expected: refused, since that (id, address) pair is no
    announcement of the stage; on main the victim joins and dials the socket."""
    first, second = ordered_identities(2)  # the leader's id sorts before the victim's
    (victim,), directory = await stage_peers(1, [second])
    leader_pool, leader = stranger_pool(first)
    try:
        announced = await directory.peers(JOB, STAGE)
        directory.set(JOB, STAGE, [*announced, StagePeer(leader.peer_id, "127.0.0.1:9", STAGE)])
        seen = await progress(leader_pool, victim)
        members = [(leader.peer_id, "127.0.0.1:9"), (victim.peer_id, victim.addr),
                   (b"\xff" * 32, "unix:/run/swarmd/control.sock")]
        with pytest.raises(RemoteError):
            await leader_pool.call(victim.addr, "stage.sync.round", invitation(seen["step"], seen["digest"], members),
                                   timeout=5)
    finally:
        await leader_pool.close()
