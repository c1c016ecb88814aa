"""The stage core's rules on their own: no sockets, no clock, no tensors (swarmd/stage/core.py)."""

from __future__ import annotations

import pytest

from swarmd.stage.core import (Admission, CoreConfig, Download, Lead, MateView, Phase, StageCore, agreed_digest,
                               initial_digest, next_digest, plan_round)
from swarmd.stage.idsets import decode_ranges, encode_ranges

D0 = initial_digest(5, 1)


def core(index: int, microbatches: int = 4) -> StageCore:
    c = StageCore(bytes([index]) * 4, f"p{index}", CoreConfig(microbatches, missing_grace_s=2.0, defer_s=1.0,
                                                               bench_s=1.0, bench_max_s=8.0))
    c.replaced(0, D0)
    c.phase = Phase.SERVING
    return c


def mate(index: int, ids=(), step: int = 0, digest: bytes = D0, claimed=()) -> MateView:
    return MateView(bytes([index]) * 4, f"p{index}", step, "serving", digest, frozenset(ids), frozenset(claimed))


def contributions(*sets):
    return [(frozenset(s), 2 * len(s)) for s in sets]


def test_plan_sums_each_microbatch_once_and_leaves_the_overlap_out():
    step = frozenset(range(4))
    plan = plan_round(contributions({0, 1, 2}, {2, 3}), step)
    assert plan.kept == (0,) and plan.left_out == (1,) and not plan.covered and plan.conflict
    plan = plan_round(contributions({0, 1}, {1}, {2, 3}, set()), step)
    assert plan.kept == (0, 2, 3) and plan.left_out == (1,) and plan.covered and plan.samples == 8
    plan = plan_round(contributions({0, 1, 2, 3}, {0, 1, 2, 3}), step)
    assert plan.kept == (0,) and plan.covered  # two full copies: one is summed


def test_a_repeat_and_a_mate_held_microbatch_are_not_added_and_a_failed_compute_frees_its_claim():
    c = core(1)
    assert c.admit(0.0, 0, 0) == Admission.ACCUMULATE
    assert c.admit(0.0, 0, 0) == Admission.REPEAT and c.repeats(0) == 1
    c.settled(0, 0, c.epoch, added=False)  # the compute failed (its caller may be gone): no leak
    assert c.admit(0.0, 0, 0) == Admission.ACCUMULATE
    c.observe(0.0, [mate(2, ids={1})], [], [bytes([2]) * 4])
    assert c.admit(0.0, 0, 1) == Admission.HELD_BY_MATE
    c.observe(0.1, [mate(2, ids={1}, digest=b"x" * 16)], [], [bytes([2]) * 4])
    assert c.admit(0.0, 0, 1) == Admission.ACCUMULATE  # another lineage's copy does not count


def test_a_settle_from_before_a_state_replacement_frees_nothing():
    c = core(1)
    assert c.admit(0.0, 0, 2) == Admission.ACCUMULATE
    old = c.epoch
    c.replaced(0, D0)
    assert c.admit(0.0, 0, 2) == Admission.ACCUMULATE
    c.settled(0, 2, old, added=False)
    assert c.admit(0.0, 0, 2) == Admission.REPEAT


def test_the_smallest_peer_of_the_lineage_leads_once_the_step_is_covered():
    a, b = core(1), core(2)
    for c, other in ((a, mate(2, ids={2, 3})), (b, mate(1, ids={0, 1}))):
        c.observe(0.0, [other], [], [other.peer_id])
    assert isinstance(lead := a.decide(0.0, frozenset({0, 1})), Lead)
    assert [p for p, _ in lead.members] == [a.peer_id, b.peer_id]
    assert b.decide(0.0, frozenset({2, 3})) is None
    assert a.decide(0.0, frozenset({0})) is None and a.uncovered == [1]



