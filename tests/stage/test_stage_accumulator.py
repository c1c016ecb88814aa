"""Accumulator on its own: per-step gradient sums with the ids behind them, taken out for a round,
put back or dropped, finished at a commit; adds from many threads sum exactly."""

from __future__ import annotations

import threading

import pytest
import torch

from swarmd.stage.accumulator import Accumulator


def grads(value: float) -> list[torch.Tensor | None]:
    """Two parameters' gradients, the second absent (a parameter the microbatch did not reach)."""
    return [torch.full((3,), value), None]


def test_adds_of_a_step_are_summed_with_their_ids_and_samples():
    acc = Accumulator(2)
    acc.add(0, [0, 1], 4, grads(1.0))
    acc.add(0, [2], 2, grads(2.0))
    acc.add(1, [4], 2, grads(5.0))
    assert acc.progress(0).ids == {0, 1, 2} and acc.progress(0).samples == 6
    assert acc.progress(1).ids == {4} and acc.progress(2).ids == frozenset()
    taken = acc.take(0)
    assert torch.equal(taken.grads[0], torch.full((3,), 3.0)) and taken.grads[1] is None


def test_a_taken_sum_stays_visible_and_a_failed_round_merges_it_with_late_adds():
    acc = Accumulator(2)
    acc.add(0, [0], 2, grads(1.0))
    taken = acc.take(0)
    assert acc.progress(0).ids == {0}  # in a round: still held
    acc.add(0, [1], 2, grads(10.0))  # lands during the round: a fresh sum
    assert acc.progress(0).ids == {0, 1} and acc.progress(0).samples == 4
    assert torch.equal(taken.grads[0], torch.full((3,), 1.0))  # the round's sum did not change
    acc.restore(0)
    merged = acc.take(0)
    assert torch.equal(merged.grads[0], torch.full((3,), 11.0))
    assert merged.ids == {0, 1} and merged.samples == 4


def test_a_step_is_in_one_round_at_a_time():
    acc = Accumulator(2)
    acc.take(0)  # nothing arrived: an empty sum
    with pytest.raises(RuntimeError, match="already in a round"):
        acc.take(0)


def test_discard_taken_drops_the_rounds_sum_and_keeps_what_arrived_meanwhile():
    acc = Accumulator(2)
    acc.add(0, [0, 1], 4, grads(1.0))
    acc.take(0)
    acc.add(0, [2], 2, grads(3.0))
    assert acc.discard_taken(0) == {0, 1}
    assert acc.progress(0).ids == {2}
    assert acc.discard_taken(0) == frozenset()
    acc.restore(0)  # nothing taken any more: no effect
    assert acc.progress(0).ids == {2}


def test_finish_counts_late_arrivals_and_drops_the_step_and_earlier_ones():
    acc = Accumulator(2)
    acc.add(0, [0], 2, grads(1.0))
    acc.add(1, [4], 2, grads(1.0))
    acc.add(2, [8], 2, grads(1.0))
    acc.take(1)
    acc.add(1, [5, 6], 4, grads(1.0))  # after the round took the sum: copies a member held
    assert acc.finish(1) == 2
    assert acc.progress(0).ids == frozenset() and acc.progress(1).ids == frozenset()
    assert acc.progress(2).ids == {8}
    acc.take(1)  # step 1's round is over: a new take is allowed (and empty)


def test_clear_forgets_every_step():
    acc = Accumulator(2)
    acc.add(0, [0], 2, grads(1.0))
    acc.take(0)
    acc.add(1, [4], 2, grads(1.0))
    acc.clear()
    assert acc.progress(0).ids == frozenset() and acc.progress(1).ids == frozenset()


def test_adds_from_many_threads_sum_exactly():
    """Eight threads add 50 microbatches each (values exact in fp32) while the test thread reads
    progress: the sum, ids and samples are exactly all of them."""
    acc = Accumulator(2)
    start = threading.Barrier(9)

    def adder(t: int) -> None:
        start.wait()
        for i in range(50):
            acc.add(0, [t * 50 + i], 1, grads(1.0))

    threads = [threading.Thread(target=adder, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    start.wait()
    seen = 0
    while any(thread.is_alive() for thread in threads):
        now = len(acc.progress(0).ids)
        assert now >= seen  # ids never vanish while adds go on
        seen = now
    for thread in threads:
        thread.join()
    total = acc.take(0)
    assert total.ids == set(range(400)) and total.samples == 400
    assert torch.equal(total.grads[0], torch.full((3,), 400.0))
