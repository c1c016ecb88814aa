"""Every bound a served stage keeps, one named setting each, with the reason for its default.

A stage peer is pushed at by trainers it does not control; each number here caps something a
trainer (or a stage-mate) could otherwise make it hold without end. All are checked before the
memory is taken: a full queue answers `busy` before the request joins it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from swarmd.stage.robust import AGGREGATES
from transport.codecs import CODECS

MiB = 1024 * 1024


@dataclass(frozen=True)
class StageLimits:
    # Microbatches waiting for compute per served stage. A few per trainer keep the device busy;
    # past this a call is answered `busy` at once and the trainer reroutes, so queued tensors (and
    # the memory they pin) are bounded by queue_size x one microbatch, however many trainers push.
    queue_size: int = 16
    # Calls for the next step parked until this peer commits the current one (delayed_updates =
    # false). They hold their decoded tensors while parked, so they are bounded like the queue.
    max_waiting: int = 16
    # Longest such a call waits when its caller set no deadline.
    max_wait_s: float = 30.0
    # Compatible microbatches (same kind, step and shapes) fused into one compute call: larger
    # matmuls use the device better; 4 already fills a CPU core, and each answer is split back out.
    max_batch: int = 4
    # Compute threads per served stage on CPU. Two overlap one batch's Python overhead with another's
    # kernels; more only contend for the same cores.
    workers: int = 2
    # torch intra-op threads (process-wide in torch); None leaves the process setting alone.
    torch_threads: int | None = None
    # How often a peer polls its stage-mates' progress. Rounds start within one period of the last
    # microbatch arriving; 0.1 s is small next to a step of seconds, and costs P-1 tiny calls.
    sync_interval_s: float = 0.1
    # Deadline of one progress call; a mate that cannot answer it is treated as gone for this poll.
    progress_timeout_s: float = 2.0
    # A mate whose progress calls time out (rather than being refused: a killed process refuses at
    # once) may just be overloaded and still hold its gradients; its ids are reported `missing` only
    # after this long, since a re-send while it still holds them would count them twice.
    missing_grace_s: float = 10.0
    # A peer behind the swarm's step with no stage-mate ahead in sight takes up the swarm's step
    # (losing the steps between; StageService._resume_at) only once it has seen that for this long:
    # a mate ahead can be hidden for a moment (a directory read that missed it, a poll that timed
    # out), and a peer that merely lags must download its state, never jump past the updates.
    resume_after_s: float = 10.0
    # A peer invited into a round by a leader with a smaller id does not lead one itself for this
    # long, even where its own view misses that leader (asymmetric views): otherwise two leaders
    # that each see a different member set refuse each other's rounds on every poll.
    defer_s: float = 1.0
    # A leader whose rounds failed here twice in a row is refused for this long, doubled per further
    # failure up to bench_max_s (it may see us but not be reachable from us: its rounds cannot
    # finish); a member whose parts did not arrive in time likewise stays out of this peer's rounds
    # (a straggler catches up by download instead of holding every round hostage).
    bench_s: float = 1.0
    bench_max_s: float = 60.0
    # The longest one all-reduce round (reduce + gather) may take. Each round's own timeout is
    # derived from the bytes each member moves and the slowest member's measured send rate
    # (`allreduce.round_timeout`: round_time_margin x bytes / rate, at least round_timeout_floor_s),
    # capped here; before any rate is measured, this cap. A mate whose parts miss it is benched.
    round_timeout_s: float = 60.0
    # The shortest a round's timeout gets however fast the links look: scheduling noise, a
    # garbage-collection pause, a loaded event loop must not fail a round.
    round_timeout_floor_s: float = 5.0
    # How many times the expected transfer time a round is given: a measured rate is an average,
    # and the gather follows the reduce on the same links.
    round_time_margin: float = 4.0
    # Keep the parameters of the step committed last (one more copy of them) so that a call for
    # that step arriving after the commit (its caller timed out, retried, and the stage committed
    # with the first copy) is still answered exactly, on those parameters, adding nothing: the
    # stages below need its input gradient. False: such a call is answered `stale_step`.
    replay_previous: bool = True
    # Largest tensor payload of one all-reduce message: bounded messages keep a slow link fair to
    # activations travelling on the same connection, and bound what an unknown round can make us hold.
    allreduce_chunk_bytes: int = 4 * MiB
    # Codec of gradient parts between stage-mates; "none" keeps peers bit-identical to the reference.
    allreduce_codec: str = "none"
    # How the reducer of each shard combines its mates' parts: "mean" (exact: every peer steps on
    # the plain sum, what the equivalence tests rely on) or "centered_clip" (robust: a mate's pull
    # is bounded, see swarmd/stage/robust.py for the formula).
    aggregate: str = "mean"
    # centered_clip: bound τ on the distance of a peer's per-sample gradient from the aggregate
    # (whole-stage norm). Honest peers' per-sample gradients differ by about the gradient norm
    # itself, so τ should sit a few times above the clip_norm the job trains with.
    clip_tau: float = 10.0
    # centered_clip: iterations; each moves the aggregate at most τ, and one without clipping
    # lands on the exact mean.
    clip_iterations: int = 3
    # centered_clip: a peer further than this many τ from the aggregate is reported an outlier.
    outlier_factor: float = 2.0
    # Members named in one round (its invitation and parts): the member list is read from a mate
    # before anything is allocated from it; a stage of more peers than this runs no round at all.
    max_round_members: int = 256
    # Rounds a peer buffers parts for at once (its own plus one a mate started first).
    max_open_rounds: int = 2
    # Ids of rounds closed here (finished, failed, aborted) remembered so that their late parts are
    # refused rather than opening a box nobody closes; 16 bytes each. A step rarely sees more than
    # a few failed rounds, and the set is only a backstop beyond that (boxes also expire).
    closed_rounds_kept: int = 256
    # Largest payload of one `stage.state` message (parameters and optimizer state for joiners).
    state_chunk_bytes: int = 4 * MiB
    # `stage.state` downloads served at once: each holds a full copy of the stage's state.
    max_state_streams: int = 2
    # Deadline for downloading a mate's whole state when joining.
    state_timeout_s: float = 300.0
    # Checkpoints kept in the state dir; older ones are removed after a new one is in place.
    checkpoints_kept: int = 2
    # Step records (samples, duplicates, grad norm...) kept for `stage.info`.
    records_kept: int = 64

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "aggregate":
                if value not in AGGREGATES:
                    raise ValueError(f"StageLimits.aggregate must be one of {AGGREGATES}, got {value!r}")
            elif field.name == "allreduce_codec":
                if value not in CODECS:
                    raise ValueError(f"StageLimits.allreduce_codec must be one of {CODECS}, got {value!r}")
            elif field.name == "replay_previous":
                if not isinstance(value, bool):
                    raise ValueError(f"StageLimits.replay_previous must be a bool, got {value!r}")
            elif field.name == "torch_threads":
                if value is not None and (not isinstance(value, int) or value < 1):
                    raise ValueError(f"StageLimits.torch_threads must be None or >= 1, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"StageLimits.{field.name} must be positive, got {value!r}")