def test_a_mate_that_holds_nothing_is_no_round_member_and_does_not_lead():
    """Steps: peers 1, 2, 3 at one step; 2 and 3 hold all four microbatches, 1 (the smallest id,
    say a stopped peer the trainers route nothing to) holds none. Expected: 1 leads nothing; 2
    leads a round of 2 and 3 only (a round never waits for a member that adds nothing); once 3 also
    holds nothing, 2 leads a round of itself alone."""
    a, b = core(1), core(2)
    a.observe(0.0, [mate(2, ids={0, 1}), mate(3, ids={2, 3})], [], [bytes([2]) * 4, bytes([3]) * 4])
    assert a.decide(0.0, frozenset()) is None
    b.observe(0.0, [mate(1), mate(3, ids={2, 3})], [], [bytes([1]) * 4, bytes([3]) * 4])
    lead = b.decide(0.0, frozenset({0, 1}))
    assert isinstance(lead, Lead) and [p for p, _ in lead.members] == [bytes([2]) * 4, bytes([3]) * 4]
    b.observe(0.1, [mate(1), mate(3)], [], [bytes([1]) * 4, bytes([3]) * 4])
    lead = b.decide(0.1, frozenset({0, 1, 2, 3}))
    assert isinstance(lead, Lead) and [p for p, _ in lead.members] == [bytes([2]) * 4]

def test_a_slow_mate_shields_its_ids_for_the_grace_then_they_are_missing():
    a = core(1)
    a.observe(0.0, [mate(2, ids={2})], [], [bytes([2]) * 4])
    a.decide(0.0, frozenset({0, 1}))
    assert a.uncovered == [3] and a.missing == []
    a.observe(0.5, [], [bytes([2]) * 4], [bytes([2]) * 4])
    a.decide(0.5, frozenset({0, 1}))
    assert a.uncovered == [3] and a.missing == [] and a.mate_slow()
    a.observe(3.0, [], [bytes([2]) * 4], [bytes([2]) * 4])
    a.decide(3.0, frozenset({0, 1}))
    assert a.missing == [2] and a.uncovered == [2, 3]


def test_peers_at_one_step_agree_on_the_digest_most_of_them_hold():
    assert agreed_digest(b"a", [b"b", b"b"]) == b"b"
    assert agreed_digest(b"b", [b"a"]) == b"a"  # a tie: the smallest, the same on both sides
    c = core(3)
    other = next_digest(D0, 0, b"r" * 16)
    c.observe(0.0, [mate(1, digest=other), mate(2, digest=other)], [], [bytes([1]) * 4, bytes([2]) * 4])
    action = c.decide(0.0, frozenset())
    assert isinstance(action, Download) and [p for p, _ in action.sources] == [bytes([1]) * 4, bytes([2]) * 4]


def test_a_mate_ahead_is_downloaded_from_before_anything_else():
    c = core(1)
    c.observe(0.0, [mate(2, step=3, digest=b"z" * 16)], [], [bytes([2]) * 4])
    assert isinstance(c.decide(0.0, frozenset({0, 1, 2, 3})), Download)


def test_invitations_another_step_or_state_or_a_second_round_are_refused():
    c = core(2)
    assert c.invited(0.0, bytes([1]) * 4, 1, D0) is not None
    assert c.invited(0.0, bytes([1]) * 4, 0, b"y" * 16) is not None
    assert c.invited(0.0, bytes([1]) * 4, 0, D0) is None
    c.round_started(b"r1")
    assert "already" in c.invited(0.0, bytes([1]) * 4, 0, D0)


def test_a_smaller_leader_that_invited_us_is_deferred_to_even_out_of_sight():
    """Asymmetric views: peer 2 sees only peer 3; peer 1 sees both. After peer 1's invitation
    peer 2 leaves the lead to it for defer_s, so the two do not refuse each other forever."""
    c = core(2)
    c.observe(0.0, [mate(3, ids={2, 3})], [], [bytes([3]) * 4])
    assert isinstance(c.decide(0.0, frozenset({0, 1})), Lead)
    assert c.invited(0.0, bytes([1]) * 4, 0, D0) is None
    assert c.decide(0.5, frozenset({0, 1})) is None
    assert isinstance(c.decide(1.5, frozenset({0, 1})), Lead)


