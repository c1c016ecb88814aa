"""The stage core in a simulated swarm: I1-I3 on thousands of seeded schedules, and the five
holes found by review (late replies, a lost trainer, a straggler, split views, a leaked claim) as
hand-made schedules that must now end exact, agreed and finished (swarmd/stage/simulation.py)."""

from __future__ import annotations

import dataclasses
import time

from swarmd.stage.simulation import Schedule, StageSimulation, check_schedules

BASE = Schedule(seed=1, peers=3, microbatches=4, steps=4, trainers=1, compute_s=(0.02, 0.02, 0.02),
                latency_s=0.005, loss=0.0, trainer_timeout_s=0.5, late=(), cuts=(), hidden=(), deaths=(),
                errors=0.0, hedge=1, fault_end=6.0)


def run(**changes) -> StageSimulation:
    sim = StageSimulation(dataclasses.replace(BASE, **changes))
    sim.run()  # raises Violation if a commit was not exact, states diverged or the run stalled
    return sim


def test_two_thousand_seeded_schedules_keep_every_invariant():
    began = time.process_time()
    commits = check_schedules(range(2000))
    print(f"2000 schedules, {commits} commits checked, {time.process_time() - began:.1f} s CPU")
    assert commits > 10_000


def test_a_reply_past_the_trainers_timeout_is_not_summed_twice():
    """Review hole 1: peer 0 adds every call at once but its replies come after the trainer's
    timeout (a slow uplink), so the trainer retries each microbatch on a mate; every step still
    sums each id once (the mate sees it held, or the round leaves one copy out)."""
    sim = run(peers=2, compute_s=(0.02, 0.02), slow_links=((0.0, 5.0, 0, 0.4),), trainer_timeout_s=0.3, seed=11)
    assert sim.counts.get("admit: held_by_mate", 0) + sim.counts.get("round failed: left out", 0) \
        + sim.counts.get("commit with sums left out", 0) > 0


def test_a_trainer_whose_late_call_let_the_stage_commit_goes_on():
    """Review hole 2: a one-peer stage whose compute outlasts the trainer's timeout commits the
    step with the retried copies; the trainer hears `stale_step` as done and carries on."""
    run(peers=1, compute_s=(0.02,), late=((0.0, 5.0, 0, 2.0),), seed=12)


def test_a_straggling_member_cannot_hold_the_stage_hostage():
    """Review hole 3: every part peer 2 sends takes longer than the round timeout while the
    faults last; its mates bench it, commit without it, and it catches up by download."""
    sim = run(slow_links=((0.0, 6.0, 2, 2.0),), seed=13)
    print(sim.counts)
    assert sim.counts.get("commit by 2 of 3 while faults last", 0) > 0


def test_split_views_that_heal_end_on_one_state():
    """Review hole 4: peers {0, 1} and {2} cannot see each other and a hedging trainer gives both
    sides every microbatch, so each side commits steps alone; once the views heal the peers agree
    on one state (a download for agreement) and finish on it."""
    hidden = tuple((0.0, 5.0, a, b) for a, b in ((0, 2), (2, 0), (1, 2), (2, 1)))
    sim = run(hidden=hidden, hedge=3, seed=14)
    assert sim.counts.get("download: agreement", 0) + sim.counts.get("download: behind", 0) > 0


def test_claims_of_failed_computes_are_released():
    """Review hole 5: on a one-peer stage half the computes fail (their callers long gone); each
    failure releases its claim, so the re-send is taken and every step commits."""
    sim = run(peers=1, compute_s=(0.02,), errors=0.5, trainer_timeout_s=0.01, seed=15)
    assert sim.counts.get("compute failed", 0) > 0


def test_a_member_slow_for_the_whole_run_never_stops_the_stage():
    """Issue 14 item 3 on 500 seeded schedules: besides each schedule's own faults, one member's
    round parts take 0.2 to 4 s for the whole run (the round deadline is 1.5 s a phase), past the
    faults too. Expected: every schedule still ends exact, agreed and finished (the slow member
    contributes when it can, owns no shard once it was late, is left out of rounds its mates can
    commit without it, is benched when they cannot, and catches up by download), and rounds did
    commit without a late member."""
    import random

    from swarmd.stage.simulation import random_schedule

    commits, counts = 0, {}
    for seed in range(500):
        schedule = random_schedule(seed)
        if schedule.peers < 2:
            continue
        rng = random.Random(seed)
        sim = StageSimulation(dataclasses.replace(schedule, slow_member=(rng.randrange(schedule.peers),
                                                                          rng.uniform(0.2, 4.0))))
        sim.run()
        commits += sim.commits
        for kind, n in sim.counts.items():
            counts[kind] = counts.get(kind, 0) + n
    print(commits, "commits;", {k: v for k, v in counts.items() if "commit" in k or "failed" in k})
    assert commits > 1000 and counts.get("commit without late members", 0) > 0


