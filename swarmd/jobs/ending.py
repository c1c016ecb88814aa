"""The end of a job, swarm-wide: a record the job's submitter signs once the job finished or was cancelled.

Why a record of its own: a job's state used to live only in the daemon running its trainers, so
every other daemon kept serving a finished job's stages (and `serve = "all"` daemons kept joining
it) until they drained. The `jobs` index cannot say it either: a job missing from it may just have
a submitter that is restarting.

DHT layout: `("job", job_id, "end")`, subkey the signer's peer id (the DHT's peer rule, so the
signature is checked by every storer and reader), value msgpack `{state, step, at, by}`. Only the
record signed by the job's submitter counts: the job id is a hash of the spec and that public key,
so nobody else can end a job, and a record anyone else stores under the key is refused (and
logged once) by every reader.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack

from swarmd.dht import dht_key

#: The final states a job can reach swarm-wide ("failed" stays local: another trainer may go on).
END_STATES = ("done", "cancelled")
#: Characters of `by` (who ended the job) kept from a record; a longer one is refused.
MAX_BY_CHARS = 200
#: Bytes of an end record's value decoded at most (a real one takes under 300).
MAX_END_BYTES = 1024


def end_key(job_id: bytes) -> bytes:
    return dht_key("job", job_id, "end")


@dataclass(frozen=True)
class JobEnd:
    """How a job ended: `state` at committed `step`, at wall time `at`, by whom (a sentence)."""

    state: str
    step: int
    at: float
    by: str

    def to_msgpack(self) -> bytes:
        return msgpack.packb({"state": self.state, "step": self.step, "at": self.at, "by": self.by},
                             use_bin_type=True)

    @classmethod
    def from_msgpack(cls, value: bytes, steps: int) -> "JobEnd":
        """Decode and check a record's value; raises ValueError naming what is wrong."""
        if len(value) > MAX_END_BYTES:
            raise ValueError(f"{len(value)} bytes, over MAX_END_BYTES ({MAX_END_BYTES})")
        try:
            fields = msgpack.unpackb(value, raw=False, max_str_len=MAX_END_BYTES, max_bin_len=0,
                                     max_array_len=0, max_map_len=8)
        except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData) as exc:
            raise ValueError(f"not msgpack: {exc}") from None
        if not isinstance(fields, dict):
            raise ValueError("not a map")
        state, step, at, by = (fields.get(k) for k in ("state", "step", "at", "by"))
        if state not in END_STATES:
            raise ValueError(f"state {state!r} is not one of {END_STATES}")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= steps:
            raise ValueError(f"step {step!r} is not in 0..{steps}")
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
            raise ValueError(f"at {at!r} is not a time")
        if not isinstance(by, str) or len(by) > MAX_BY_CHARS:
            raise ValueError(f"by is not a string of at most {MAX_BY_CHARS} characters")
        return cls(state, step, float(at), by)

    def text(self) -> str:
        """For people: `finished at step 4 (its trainers finished)`, `cancelled at step 2 by ...`."""
        if self.state == "done":
            return f"finished at step {self.step} ({self.by})"
        return f"cancelled at step {self.step} by {self.by}"

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state, "step": self.step, "at": self.at, "by": self.by}


def submitters_end(records: dict[bytes, Any], submitter: bytes, steps: int) -> tuple[JobEnd | None, list[bytes]]:
    """The end the submitter signed among `records` (the DHT's verified records under `end_key`),
    and the peer ids of everyone else who stored one there (forgers: never believed)."""
    end, forgers = None, []
    for record in records.values():
        if record.public_key != submitter:
            forgers.append(record.signer or record.subkey)
            continue
        try:
            end = JobEnd.from_msgpack(record.value, steps)
        except ValueError:
            continue
    return end, forgers