def test_a_member_late_in_rounds_is_benched_for_a_growing_while():
    c = core(1)
    slow = bytes([2]) * 4
    c.observe(0.0, [mate(2, ids={2, 3})], [], [slow])
    c.round_started(b"r1")
    c.round_failed(0.0, b"r1", c.peer_id, late=[slow])  # the first failure is free
    assert isinstance(c.decide(0.0, frozenset({0, 1})), Lead)
    c.round_started(b"r2")
    c.round_failed(1.0, b"r2", c.peer_id, late=[slow])
    assert c.decide(1.5, frozenset({0, 1})) is None  # benched 1 s: the step is not covered without it
    assert "benched" in c.invited(1.5, slow, 0, D0)
    c.round_started(b"r3")
    c.round_failed(2.5, b"r3", c.peer_id, late=[slow])
    assert c.decide(4.0, frozenset({0, 1})) is None and isinstance(c.decide(4.6, frozenset({0, 1})), Lead)


def test_a_commit_moves_the_digest_on_and_forgets_the_steps_claims():
    c = core(1)
    c.admit(0.0, 0, 1)
    c.round_started(b"r" * 16)
    c.committed(0.0, 0, b"r" * 16, c.peer_id, [c.peer_id])
    assert c.step == 1 and c.digest == next_digest(D0, 0, b"r" * 16) and c.round_id is None
    assert c.claimed(0) == frozenset()
    with pytest.raises(RuntimeError):
        c.committed(0.0, 0, b"s" * 16, c.peer_id, [c.peer_id])


def test_a_peer_behind_alone_jumps_only_after_every_look_agreed_for_resume_after_s():
    c = core(1)
    c.config = CoreConfig(4, resume_after_s=2.0)
    assert not c.behind_alone(0.0, True)
    assert not c.behind_alone(1.0, True)
    assert not c.behind_alone(1.5, False)  # one look found a mate that may be ahead: start over
    assert not c.behind_alone(2.0, True) and not c.behind_alone(3.9, True)
    assert c.behind_alone(4.1, True)
    c.jumped(7)
    assert c.step == 7 and c.digest != D0


def test_id_sets_travel_as_ranges_and_a_mate_cannot_name_ids_outside_the_step():
    assert encode_ranges({4, 5, 6, 9}) == [[4, 7], [9, 10]]
    assert decode_ranges([[4, 7], [9, 10]], range(4, 12)) == frozenset({4, 5, 6, 9})
    for bad in ([[3, 5]], [[6, 5]], [[4, 6], [5, 7]], [[9, 10], [4, 5]], [[4, 13]], "x", [[4, 5.0]],
                [[4, 5]] * 9):
        with pytest.raises(ValueError):
            decode_ranges(bad, range(4, 12))


def test_each_phase_deadline_follows_the_bytes_each_member_sends_and_its_rate():
    from swarmd.stage.allreduce import phase_deadlines

    numel = 50_000_000  # 200 MB of fp32 gradient; fp16 halves what moves
    every = (True,) * 4
    # 4 owners: each sends 3/4 of the vector in each phase (75 MB in fp16); at 25 MB/s (200 Mb/s)
    # 3 s, x4 margin, in each phase.
    assert phase_deadlines(numel, "fp16", every, [25e6, 1e9, 1e9, 1e9], 5.0, 600.0, 4.0) == pytest.approx((12, 12))
    assert phase_deadlines(numel, "none", every, [25e6, 1e9, 1e9, 1e9], 5.0, 600.0, 4.0) == pytest.approx((24, 24))
    assert phase_deadlines(numel, "fp16", every, [1e12] * 4, 5.0, 600.0, 4.0) == (5.0, 5.0)  # the floor
    assert phase_deadlines(numel, "fp16", every, [1e3] * 4, 5.0, 600.0, 4.0) == (600.0, 600.0)  # the cap
    assert phase_deadlines(numel, "fp16", every, [25e6, 0.0, 1e9, 1e9], 5.0, 600.0, 4.0) == (600.0, 600.0)
    # The slow member owns no shard: it sends its whole vector once (100 MB: 4 s, x4), and the
    # all-gather is the three fast owners' alone (the floor), however slow it is.
    slow_out = (False, True, True, True)
    assert phase_deadlines(numel, "fp16", slow_out, [25e6, 1e9, 1e9, 1e9], 5.0, 600.0, 4.0) == pytest.approx((16, 5))
    assert phase_deadlines(numel, "fp16", slow_out, [1e3, 1e9, 1e9, 1e9], 5.0, 600.0, 4.0) == pytest.approx((600, 5))
    # An unmeasured member that sends nothing in a phase does not make that phase wait.
    assert phase_deadlines(numel, "fp16", slow_out, [0.0, 1e9, 1e9, 1e9], 5.0, 600.0, 4.0) == (600.0, 5.0)


