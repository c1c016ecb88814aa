"""What stops a trainer: everything else (dead peers, timeouts, bad replies) is retried elsewhere."""

from __future__ import annotations

from swarmd.errors import SwarmdError


class TrainerError(SwarmdError):
    """The trainer cannot go on with this job; the message says why and what to look at."""


class InputRefused(TrainerError):
    """Several peers refused the same input as `bad_input`: the input is at fault, not the peers."""
