"""swarmproc's job helpers without daemons: `serve_when_known` against a stand-in control client."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmd import swarmproc
from swarmd.client import ControlError
from swarmd.swarmproc import PeerProcess, serve_when_known


class Answers:
    """A control client whose `serve` raises, then answers, from a script shared by every instance."""

    script: list = []
    calls: list = []

    def __init__(self, path, *, timeout: float) -> None:
        self.timeout = timeout

    async def __aenter__(self) -> "Answers":
        return self

    async def __aexit__(self, *exc_info) -> None:
        return None

    async def serve(self, job: str, stage: int | None) -> dict:
        Answers.calls.append((job, stage, self.timeout))
        answer = Answers.script.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


@pytest.fixture
def answers(monkeypatch) -> type[Answers]:
    monkeypatch.setattr(swarmproc, "Client", Answers)
    monkeypatch.setattr(swarmproc, "JOB_UNKNOWN_RETRY_S", 0.0)
    Answers.calls = []
    return Answers


PEER = PeerProcess("p", Path("/nonexistent"), 1, ())


async def test_a_daemon_that_has_not_read_the_job_yet_is_asked_again(answers) -> None:
    answers.script = [ControlError("not_found", "no such job"), ControlError("not_found", "no such job"),
                      {"stage": 1}]
    assert await serve_when_known(PEER, "j", 1, discovery_s=60.0, timeout=7.0) == {"stage": 1}
    assert answers.calls == [("j", 1, 7.0)] * 3


@pytest.mark.parametrize(("error", "discovery_s"), [(ControlError("not_available", "no stages here"), 60.0),
                                                    (ControlError("not_found", "no such job"), -1.0)])
async def test_another_refusal_or_a_job_unknown_past_the_bound_is_raised(answers, error, discovery_s) -> None:
    answers.script = [error, {"stage": 0}]
    with pytest.raises(ControlError) as raised:
        await serve_when_known(PEER, "j", None, discovery_s=discovery_s)
    assert raised.value is error and len(answers.calls) == 1
