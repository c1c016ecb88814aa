"""allreduce.Mailbox on its own: round boxes by id, opened by the first part or by this peer's own
round, checked against it, capped, expired, and closed for good once dropped; a round's failure
reaches whoever waits on it, and a waiter that is cancelled takes nothing from the others."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarmd.stage.allreduce import Contribution, Mailbox
from swarmd.stage.errors import BAD_INPUT, BUSY, RoundFailed
from transport.errors import RpcError

A, B, C = b"a" * 32, b"b" * 32, b"c" * 32
MEMBERS = [A, B, C]


def mailbox(max_open: int = 4, expire_s: float = 60.0, join_s: float = 60.0, closed_kept: int = 8) -> Mailbox:
    return Mailbox(max_open, expire_s, join_s, closed_kept)


async def test_a_part_before_the_round_started_here_opens_the_box_the_round_then_joins():
    box = mailbox()
    early = box.box(b"r1", 3, MEMBERS, B, 12)
    assert not early.joined and box.open_rounds == 1
    assert box.box(b"r1", 3, MEMBERS, B, 12, join=True) is early and early.joined


@pytest.mark.parametrize("step, members", [(4, MEMBERS), (3, [A, B])])
async def test_a_part_disagreeing_with_the_rounds_first_part_is_bad_input(step, members):
    box = mailbox()
    box.box(b"r1", 3, MEMBERS, B, 12)
    with pytest.raises(RpcError) as info:
        box.box(b"r1", step, members, B, 12)
    assert info.value.code == BAD_INPUT


@pytest.mark.parametrize("members", [[A, C], [B, A, C], [A, B, B]])
async def test_members_must_be_distinct_sorted_and_include_this_peer(members):
    with pytest.raises(RpcError) as info:
        mailbox().box(b"r1", 1, members, B, 12)
    assert info.value.code == BAD_INPUT


async def test_rounds_past_max_open_are_busy_and_a_later_step_frees_the_earlier_ones():
    box = mailbox(max_open=2)
    first, _ = box.box(b"r1", 1, MEMBERS, A, 6), box.box(b"r2", 1, MEMBERS, A, 6)
    with pytest.raises(RpcError) as info:
        box.box(b"r3", 1, MEMBERS, A, 6)
    assert info.value.code == BUSY and "max_open_rounds" in info.value.message
    box.box(b"r4", 2, MEMBERS, A, 6)
    assert box.open_rounds == 1 and first.failure is not None


async def test_a_round_never_joined_here_expires_after_join_s():
    box = mailbox(join_s=0.0)
    stale = box.box(b"r1", 1, MEMBERS, A, 6)
    await asyncio.sleep(0.01)
    box.box(b"r2", 1, MEMBERS, A, 6, join=True)
    assert box.get(b"r1") is None and "never joined" in stale.failure


async def test_a_dropped_round_stays_closed_and_so_does_an_id_dropped_before_it_was_seen():
    box = mailbox()
    opened = box.box(b"r1", 1, MEMBERS, A, 6)
    box.drop(b"r1", "aborted by the leader")
    box.drop(b"r2")  # the abort overtook the round's parts
    assert opened.failure == "aborted by the leader"
    for round_id in (b"r1", b"r2"):
        with pytest.raises(RpcError) as info:
            box.box(round_id, 1, MEMBERS, A, 6)
        assert info.value.code == BUSY and "already closed" in info.value.message


async def test_retiring_a_step_fails_its_rounds_and_only_closed_kept_ids_are_remembered():
    box = mailbox(closed_kept=2)
    new, old = box.box(b"r2", 2, MEMBERS, A, 6), box.box(b"r1", 1, MEMBERS, A, 6)  # a late part of step 1
    box.retire(1)
    assert "step 1 is committed" in old.failure and new.failure is None and box.open_rounds == 1
    box.drop(b"x1")
    box.drop(b"x2")
    assert box.box(b"r1", 3, MEMBERS, A, 6) is not None  # forgotten: only the newest two are kept


async def test_fail_all_fails_every_open_round_with_the_reason():
    box = mailbox()
    rounds = [box.box(bytes([i]), 1, MEMBERS, A, 6) for i in range(3)]
    box.fail_all("stage stopping")
    assert box.open_rounds == 0 and all(r.failure == "stage stopping" for r in rounds)


def contribute(box, src: int) -> None:
    lo, hi = box.bounds[box.me]
    box.put_part(src, 0, torch.ones(hi - lo), Contribution(frozenset({src}), 1))


async def test_a_waiter_parked_on_a_round_hears_fail_all_as_round_failed():
    box = mailbox()
    round_ = box.box(b"r1", 1, [A, B], A, 6, join=True)
    waiter = asyncio.create_task(round_.wait(round_.reduced_ready))
    await asyncio.sleep(0)  # parked on the round's event
    assert not waiter.done()
    box.fail_all("the peer is stopping")
    with pytest.raises(RoundFailed, match="the peer is stopping"):
        await asyncio.wait_for(waiter, 5)


async def test_a_cancelled_waiter_leaves_the_round_to_the_others():
    box = mailbox()
    round_ = box.box(b"r1", 1, [A, B], A, 6, join=True)
    gone, stays = (asyncio.create_task(round_.wait(round_.reduced_ready)) for _ in range(2))
    await asyncio.sleep(0)
    gone.cancel()
    contribute(round_, 0)
    contribute(round_, 1)
    await asyncio.wait_for(stays, 5)
    assert gone.cancelled() and round_.failure is None and box.get(b"r1") is round_


async def test_a_part_out_of_order_is_bad_input_and_counts_nothing():
    round_ = mailbox().box(b"r1", 1, [A, B], A, 6, join=True)
    with pytest.raises(RpcError) as info:
        round_.put_part(1, 1, torch.ones(2), None)  # offset 1 before offset 0
    assert info.value.code == BAD_INPUT and round_.received[1] == 0


async def test_a_joined_round_expires_after_expire_s():
    box = mailbox(expire_s=0.0)
    old = box.box(b"r1", 1, MEMBERS, A, 6, join=True)
    await asyncio.sleep(0.01)
    box.box(b"r2", 1, MEMBERS, A, 6, join=True)
    assert box.get(b"r1") is None and old.failure is not None and box.open_rounds == 1


async def test_closing_a_remembered_id_again_makes_it_the_newest():
    box = mailbox(closed_kept=2)
    for round_id in (b"r1", b"r2", b"r1", b"r3"):
        box.drop(round_id)
    for kept in (b"r1", b"r3"):
        with pytest.raises(RpcError):
            box.box(kept, 1, MEMBERS, A, 6)
    assert box.box(b"r2", 1, MEMBERS, A, 6) is not None  # the oldest, forgotten


async def test_a_round_with_a_member_that_owns_no_shard_waits_for_neither_its_shard_nor_its_plan():
    """B owns no shard (an empty one); A's box waits for every member's part of A's shard and for
    the owners' (A's and C's) shards and plans only; a B that leaves at its deadline only
    withdraws (its sum not planned in), an owner cannot."""
    import torch

    from swarmd.stage.allreduce import Contribution

    owners = (True, False, True)
    box = mailbox().box(b"r1", 0, MEMBERS, A, 10, join=True, owners=owners)
    assert box.bounds == [(0, 5), (5, 5), (5, 10)]
    with pytest.raises(RpcError):
        mailbox().box(b"r1", 0, MEMBERS, A, 10, owners=(False, False, False))
    box.put_part(0, 0, torch.ones(5), Contribution(frozenset({0}), 2))
    box.put_part(2, 0, torch.ones(5), Contribution(frozenset({1}), 2))
    assert not box.reduced_ready() and box.late_members() == [1]
    assert box.withdraw(1) and box.reduced_ready() and box.prompt() == [0, 2]
    assert not box.withdraw(2)  # an owner's shard is part of the step
    box.kept = (0, 2)
    box.put_gather(0, 0, torch.ones(5), (), (0, 2))
    assert not box.gathered_ready() and box.late_members() == [2]
    box.put_gather(2, 0, torch.ones(5), (), (0, 2))
    assert box.gathered_ready() and box.plans == {0: (0, 2), 2: (0, 2)}
    with pytest.raises(RpcError):
        box.put_gather(2, 5, torch.ones(0), (), (3,))  # a plan naming a non-member


def resident_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


async def test_opening_a_box_touches_none_of_its_memory():
    """Steps: open a round box for 64M parameters (256 MiB for the gathered vector, 128 MiB for each
    of two members' copies of this member's shard) on the event loop.
    Expected: the process's resident memory grows by far less than that (before: the buffers were
    zeroed, a memset of ~512 MiB on the loop); the first parts then land as usual."""
    numel = 64 * 2**20
    before = resident_kib()
    box = mailbox().box(b"r", 0, [b"a", b"b"], b"a", numel, join=True)
    assert resident_kib() - before < 32 * 1024
    part = torch.ones(1024)
    box.put_part(1, 0, part, Contribution(frozenset({1}), 1))
    assert torch.equal(box.parts[1][:1024], part) and box.received[1] == 1024
