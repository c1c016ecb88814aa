"""Every bound a served stage keeps, one named setting each, with the reason for its default.

A stage peer is pushed at by trainers it does not control; each number here caps something a
trainer (or a stage-mate) could otherwise make it hold without end. All are checked before the
memory is taken: a full queue answers `busy` before the request joins it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from swarmd.stage.errors import busy
from swarmd.stage.packing import ALLREDUCE_CODECS
from swarmd.stage.robust import AGGREGATES

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
    # Of those, parked for one caller (the peer id its connection proved): a trainer keeps
    # `microbatches_in_flight` (4 by default) calls in flight, so 8 leave it room, and one stranger's
    # calls leave the other half of the slots to everyone else's next-step calls.
    max_waiting_per_peer: int = 8
    # How many steps past the one this peer accepts work for a compute call may park for. The next
    # step's calls arrive while the current step commits; work further ahead reaches only a peer
    # behind its stage, and such a call parks only while this peer is about to move: a mate ahead
    # to download from, or its looks find the swarm at that step (`StageService._resume_at`). Any
    # other call further ahead is answered `not_ready` at once: parked, it would hold a slot (and
    # its tensors) up to max_wait_s.
    max_steps_ahead: int = 1
    # `stage.info` long-polls (until_step, wait_s) held at once, in all and per caller. They hold no
    # tensors, and they have slots of their own, apart from max_waiting: a stranger's long-polls must
    # not take the slots the trainers' next-step compute calls park in. A trainer's commit watch
    # holds one per peer it watches; past these, a long-poll is answered at once, as a plain
    # stage.info (the caller polls).
    max_watchers: int = 64
    max_watchers_per_peer: int = 4
    # Longest such a long-poll (or a parked compute call) waits, whatever its caller asked.
    max_wait_s: float = 30.0
    # Compatible microbatches (same kind, step and shapes) fused into one compute call: larger
    # matmuls use the device better; 4 already fills a CPU core, and each answer is split back out.
    max_batch: int = 4
    # Compute threads per served stage on CPU. Two overlap one batch's Python overhead with another's
    # kernels; more only contend for the same cores.
    workers: int = 2
    # torch intra-op threads (process-wide in torch); None leaves the process setting alone.
    torch_threads: int | None = None
    # How often a peer polls stage-mates' progress (`polled_mates` of them). 0.1 s is small next to a
    # step of seconds, and costs one tiny call per polled mate.
    sync_interval_s: float = 0.1
    # Mates a peer polls per sync tick, round robin (a join and a look before skipping lost steps
    # poll them all). Per-peer control traffic then stays the same however large the stage grows;
    # the price is staleness: a mate's view is refreshed every mates / polled_mates ticks, so a
    # round of a stage of P peers starts up to (P - 1) / polled_mates ticks after the step is
    # covered, and a dead mate's ids are reported that much later.
    polled_mates: int = 1
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
    # A peer that got no compute call for this many of its consecutive steps is idle (a peer the
    # trainers withhold for slowness, or one more than the microbatches in flight need): it stops
    # downloading its stage's state every step its mates commit (parameters and optimizer state,
    # served by a mate, about 3x its all-reduce share for Adam) and catches up lazily instead. 4
    # steps outlast a step or two without work by chance (a trainer's pick, a re-send elsewhere);
    # a compute call for a later step makes it catch up at once, the call waiting for it.
    idle_after_steps: int = 4
    # An idle peer still catches up at least this often: a call that comes back (a trainer's probe,
    # every slow_probe_s = 20 s, or all of the work when its mates die) then waits for one download
    # of a state at most this old, and a stage whose working peers all die at once loses at most
    # this many seconds of steps with them (a far-behind survivor takes the swarm's step up,
    # `resume_after_s`). 10 s: a download or two per probe period, instead of one per step. (Once
    # its mates finished the job it catches up at once: its state is what the job leaves behind.)
    idle_catch_up_s: float = 10.0
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
    # The longest one all-reduce phase (reduce-scatter, all-gather) may take. Each phase's deadline
    # is derived from the bytes each member sends in that phase and its own measured send rate
    # (`allreduce.phase_deadlines`: round_time_margin x bytes / rate, at least round_timeout_floor_s),
    # capped here; before any rate is measured, this cap. A mailbox box expires after twice it.
    round_timeout_s: float = 60.0
    # The shortest a round's timeout gets however fast the links look: scheduling noise, a
    # garbage-collection pause, a loaded event loop must not fail a round.
    round_timeout_floor_s: float = 5.0
    # A member whose measured all-reduce send rate is below this fraction of its round's fastest
    # member's owns no shard in the rounds this peer leads (`allreduce.choose_owners`): it sends its
    # vector once and the all-gather never waits on its uplink.
    owner_min_rate_fraction: float = 0.25
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
    # Codec of gradient parts between stage-mates (`packing.ALLREDUCE_CODECS`). fp16 (each piece
    # scaled by a power of two, so nothing overflows) halves the bytes every member sends, the
    # all-reduce's whole cost on a slow link; every member still steps on one bit-identical averaged
    # gradient (I2), within fp16's rounding (2^-11 relative) of the exact sum. "none" keeps fp32:
    # steps bit-for-bit those of the single-process reference. A daemon's stage takes the job's
    # choice (`[wire] allreduce`, swarmd.jobs.serving.job_limits).
    allreduce_codec: str = "fp16"
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
    # Of those, served to one caller at once: a joiner downloads one state at a time; a second
    # stream would only keep a slot from another joiner.
    max_state_streams_per_peer: int = 1
    # A state stream whose reader stops reading must not keep its slot (nor its copy of the state):
    # each message must be taken by the transport (which waits for the reader's window) within
    # state_stall_s plus the time its bytes and the previous message's (which must leave first)
    # take at state_min_rate_bytes_s, or the stream is ended. 256 KiB/s (2 Mbit/s) is below any
    # link a stage peer trains over; 5 s absorbs a loaded event loop or a pause. A stalled stream
    # then holds a slot for about 5 s plus a chunk's time, not for as long as its reader likes.
    state_stall_s: float = 5.0
    state_min_rate_bytes_s: float = 256 * 1024
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
                if value not in ALLREDUCE_CODECS:
                    raise ValueError(f"StageLimits.allreduce_codec must be one of {ALLREDUCE_CODECS}, got {value!r}")
            elif field.name == "replay_previous":
                if not isinstance(value, bool):
                    raise ValueError(f"StageLimits.replay_previous must be a bool, got {value!r}")
            elif field.name == "owner_min_rate_fraction":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                    raise ValueError(f"StageLimits.owner_min_rate_fraction must be in (0, 1], got {value!r}")
            elif field.name == "torch_threads":
                if value is not None and (not isinstance(value, int) or value < 1):
                    raise ValueError(f"StageLimits.torch_threads must be None or >= 1, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"StageLimits.{field.name} must be positive, got {value!r}")


class Slots:
    """A bounded number of held slots, in all and per caller (the peer id the transport proved;
    None for a connection without one, all such callers sharing one count). Refusals are `busy`
    and name the limit. The per-caller table holds only callers holding a slot, so it is bounded
    by the total."""

    def __init__(self, what: str, limit: int, limit_name: str, per_caller: int, per_caller_name: str) -> None:
        self.what, self.limit, self.per_caller = what, limit, per_caller
        self._names = (limit_name, per_caller_name)
        self.total = 0
        self._held: dict[bytes | None, int] = {}

    def held_by(self, caller: bytes | None) -> int:
        return self._held.get(caller, 0)

    def free(self, caller: bytes | None) -> bool:
        """Whether `hold(caller)` would take a slot now rather than refuse."""
        return self.total < self.limit and self.held_by(caller) < self.per_caller

    @contextlib.contextmanager
    def hold(self, caller: bytes | None) -> Iterator[None]:
        if self.total >= self.limit:
            raise busy(f"{self.total} {self.what} already ({self._names[0]})")
        held = self._held.get(caller, 0)
        if held >= self.per_caller:
            raise busy(f"{held} {self.what} already for this caller ({self._names[1]})")
        self.total += 1
        self._held[caller] = held + 1
        try:
            yield
        finally:
            self.total -= 1
            left = self._held[caller] - 1
            if left:
                self._held[caller] = left
            else:
                del self._held[caller]
