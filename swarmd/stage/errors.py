"""The typed refusals a stage peer answers with; each tells the trainer what to do next.

They travel as `transport.errors.RpcError(code, message)` and arrive as `RemoteError.code`:
`busy` reroute without ban, `bad_input` the input is at fault, `not_serving` ban until
re-announced, `stale_step` re-check the stage's step, `not_ready` retry after the stage commits.
Between stage-mates only: `protocol_mismatch`, a round RPC of another round protocol version
(sync.ROUND_PROTOCOL): such a mate is no round member.
"""

from __future__ import annotations

from transport.errors import RpcError

from swarmd.errors import LocalError, SwarmdError

BUSY = "busy"
BAD_INPUT = "bad_input"
NOT_SERVING = "not_serving"
STALE_STEP = "stale_step"
NOT_READY = "not_ready"
PROTOCOL_MISMATCH = "protocol_mismatch"


def busy(message: str) -> RpcError:
    return RpcError(BUSY, message)


def bad_input(message: str) -> RpcError:
    return RpcError(BAD_INPUT, message)


def not_serving(message: str) -> RpcError:
    return RpcError(NOT_SERVING, message)


def not_ready(message: str) -> RpcError:
    return RpcError(NOT_READY, message)


def protocol_mismatch(message: str) -> RpcError:
    return RpcError(PROTOCOL_MISMATCH, message)


class AlreadyServed(LocalError):
    """This daemon already serves that stage of that job: a second service would answer the same
    calls from a second copy of the parameters."""


class StaleStep(SwarmdError):
    """Work for a step this peer already committed; raised from the compute thread."""

    def __init__(self, step: int, committed: int) -> None:
        super().__init__(f"step {step} is already committed here; this peer is at step {committed}")
        self.step, self.committed = step, committed

    def to_rpc(self) -> RpcError:
        return RpcError(STALE_STEP, str(self))


class RoundFailed(SwarmdError):
    """An all-reduce round could not complete (a mate vanished, timed out or disagreed); the
    gradients it took are put back and the round is retried with whoever is left."""
