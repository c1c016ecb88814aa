"""Dynamic assignment as a pure schedule: own share first, others' undone indices after a bound that
grows with the distance from the owner in shard order; and the held-tensor store on disk."""

import asyncio

import pytest
import torch

from swarmd.train.assignment import Assignment, TakeoverPolicy
from swarmd.train.held import HeldTensors


def test_own_share_and_rank():
    a = Assignment(per_step=8, shard=1, shards=3)
    assert a.own() == [1, 4, 7]
    assert [a.rank(m) for m in range(6)] == [1, 0, 2, 1, 0, 2]  # owner 0 -> successor 1; owner 2 -> 2 away


def test_undone_indices_are_taken_over_after_a_bound_by_the_owners_successor_first():
    policy = TakeoverPolicy(min_s=5.0, factor=2.0)
    first = Assignment(8, shard=1, shards=3, policy=policy)  # successor of shard 0
    second = Assignment(8, shard=2, shards=3, policy=policy)  # two away from shard 0
    undone = {0, 3, 6}  # shard 0's share, never sent
    for a in (first, second):
        assert a.due(undone, set(), set(), now=100.0, own_share_s=1.0) == []
    assert first.due(undone, set(), set(), now=104.9, own_share_s=1.0) == []
    assert first.due(undone, set(), set(), now=105.0, own_share_s=1.0) == [0, 3, 6]  # bound max(5, 2x1) x rank 1
    assert second.due(undone, set(), set(), now=105.0, own_share_s=1.0) == []
    assert second.due(undone, set(), set(), now=110.0, own_share_s=1.0) == [0, 3, 6]  # x rank 2
    # A slow step stretches the bound: factor x own share time.
    late = Assignment(8, shard=1, shards=3, policy=policy)
    assert late.due(undone, set(), set(), now=0.0, own_share_s=4.0) == []
    assert late.due(undone, set(), set(), now=7.9, own_share_s=4.0) == []
    assert late.due(undone, set(), set(), now=8.0, own_share_s=4.0) == [0, 3, 6]


def test_started_own_and_foreign_indices_are_never_due_and_a_reappearing_one_waits_again():
    a = Assignment(4, shard=0, shards=2, policy=TakeoverPolicy(min_s=1.0, factor=0.0))
    a.due({1, 3, 0, 9, -1}, set(), set(), now=0.0, own_share_s=0.0)
    assert a.due({1, 3, 0, 9, -1}, set(), {3}, now=1.0, own_share_s=0.0) == [1]  # own 0, started 3, out-of-step 9/-1
    a.due(set(), set(), set(), now=1.5, own_share_s=0.0)  # 1 no longer undone: forgotten
    assert a.due({1}, set(), set(), now=2.0, own_share_s=0.0) == []
    assert a.due({1}, set(), set(), now=3.0, own_share_s=0.0) == [1]


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="shards must be in 1..4"):
        Assignment(4, shard=0, shards=5)
    with pytest.raises(ValueError, match="shard must be in 0..1"):
        Assignment(4, shard=2, shards=2)
    with pytest.raises(ValueError):
        TakeoverPolicy(min_s=-1)


def test_held_tensors_round_trip_on_disk_and_go_with_their_step(tmp_path):
    async def scenario():
        held = HeldTensors(tmp_path)
        x, g = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
        await held.put(5, 21, {0: (None, g), 1: (x, None)})
        back = await held.get(5, 21)
        assert back[0][0] is None and torch.equal(back[0][1], g) and torch.equal(back[1][0], x)
        assert await held.get(5, 22) is None and await held.get(6, 21) is None
        await held.drop(5)
        assert await held.get(5, 21) is None
        await held.close()
        assert not held.root.exists()

    asyncio.run(scenario())


def test_a_trainer_taken_from_is_a_suspect_next_step_and_its_unstarted_indices_go_at_once():
    a = Assignment(6, shard=1, shards=2, policy=TakeoverPolicy(min_s=5.0, factor=0.0))
    a.begin_step()
    a.due({0, 2, 4}, {0, 2, 4}, set(), now=0.0, own_share_s=1.0)
    assert a.due({0, 2, 4}, {0, 2, 4}, set(), now=5.0, own_share_s=1.0) == [0, 2, 4]
    a.begin_step()  # shard 0 is a suspect now
    assert a.suspects == {0}
    # 0 is under way somewhere (undone below, not fresh): it still waits; 2 and 4 go at once.
    assert a.due({0, 2, 4}, {2, 4}, set(), now=10.0, own_share_s=1.0) == [2, 4]
    a.begin_step()
    assert a.suspects == {0}
    # A suspect alive after all: nothing of it stays undone, nothing is taken, it is cleared.
    assert a.due(set(), set(), set(), now=20.0, own_share_s=1.0) == []
    a.begin_step()
    assert a.suspects == set()
