"""The pure parts of automatic joining: the `jobs.serve` setting, which jobs it admits, the join
rule's capacity view, and the served-stages file (atomic, and a damaged one set aside)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from waiting import until

from swarmd.cli import parser
from swarmd.config import ConfigError
from swarmd.config import load as load_config
from swarmd.errors import Busy
from swarmd.jobs.joining import Joining, admits, capacity_table, join_stage
from swarmd.jobs.registry import Job
from swarmd.jobs.remembered import FILE_NAME, RememberedStages
from swarmd.rebalance.policy import choose_join_stage
from swarmd.supervisor import Backoff, Faults, Supervisor
from transport.errors import ConnectionLost
from transport.identity import Identity


def load(argv: list[str], env: dict[str, str]):
    return load_config(parser().parse_args(argv), env)


def test_serve_setting_from_toml_flags_and_variables(tmp_path) -> None:
    assert load([], {}).jobs.serve == "none"  # docs/security.md: a stranger's job is opt-in
    assert load([], {"SWARMD_JOBS_SERVE": "none"}).jobs.serve == "none"
    assert load([], {"SWARMD_JOBS_SERVE": "tiny, abc"}).jobs.serve == frozenset({"tiny", "abc"})
    cfg = tmp_path / "d.toml"
    cfg.write_text('[jobs]\nserve = ["tiny", "big"]\n')
    assert load(["--config", str(cfg)], {}).jobs.serve == frozenset({"tiny", "big"})
    for bad in ("serve = []", "serve = 3", 'serve = ["ok", 1]'):
        cfg.write_text(f"[jobs]\n{bad}\n")
        with pytest.raises(ConfigError) as refused:
            load(["--config", str(cfg)], {})
        assert "serve" in str(refused.value)


def test_serve_rule_admits_by_name_or_submitter() -> None:
    submitter = Identity.generate()
    job = SimpleNamespace(spec=SimpleNamespace(name="tiny"), submitter=submitter.public_key)
    assert admits("all", job) and not admits("none", job)
    assert admits(frozenset({"tiny"}), job) and not admits(frozenset({"other"}), job)
    assert admits(frozenset({submitter.public_key.hex()}), job)
    assert admits(frozenset({submitter.peer_id.hex()}), job)


def stage(index: int, *peers: tuple) -> dict:
    """Peers as `stage_peers` gives them: (id, speed, state[, reachable]); an unreachable one did
    not answer the prober's call."""
    return {"stage": index, "peers": [{"peer_id": pid * 32, "samples_per_s": speed, "state": state,
                                       "reachable": reachable, "serves": reachable and state == "serving"}
                                      for pid, speed, state, reachable in (p + (True,) * (4 - len(p)) for p in peers)]}


def test_capacity_counts_unmeasured_peers_and_prefers_empty_stages() -> None:
    # An idle new peer (0 samples/s measured) still beats no peer at all.
    stages = [stage(0, ("aa", 0.0, "serving")), stage(1), stage(2, ("bb", 5.0, "serving"))]
    table = capacity_table(stages)
    assert table.expected == [5.0, 0.0, 5.0]
    assert choose_join_stage(table, me=b"x") == 1
    # A peer announcing "joining" counts (so others do not pile on); draining ones do not.
    stages = [stage(0, ("aa", 4.0, "serving")), stage(1, ("cc", 0.0, "joining")), stage(2, ("dd", 9.0, "draining"))]
    assert choose_join_stage(capacity_table(stages), me=b"x") == 2
    # One daemon serving two stages is one row per stage.
    stages = [stage(0, ("aa", 2.0, "serving")), stage(1, ("aa", 3.0, "serving"))]
    assert capacity_table(stages).expected == [2.0, 3.0]