def test_members_slow_or_late_lately_own_no_shard_and_the_shards_are_cut_among_the_owners():
    from swarmd.stage.allreduce import choose_owners, shard_bounds

    assert choose_owners([1e9, 1e8, 0.0], [False] * 3, 0.25) == (True, False, True)  # unmeasured owns
    assert choose_owners([1e9, 1e9, 1e9], [False, True, False], 0.25) == (True, False, True)
    assert choose_owners([1e3, 1e9], [False, True], 0.25) == (False, True)  # the only unsuspected owner
    assert choose_owners([1e3, 1e9], [True, True], 0.25) == (False, True)  # at least one: the fastest
    assert choose_owners([0.0, 0.0], [True, True], 0.25) == (True, False)
    assert shard_bounds(10, (True, False, True, True)) == [(0, 4), (4, 4), (4, 7), (7, 10)]
    assert shard_bounds(10, (True,) * 3) == [(0, 4), (4, 7), (7, 10)]




def test_a_mate_of_the_round_just_committed_gets_defer_s_to_show_the_new_step():
    """The leader commits step 0 a moment before its mates; its last view of peer 3 still shows
    step 0. Expected: for defer_s it does not lead step 1 without peer 3 (which would make peer 3
    download what it is committing itself); after that it does (peer 3 may really have failed)."""
    c = core(1)
    c.committed(10.0, 0, b"r" * 16, c.peer_id, [c.peer_id, bytes([2]) * 4, bytes([3]) * 4])
    step1 = c.digest
    views = [mate(2, ids={6, 7}, step=1, digest=step1), mate(3, step=0)]
    c.observe(10.1, views, [], [bytes([2]) * 4, bytes([3]) * 4])
    assert c.decide(10.1, frozenset({4, 5})) is None
    c.observe(11.2, views, [], [bytes([2]) * 4, bytes([3]) * 4])
    lead = c.decide(11.2, frozenset({4, 5}))
    assert isinstance(lead, Lead) and [p for p, _ in lead.members] == [c.peer_id, bytes([2]) * 4]
    c.observe(11.3, [mate(2, ids={6, 7}, step=1, digest=step1), mate(3, ids={5}, step=1, digest=step1)], [],
              [bytes([2]) * 4, bytes([3]) * 4])
    # Its view caught up (and it holds some of the step): it is a member again.
    assert len(c.decide(11.3, frozenset({4})).members) == 3


def test_a_lone_mate_ahead_is_believed_only_when_confirmed_or_when_this_step_went_quiet():
    """Adversary R2's other side: a lone claim ahead contradicted by a mate at this peer's step and
    state is set aside while microbatches of this step keep coming; it is believed with a second
    mate ahead, with no mate at this step, or after resume_after_s without a new microbatch (an
    honest mate committed alone and the trainers went on)."""
    c = StageCore(b"\x01" * 4, "p1", CoreConfig(4, resume_after_s=10.0))
    c.replaced(0, D0)
    c.phase = Phase.SERVING
    peers = [bytes([i]) * 4 for i in (2, 3, 4)]
    same, lone = mate(2, ids={1}), mate(3, step=5, digest=b"y" * 16)
    c.observe(0.0, [same, lone], [], peers)
    assert c.decide(0.0, frozenset({0})) is None
    assert c.admit(8.0, 0, 2) == Admission.ACCUMULATE  # work for this step still arrives
    assert c.decide(12.0, frozenset({0, 2})) is None
    download = c.decide(22.5, frozenset({0, 2}))  # 10 s since microbatch 2 was first seen (12.0)
    assert isinstance(download, Download) and download.sources[0][0] == lone.peer_id
    c = core(1)
    c.observe(0.0, [same, lone], [], peers)
    assert c.decide(0.0, frozenset()) is None
    c.observe(0.1, [lone], [], peers)  # nobody at this step contradicts it
    assert isinstance(c.decide(0.1, frozenset()), Download)
    c = core(1)
    liar, second, third = mate(3, step=1_000, digest=b"z" * 16), mate(4, step=1), mate(2, step=1)
    c.observe(0.0, [liar, second, third], [], peers)
    assert [p for p, _ in c.decide(0.0, frozenset()).sources] == [third.peer_id, second.peer_id, liar.peer_id]


