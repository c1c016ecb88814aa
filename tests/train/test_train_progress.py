"""Reading stage.info answers (swarmd/train/progress.py), pure: no one answer decides for a stage.

The adversary tests (tests/security/test_adversary_progress_lies.py, ..._trainer_start.py,
..._hung_info.py) attack the same rules with real peers; these pin the rules themselves, including
what honest stages need from them (a mate's report lagging, a stage that lost its state)."""

from swarmd.train import progress

A, B, C = b"a" * 32, b"b" * 32, b"c" * 32


def info(step, uncovered=(), state="serving", **more):
    return {"step": step, "state": state, "uncovered": list(uncovered), "missing": [], **more}


def test_lower_median_is_moved_only_by_most_values():
    assert progress.lower_median([]) is None
    assert progress.lower_median([4]) == 4
    assert progress.lower_median([3, 1_000_000]) == 3  # two values: the smaller
    assert progress.lower_median([3, 4, 1_000_000]) == 4  # one liar of three moves it nowhere
    assert progress.lower_median([0, 4, 4]) == 4  # nor one claiming too little
    assert progress.lower_median([7, 7, 3]) == 7  # most of them do


def test_a_stage_is_committed_when_most_of_its_answers_are_past_the_step():
    assert progress.committed([], 3) == []
    assert progress.committed([info(4)], 3) == [info(4)]
    assert progress.committed([info(3), info(4)], 3) == []  # a mate has not committed yet
    assert progress.committed([info(3), info(4), info(4)], 3) == [info(4), info(4)]
    assert progress.committed([info("4"), info(4), info(4)], 3) == [info(4), info(4)]  # malformed: step 0
    assert progress.committed([info(True), info(4)], 3) == []


def test_voters_prefer_peers_that_served_and_serving_ones():
    answers = {A: info(3), B: info(1_000_000), C: info(0, state="joining")}
    assert progress.voters(answers, {A}) == [info(3)]  # the liar B never served this trainer
    assert progress.voters(answers, set()) == [info(3), info(1_000_000)]  # nobody served: all serving ones
    assert progress.voters({C: info(0, state="joining")}, set()) == [info(0, state="joining")]
    # A served peer that is downloading its mates' state does not outvote serving ones.
    assert progress.voters(answers, {C}) == [info(3), info(1_000_000)]
    assert progress.agreed_step(progress.voters(answers, set())) == 3


def test_a_peer_behind_its_mates_never_votes():
    """An idle stage peer catches up with its mates only every idle_catch_up_s and shows `behind`
    meanwhile: its old step must neither hold the stage back (everything would look uncovered and
    be re-sent) nor, as the lower median of two, stand for the stage's step."""
    answers = {A: info(7), B: info(2, state="behind")}
    assert progress.voters(answers, {A, B}) == [info(7)]
    assert progress.committed(progress.voters(answers, {B}), 6) == [info(7)]
    # Alone, or beside a joining peer, it still says nothing about the stage's step.
    assert progress.voters({B: info(2, state="behind")}, {B}) == []
    assert progress.agreed_step(progress.voters({B: info(2, state="behind")}, set())) is None
    alone = {B: info(2, state="behind"), C: info(0, state="joining")}
    assert progress.voters(alone, set()) == [info(0, state="joining")]
    assert progress.uncovered_everywhere(progress.voters({B: info(2, state="behind")}, set()), 6, {48}) == set()


def test_an_id_is_uncovered_when_at_least_half_the_answers_at_the_step_list_it():
    ids = {12, 13, 14, 15}
    honest = info(3, [12, 13])
    assert progress.uncovered_everywhere([], 3, ids) == set()
    assert progress.uncovered_everywhere([honest, info(3, [])], 3, ids) == {12, 13}  # a tie: uncovered
    assert progress.uncovered_everywhere([honest, info(3, []), info(3, [])], 3, ids) == set()
    # One peer listing everything does not outvote two that list nothing (re-sends would be wasted).
    assert progress.uncovered_everywhere([info(3, ids), info(3), info(3)], 3, ids) == set()
    # Answers past the step (the stage committing) or about an older step do not vote.
    assert progress.uncovered_everywhere([honest, info(4), info(3)], 3, ids) == {12, 13}
    assert progress.uncovered_everywhere([info(2, [8]), info(3, [14]), info(3, [14])], 3, ids) == {14}


def test_a_stage_that_lost_its_state_has_everything_uncovered_unless_one_peer_alone_says_otherwise():
    ids = {12, 13}
    assert progress.uncovered_everywhere([info(2), info(2)], 3, ids) == ids
    # One peer claiming the step (or far past it) beside two that lost it hides nothing.
    assert progress.uncovered_everywhere([info(2), info(2), info(1_000_000)], 3, ids) == ids
    assert progress.uncovered_everywhere([info(2), info(3, [12]), info(3, [12])], 3, ids) == {12}


def test_the_loss_watch_counts_an_uncovered_id_after_the_grace_and_forgets_one_covered_again():
    watch = progress.LossWatch(grace_s=1.0)
    lagging = [info(3, [12]), info(3, [])]  # the tie a mate's lagging report makes
    assert watch.lost(lagging, 3, {12, 13}, now=0.0) == {}
    assert watch.lost(lagging, 3, {12, 13}, now=0.5) == {}
    assert watch.lost([info(3), info(3)], 3, {12, 13}, now=0.9) == {}  # the mate saw it: forgotten
    assert watch.lost(lagging, 3, {12, 13}, now=1.5) == {}  # a new grace starts
    assert watch.lost(lagging, 3, {12, 13}, now=2.5) == {12: "uncovered"}
    assert watch.lost([info(3, [], missing=[13])], 3, {12, 13}, now=2.6) == {13: "missing"}
    # `missing` from any peer counts, voter or not (a mate the trainer never used saw the holder leave).
    assert watch.lost([info(3)], 3, {12, 13}, now=2.7, reports=[info(3), info(3, missing=[12])]) == {12: "missing"}


def test_a_peer_that_misses_stage_info_is_skipped_for_a_growing_while_until_it_answers():
    skips = progress.InfoSkips(initial_s=5.0, max_s=12.0)
    assert skips.skipped(0.0) == set()
    skips.missed(A, 0.0)
    assert skips.skipped(4.9) == {A}
    assert skips.skipped(5.0) == set()  # asked again...
    skips.missed(A, 5.0)
    assert skips.skipped(14.9) == {A}  # ... and missed again: skipped twice as long
    skips.missed(A, 15.0)
    assert skips.skipped(26.9) == {A} and skips.skipped(27.0) == set()  # capped at max_s
    skips.missed(A, 27.0)
    skips.answered(A)
    assert skips.skipped(27.1) == set()
    skips.missed(A, 30.0)
    assert skips.skipped(34.9) == {A} and skips.skipped(35.0) == set()  # the answer cleared its record