def test_only_peers_that_answered_count_and_a_claim_is_bounded_by_the_others() -> None:
    # A record nobody answers for (a fake claiming 10^12 samples/s) counts nothing: stage 0 is empty.
    stages = [stage(0, ("ee", 1e12, "serving", False)), stage(1)]
    assert capacity_table(stages).expected == [0.0, 0.0]
    stages = [stage(0, ("ee", 1e12, "serving", False)), stage(1, ("aa", 0.0, "joining"))]
    assert choose_join_stage(capacity_table(stages), me=b"x") == 0
    # A peer that answers but lies counts at most CLAIM_FACTOR times the lower median claim.
    from swarmd.rebalance.table import CLAIM_FACTOR
    stages = [stage(0, ("ee", 1e12, "serving")), stage(1, ("aa", 5.0, "serving"), ("bb", 5.0, "serving"))]
    assert capacity_table(stages).expected == [5.0 * CLAIM_FACTOR, 10.0]


def test_daemons_joining_at_once_spread_as_if_they_came_one_at_a_time() -> None:
    """The auto-join chaos test once had four of five daemons on one stage of two: three decided in
    the same instant, each counting only the first stage's server. Placing every announced joiner in
    peer-id order, whatever stage it first announced, gives all of them one placement."""
    ids = [bytes([i]) * 32 for i in range(1, 5)]

    def view(announced: dict[bytes, int]) -> list[dict]:
        stages = [stage(0, ("00", 3.0, "serving")), stage(1)]
        for pid, where in announced.items():
            stages[where]["peers"].append({"peer_id": pid.hex(), "samples_per_s": 0.0, "state": "joining",
                                           "reachable": True, "serves": False})
        return stages

    for first in ({i: 0 for i in ids}, {i: 1 for i in ids}, dict(zip(ids, (0, 1, 0, 1)))):
        placed = [join_stage(view(first), me) for me in ids]
        # Every peer counts 3.0 (the unmeasured ones at the measured median): 5 peers split 2/3 or 3/2.
        assert sorted((1 + placed.count(0), placed.count(1))) == [2, 3], (first, placed)
        # Each daemon's own announcement moved to where it decided: the placement stands.
        assert [join_stage(view(dict(zip(ids, placed))), me) for me in ids] == placed
    # Alone (nobody else announced), a daemon decides as the plain join rule does.
    assert join_stage(view({}), ids[0]) == choose_join_stage(capacity_table(view({})), me=ids[0]) == 1


def test_a_stage_of_one_is_filled_before_capacity_counts() -> None:
    """The auto-join chaos test on a loaded CI machine left peer0 alone on stage 0 (it measured
    fast) and four peers on stage 1: by capacity alone, 3 x 3.0 < 10.0 sent the fourth to stage 1,
    and a failure of peer0 would stop the job. With `min_stage_peers` 2, stage 0 comes first."""
    stages = [stage(0, ("00", 10.0, "serving")),
              stage(1, ("aa", 3.0, "serving"), ("bb", 3.0, "serving"), ("cc", 3.0, "serving"))]
    assert choose_join_stage(capacity_table(stages), me=b"x") == 1
    assert choose_join_stage(capacity_table(stages), me=b"x", min_peers=2) == 0
    assert join_stage(stages, b"\xdd" * 32, min_peers=2) == 0
    # A joining peer counts toward the two: once stage 0 has its second, capacity decides again.
    stages[0]["peers"].append({"peer_id": "ee" * 32, "samples_per_s": 0.0, "state": "joining",
                               "reachable": True, "serves": False})
    assert choose_join_stage(capacity_table(stages), me=b"x", min_peers=2) == 1
    # Every stage below the minimum: the emptiest capacity first, as before.
    stages = [stage(0, ("00", 10.0, "serving")), stage(1), stage(2, ("aa", 3.0, "serving"))]
    assert choose_join_stage(capacity_table(stages), me=b"x", min_peers=2) == 1
    # Daemons joining at once with the rule: five daemons and two stages always end 2/3 or 3/2.
    ids = [bytes([i]) * 32 for i in range(1, 5)]
    for fast in (0.5, 3.0, 10.0, 100.0):
        view = [stage(0, ("00", fast, "serving")), stage(1)]
        for pid in ids:
            view[1]["peers"].append({"peer_id": pid.hex(), "samples_per_s": 0.0, "state": "joining",
                                     "reachable": True, "serves": False})
        placed = [join_stage(view, me, min_peers=2) for me in ids]
        assert min(1 + placed.count(0), placed.count(1)) >= 2, (fast, placed)


