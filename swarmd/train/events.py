"""What a trainer tells the world as it goes (for `swarmctl logs --follow` and the job view)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from swarmd.train.evaluation import EvalResult


@dataclass(frozen=True)
class StepEvent:
    """Step `step` is committed by every stage, with this trainer's share of the work done."""

    step: int
    shard_loss: float  # sum of this trainer's sample-summed losses / their samples (nan: none known)
    # The step's mean loss over the global batch; known when this trainer did every microbatch.
    global_loss: float | None
    samples: int  # samples this trainer pushed through the pipeline this step (its share and what it took over)
    tokens_per_s: float  # this trainer's tokens over the step's wall time (until every stage committed)
    elapsed_s: float
    retries: int  # RPC attempts this step that had to go elsewhere (timeouts, busy, errors, bad replies)
    bans: int  # peers banned this step
    resent: int  # backward calls re-sent because a stage reported their microbatches missing
    peers_per_stage: tuple[int, ...]  # usable (announced, not banned) peers per stage at the end
    stage_samples: tuple[int, ...]  # per stage, samples its peers summed for the step (-1: not reported)
    duplicates: tuple[int, ...]  # per stage, microbatches counted twice (across or on peers); -1: unknown
    taken_over: int = 0  # microbatches of other trainers' shares this trainer did (they looked undone)
    # Microbatches whose answer a stage committed past before this trainer got it: the stages below
    # it summed a zero gradient for them (docs/trainer.md, "No trainer dies of a late reply").
    answers_lost: int = 0
    # The held-out evaluation of the parameters this step produced (version step + 1), when one was
    # due ([eval] every_steps, and the last step) and this trainer evaluates (shard 0); its `loss`
    # is None when it was given up (`why` says why).
    evaluation: EvalResult | None = None


@dataclass(frozen=True)
class StatusEvent:
    """The trainer is waiting for something it cannot fix itself (e.g. "stage 1 has no peers"),
    or stopped waiting (`message` empty)."""

    message: str


TrainerEvent = StepEvent | StatusEvent
EventSink = Callable[[TrainerEvent], None]
"""Called on the event loop for every event; pass `queue.put_nowait` to get an async stream."""
