"""An end record's `by` is shown to people (`swarmctl job`, `jobs`) and written to every daemon's
log ("left stage 0 of job X: the job cancelled at step 2 by ..."), so it must be printable text
(adversary's attack): a submitter's `by` of "\\nERROR ..." forged log lines on every daemon serving
the job, and one of terminal escapes ("\\x1b]0;...\\x07", "\\x1b[2J") reached other users' terminals."""

from __future__ import annotations

import pytest

from swarmd.values import JobEnd, ValueRefused, decode_end


@pytest.mark.parametrize("by", ["alice\nERROR swarmd.daemon: forged line", "\x1b[2J\x1b]0;owned\x07", "bob\r", "a\x00b"])
def test_an_end_record_whose_by_is_not_printable_is_refused(by: str) -> None:
    value = JobEnd("cancelled", 2, 1_800_000_000.0, by).to_msgpack()
    with pytest.raises(ValueRefused, match="bad_job_end"):
        decode_end(value, 10)


def test_a_printable_by_in_any_script_passes() -> None:
    value = JobEnd("cancelled", 2, 1_800_000_000.0, "swarmctl cancel by Zoë (uid 1000) — 早").to_msgpack()
    assert decode_end(value, 10).by.startswith("swarmctl cancel by Zoë")