def test_remembered_stages_round_trip_and_damage(tmp_path) -> None:
    memory = RememberedStages(tmp_path)
    assert memory.load() == []
    keys = {(b"\x01" * 32, 0), (b"\x02" * 32, 2)}
    memory.save(keys)
    assert set(memory.load()) == keys
    assert json.loads((tmp_path / FILE_NAME).read_text())["format"] == 1
    assert [p.name for p in tmp_path.iterdir()] == [FILE_NAME]  # no temp file left
    (tmp_path / FILE_NAME).write_text('{"format": 1, "stages": [{"job": "zz", "stage": 0}]}')
    assert memory.load() == []
    assert (tmp_path / (FILE_NAME + ".bad")).exists() and not (tmp_path / FILE_NAME).exists()


class OneJob:
    """What a join tick reads of the registry and the DHT: one listed two-stage job, no peers."""

    def __init__(self, ended: bool = False) -> None:
        spec = SimpleNamespace(name="j", pipeline=SimpleNamespace(stages=2))
        self.job = Job(b"j" * 32, spec, b"s" * 32, local=False)
        self.job.ended = SimpleNamespace(text=lambda: "finished") if ended else None
        self.jobs, self.listed, self.dht = {self.job.job_id: self.job}, {self.job.job_id}, self
        self.withdrawn: list = []

    async def refresh(self) -> None: ...
    async def settle(self) -> None: ...
    def publish_progress(self) -> None: ...

    async def stage_peers(self, job: Job) -> list[dict]:
        return [{"stage": i, "peers": []} for i in range(2)]

    def announce(self, key, value_fn):
        return key

    async def withdraw(self, announcement) -> None:
        self.withdrawn.append(announcement)


class FailingServing:
    """A daemon's `Serving` whose joins and leaves raise `error`."""

    address = "127.0.0.1:1"

    def __init__(self, error: BaseException, served: dict | None = None) -> None:
        self.error, self.served = error, served or {}

    async def serve(self, spec, job_id: bytes, stage: int, *, submitter: bytes) -> None:
        raise self.error

    async def leave(self, job_id: bytes, stage: int) -> None:
        raise self.error


def joining_over(registry: OneJob, serving: FailingServing, faults: Faults) -> Joining:
    return Joining(registry, serving, None, peer_id=b"p" * 32, serve="all", max_stages=4, interval_s=0.01,
                   rejoin_wait_s=60.0, settle_s=0.0, min_stage_peers=1,
                   supervisor=Supervisor("joining", faults, Backoff(0.01, 0.01)))


@pytest.mark.parametrize("error", [Busy("over jobs.max_stage_memory"), ConnectionLost("reset"), OSError("disk"),
                                   TimeoutError()])
@pytest.mark.parametrize("ended", [False, True])
async def test_an_expected_join_or_leave_failure_is_logged_and_the_tick_goes_on(error, ended) -> None:
    """A join (the job running) or a leave (the job ended) failing as stages do is tried again on a
    later tick; a failed join's 'joining' intent is withdrawn."""
    registry = OneJob(ended)
    serving = FailingServing(error, {(registry.job.job_id, 0): object()} if ended else None)
    await joining_over(registry, serving, Faults()).tick()
    assert ended or registry.withdrawn


@pytest.mark.parametrize("ended", [False, True])
async def test_an_unexpected_join_or_leave_error_reaches_the_supervisor_and_status(ended) -> None:
    """A bug in a join or a leave (a KeyError) is not logged as a failed join and retried each tick:
    it ends the tick, with the intent withdrawn, and the Supervisor running the loop records it in
    the daemon's faults (what `swarmctl status` shows under "supervision")."""
    registry, faults = OneJob(ended), Faults()
    serving = FailingServing(KeyError("a bug"), {(registry.job.job_id, 0): object()} if ended else None)
    joining = joining_over(registry, serving, faults)
    with pytest.raises(KeyError):
        await joining.tick()
    assert ended or registry.withdrawn
    loop = asyncio.create_task(joining.supervisor.run("poll jobs", joining._poll_forever))
    await until(lambda: faults.get("joining: poll jobs") is not None, 10, "the fault recorded")
    loop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loop
    assert "KeyError" in faults.get("joining: poll jobs").last_error