def test_a_member_stopped_most_of_the_time_never_breaks_the_invariants():
    """The chaos bench's `slow_peer` on 300 seeded schedules: besides each schedule's own faults,
    one peer is stopped (its ticks, computes and messages held) for 30-80% of every 0.1-0.6 s for
    the whole run. The trainers here still route to it, so it holds microbatches and is a round
    member some steps, and holds nothing (no member: it downloads) others. Expected: every schedule
    ends exact, agreed and finished, and the stopped peer caught up by download."""
    import random

    from swarmd.stage.simulation import random_schedule

    commits, downloads = 0, 0
    for seed in range(300):
        schedule = random_schedule(seed)
        if schedule.peers < 2:
            continue
        rng = random.Random(seed)
        stalled = (rng.randrange(schedule.peers), rng.uniform(0.1, 0.6), rng.uniform(0.3, 0.8))
        sim = StageSimulation(dataclasses.replace(schedule, stalled=stalled))
        sim.run()
        commits += sim.commits
        downloads += sim.counts.get("download: behind", 0)
    print(commits, "commits,", downloads, "downloads of a peer behind")
    assert commits > 500 and downloads > 0


def test_a_withheld_peer_catches_up_lazily_and_keeps_every_invariant():
    """Issue 14's lazy catch-up on 300 seeded schedules of 20 steps: besides each schedule's own
    faults (but a member slow for good), the trainers withhold one peer (no work but one probe each
    every 2-6 s), so it is idle and catches up only every idle_catch_up_s (3 s here: several steps,
    as the real 10 s are dozens) or for a probe of a later step. Expected: every schedule ends
    exact (I1), on one history with equal digests naming equal histories, the idle peer's included
    (I2), and finished (I3); idle peers were behind for a while and probes made them catch up; and
    with the idle rule off (a peer downloads whenever a mate is ahead) the withheld peers of the
    same schedules download at least 1.25 times as often."""
    import random

    from swarmd.stage.simulation import random_schedule

    totals: dict[str, dict[str, int]] = {"lazy": {}, "eager": {}}
    downloads = {"lazy": 0, "eager": 0}
    commits = 0
    for seed in range(300):
        schedule = random_schedule(seed)
        if schedule.peers < 2:
            continue
        rng = random.Random(seed)
        # No member slow for good beside it: with one, a step can stall, idle rule or not (its
        # parts are always late, and the withheld peer, holding a probe's microbatch, is then the
        # only mate that benches it: no trainer sees the rest uncovered; docs/stage-rpc.md).
        withheld = dataclasses.replace(schedule, steps=20, slow_member=None, idle_catch_up_s=3.0,
                                       withheld=(rng.randrange(schedule.peers), rng.uniform(2.0, 6.0)))
        for name, idle_after in (("lazy", withheld.idle_after_steps), ("eager", 10**9)):
            sim = StageSimulation(dataclasses.replace(withheld, idle_after_steps=idle_after))
            sim.run()
            commits += sim.commits
            downloads[name] += sim.peers[withheld.withheld[0]].downloads
            for kind, n in sim.counts.items():
                totals[name][kind] = totals[name].get(kind, 0) + n
    lazy, eager = totals["lazy"], totals["eager"]
    print(commits, "commits; withheld peers' downloads", downloads,
          {k: (lazy.get(k, 0), eager.get(k, 0)) for k in ("tick behind", "download: called", "probe")})
    assert commits > 5000 and lazy.get("tick behind", 0) > 0 and lazy.get("download: called", 0) > 0
    assert eager.get("tick behind", 0) == 0 and eager.get("download: called", 0) == 0
    assert 1.25 * downloads["lazy"] < downloads["eager"], downloads