def test_an_idle_peer_downloads_only_every_idle_catch_up_s_or_when_a_call_brings_work_back():
    """Steps: a peer with no compute call follows a mate ahead step by step; idle_after_steps (2)
    steps on, the mate goes on; later a call for an old step, then one for the mate's step arrive;
    separately a busy peer gets a call for a step past its own. Expected: it downloads while not
    idle; idle, it downloads no sooner than idle_catch_up_s (3 s) after its last download, showing
    behind meanwhile; the old step's call changes nothing; the mate's step's call ends the idleness
    and brings the download at once; a call for a far step keeps it from going idle no longer than
    one for the step after its mate's; the busy peer's call brings none (its catch-ups stay the
    sync loop's)."""
    c = StageCore(b"\x01" * 4, "p1", CoreConfig(4, idle_after_steps=2, idle_catch_up_s=3.0))
    c.replaced(0, D0)
    c.phase = Phase.SERVING
    c.worked(0)
    ahead = [bytes([2]) * 4]
    for step in (1, 2):  # not idle yet: a download per step the mate is ahead
        c.observe(float(step), [mate(2, step=step)], [], ahead)
        assert isinstance(c.decide(float(step), frozenset()), Download) and not c.behind()
        c.replaced(step, D0)
    assert c.idle()
    c.observe(2.5, [mate(2, step=5)], [], ahead)
    assert c.decide(2.5, frozenset()) is None and c.decide(4.9, frozenset()) is None and c.behind()
    assert isinstance(c.decide(5.0, frozenset()), Download)  # idle_catch_up_s after the last one
    c.replaced(5, D0)
    c.observe(6.0, [mate(2, step=9)], [], ahead)
    assert c.decide(6.0, frozenset()) is None and c.behind()
    # A call for a step it is past (a replay, or stale) brings no download, even when one is due.
    assert c.wanted(9.0, 2, frozenset()) is None and c.idle()
    download = c.wanted(9.1, 9, frozenset())
    assert isinstance(download, Download) and download.sources[0][0] == ahead[0]
    assert not c.idle() and not c.behind()

    # A stranger's call for a far step counts as one for the step after the furthest in view.
    c.replaced(9, D0)
    assert c.wanted(9.2, 10**9, frozenset()) is None
    c.replaced(11, D0)
    assert not c.idle()
    c.replaced(12, D0)  # idle_after_steps past step 10
    assert c.idle()

    busy = core(3)
    busy.worked(0)
    busy.observe(0.0, [mate(2, step=1)], [], ahead)
    assert busy.wanted(0.0, 1, frozenset()) is None and isinstance(busy.decide(0.0, frozenset()), Download)


def test_an_idle_peer_catches_up_at_once_when_its_mates_finished_the_job():
    """Steps: an idle peer of a 10-step job behind a mate at step 8, then at step 10 (done).
    Expected: lazy at 8 (within idle_catch_up_s of its last download); at 10 it downloads at once:
    no work will come, and its state is what the job leaves behind."""
    c = StageCore(b"\x01" * 4, "p1", CoreConfig(4, idle_after_steps=2, idle_catch_up_s=30.0, job_steps=10))
    c.replaced(3, D0)  # no call since step 0
    c.phase = Phase.SERVING
    ahead = [bytes([2]) * 4]
    c.observe(0.0, [mate(2, step=5)], [], ahead)
    assert c.idle() and isinstance(c.decide(0.0, frozenset()), Download)
    c.replaced(5, D0)
    c.observe(1.0, [mate(2, step=8)], [], ahead)
    assert c.decide(1.0, frozenset()) is None and c.behind()
    c.observe(2.0, [mate(2, step=10)], [], ahead)
    assert isinstance(c.decide(2.0, frozenset()), Download)
