"""The daemon-side wiring of rebalancing, without processes: settings, the per-job gossip dispatch,
and the refusals of `Serving.move` that must leave everything as it was (the moves themselves run in
tests/rebalance/test_rebalance_daemons.py, between real daemons)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from swarmd.config import RebalanceSection
from swarmd.directory import StagePeer, StaticDirectory
from swarmd.errors import ConfigError
from swarmd.jobs.rebalancing import GossipDispatch, JobRebalancer, RebalanceSettings, Rebalancing
from swarmd.jobs.serving import Served, Serving
from swarmd.rebalance.gossip import METHOD
from swarmd.rebalance.mover import MoveFailed
from swarmd.rebalance.policy import PolicyConfig
from swarmd.stage.limits import StageLimits
from swarmd.supervisor import Faults, Supervisor
from transport.errors import RpcError
from transport.identity import Identity
from transport.message import Message

JOB, OTHER = b"j" * 32, b"o" * 32
ME = b"m" * 32


def test_settings_carry_the_section_into_the_policy_and_refuse_impossible_jitter() -> None:
    settings = RebalanceSettings.from_section(RebalanceSection())
    assert settings.enabled and settings.policy == PolicyConfig()
    assert settings.gossip.period_s == 5.0 and settings.gossip.members_ttl_s == 15.0
    with pytest.raises(ValueError, match="jitter"):
        RebalanceSettings.from_section(RebalanceSection(jitter=1.5))


@pytest.mark.parametrize(("setting", "key"), [({"jitter": 1.5}, "jitter"),
                                               ({"gossip_interval_s": 0.0}, "gossip_interval_s"),
                                               ({"gossip_max_entries": 10**6}, "gossip_max_entries")])
def test_a_refused_setting_is_a_config_error_under_its_section_key(setting: dict, key: str) -> None:
    """The policy's and the gossip's own checks reach the daemon as `ConfigError`, keyed by the
    `[rebalance]` setting an operator writes (not the gossip's field name)."""
    with pytest.raises(ConfigError) as refused:
        RebalanceSettings.from_section(RebalanceSection(**setting))
    assert (refused.value.key, refused.value.source) == (key, "[rebalance]")


class OneMethodRouter:
    def __init__(self) -> None:
        self.handlers = {}

    def unary(self, name, handler) -> None:
        assert name not in self.handlers, "a Router cannot register a method twice"
        self.handlers[name] = handler


async def test_one_handler_serves_every_job_and_refuses_the_others() -> None:
    router = OneMethodRouter()
    dispatch = GossipDispatch(router)

    async def answer(tag):
        async def handler(request):
            return Message({"from": tag})
        return handler

    dispatch.for_job(JOB).unary(METHOD, await answer("job"))
    dispatch.for_job(OTHER).unary(METHOD, await answer("other"))
    call = router.handlers[METHOD]
    assert (await call(SimpleNamespace(meta={"job": JOB}))).meta == {"from": "job"}
    assert (await call(SimpleNamespace(meta={"job": OTHER}))).meta == {"from": "other"}
    dispatch.drop(OTHER)
    for meta in ({"job": OTHER}, {"job": "not bytes"}, ["not", "a", "dict"]):
        with pytest.raises(RpcError) as refused:
            await call(SimpleNamespace(meta=meta))
        assert refused.value.code == "unavailable"
    with pytest.raises(ValueError):
        dispatch.for_job(JOB).unary("stage.forward", await answer("x"))


def serving_with(directory: StaticDirectory) -> Serving:
    serving = Serving(None, None, None, directory, peer_id=ME, address="127.0.0.1:1", device="cpu",
                      state_dir=None, limits=StageLimits(), max_stages=4)
    # Only what the refusals read of a served stage: its spec's stage count.
    service = SimpleNamespace(spec=SimpleNamespace(pipeline=SimpleNamespace(stages=3)), state="serving")
    serving.served[(JOB, 0)] = Served(service, announcement=None)
    return serving


def peer(name: bytes, stage: int, state: str = "serving") -> StagePeer:
    return StagePeer(name * 32, f"127.0.0.1:{stage + 2}", stage, 0, state)


@pytest.mark.parametrize(("table", "move", "why"), [
    ({}, (1, 2), "not serving stage 1"),
    ({}, (0, 3), "3-stage pipeline"),
    ({}, (0, 0), "3-stage pipeline"),
    ({0: [peer(b"x", 0, "draining")], 2: [peer(b"y", 2)]}, (0, 2), "no other peer of stage 0 answered"),
    ({0: [peer(b"x", 0)], 2: [peer(b"y", 2, "joining")]}, (0, 2), "no live peer serves stage 2"),
])
async def test_a_refused_move_changes_nothing(table, move, why) -> None:
    directory = StaticDirectory({(JOB, stage): peers for stage, peers in table.items()})
    serving = serving_with(directory)
    before = dict(serving.served)
    with pytest.raises(MoveFailed, match=why):
        await serving.move(JOB, *move)
    assert serving.served == before and not serving.moving and not serving.moves
    assert serving.served[(JOB, 0)].service.state == "serving"


async def test_a_job_whose_rebalancer_cannot_start_is_shown_in_faults_and_retried(monkeypatch) -> None:
    """A bug in one job's rebalancer start must not end rebalancing for every job; it is logged and
    retried by the next reconcile, and also recorded in the daemon's faults (`swarmctl status`
    "supervision"), which stop counting down once it started."""
    failures = [KeyError("a bug in the gossip's start")]

    async def start(self) -> None:
        if failures:
            raise failures.pop()

    async def stop(self) -> None:
        return None

    monkeypatch.setattr(JobRebalancer, "start", start)
    monkeypatch.setattr(JobRebalancer, "stop", stop)
    serving = SimpleNamespace(served=serving_with(StaticDirectory({})).served, moving={})
    faults = Faults()
    rebalancing = Rebalancing(serving, Identity.generate(), OneMethodRouter(), None, None,
                              RebalanceSettings.from_section(RebalanceSection()), None, Supervisor("rebalancing", faults))
    await rebalancing.reconcile()
    [fault] = faults.status()["tasks"]
    assert fault["task"] == f"rebalancing: start job {JOB.hex()[:16]}" and "KeyError" in fault["last_error"]
    assert not rebalancing.jobs and fault["retry_in_s"] is not None
    await rebalancing.reconcile()
    assert JOB in rebalancing.jobs and faults.status()["tasks"][0]["retry_in_s"] is None
