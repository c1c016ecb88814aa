"""A job's end, swarm-wide, with real daemons: when a job finishes or is cancelled, every daemon that
serves one of its stages writes a final checkpoint and leaves (no served stage, no announcement,
nothing remembered), a trainer on another daemon stops, every daemon shows how the job ended, a
daemon started later never joins it, and an end record signed by anyone but the submitter is refused.

Three daemons `a` (the submitter), `b`, `c`, one stage each, pinned with `swarmctl serve`."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import pytest

from swarmd.dht import DHTConfig, DHTNode
from swarmd.dht.rpc_network import RpcNetwork
from swarmd.values import JobEnd, end_key
from swarmd.stage.checkpoint import checkpoint_dir, newest_checkpoint
from transport.identity import Identity

pytestmark = pytest.mark.slow

STEPS = 3


@pytest.fixture(scope="module")
def three(swarm):
    return tuple(swarm.together(["ea", "eb", "ec"]))


def submit(kit, swarmctl, swarm_root: Path, daemon, name: str, steps: int, trainers: int) -> str:
    _, spec = kit.write_job(swarm_root, name, copies=1, seed=5, steps=steps)
    done = swarmctl("--socket", str(daemon.socket), "--json", "submit", "--trainers", str(trainers), str(spec))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["job"]


def pin(swarmctl, daemons, job_id: str) -> None:
    for stage, daemon in enumerate(daemons):
        done = swarmctl("--socket", str(daemon.socket), "serve", job_id, "--stage", str(stage))
        assert done.returncode == 0, done.stderr


def job_view(swarmctl, daemon, job_id: str) -> dict:
    done = swarmctl("--socket", str(daemon.socket), "--json", "job", job_id)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def has_left(swarmctl, daemon, job_id: str) -> bool:
    """No served stage in status, nothing remembered, and no stage announcement of this daemon."""
    if daemon.client.status()["serving"]["stages"]:
        return False
    memory = daemon.socket.parent / "state" / "served-stages.json"
    if memory.exists() and json.loads(memory.read_text())["stages"]:
        return False
    me = daemon.status["peer_id"]
    return not any(p["peer_id"] == me for s in job_view(swarmctl, daemon, job_id)["stages"] for p in s["peers"])


def test_a_finished_job_is_left_everywhere_and_never_joined_again(kit, three, swarm, swarm_root, swarmctl) -> None:
    a, b, c = three
    job_id = submit(kit, swarmctl, swarm_root, a, "finishing", STEPS, trainers=1)
    pin(swarmctl, three, job_id)
    kit.wait_for(lambda: job_view(swarmctl, a, job_id)["state"] == "done", 240, "the job to finish")
    for daemon in three:
        kit.wait_for(lambda: has_left(swarmctl, daemon, job_id), 60, f"{daemon.name} to leave the job's stages")
    for stage, daemon in enumerate(three):
        view = job_view(swarmctl, daemon, job_id)
        print(daemon.name, view["status"])
        assert view["state"] == "done" and view["status"].startswith(f"job finished at step {STEPS}")
        assert view["end"]["state"] == "done" and view["end"]["step"] == STEPS
        # No daemon's announcement is left (each daemon's view of the DHT, read with its short cache).
        kit.wait_for(lambda: all(not s["peers"] for s in job_view(swarmctl, daemon, job_id)["stages"]), 30,
                 f"every announcement gone in {daemon.name}'s view")
        # The final checkpoint holds the last committed step.
        snapshot = newest_checkpoint(checkpoint_dir(daemon.socket.parent / "state", bytes.fromhex(job_id), stage), stage)
        assert snapshot is not None and snapshot.step == STEPS
        assert "wrote its final checkpoint" in daemon.log.read_text()
    listed = json.loads(swarmctl("--socket", str(c.socket), "--json", "jobs").stdout)
    assert [j["state"] for j in listed if j["job"] == job_id] == ["done"]
    # A daemon that lends everything, started after the end, learns the job as finished and never joins it.
    late = swarm.start("elate", "--bootstrap", a.status["announce"], env={"SWARMD_JOBS_SERVE": "all"})
    kit.wait_for(lambda: job_view(swarmctl, late, job_id)["state"] == "done", 30, "the late daemon to see the end")
    time.sleep(3)  # a window in which nothing may happen: several join ticks (0.5 s each), none joining
    assert late.client.status()["serving"]["stages"] == []
    assert "joined stage" not in late.log.read_text()
    refused = swarmctl("--socket", str(late.socket), "serve", job_id, "--stage", "0")
    assert refused.returncode == 1 and "finished at step" in refused.stderr
    late.proc.send_signal(signal.SIGKILL)  # it would join the next test's job
    late.proc.wait(timeout=30)


async def forge_end(bootstrap: str, job_id: bytes) -> bytes:
    """Store a "cancelled" end record for the job from a DHT node that is not its submitter."""
    identity = Identity.generate()
    config = DHTConfig(rpc_timeout=2.0)
    node = DHTNode(identity, await RpcNetwork.listen(identity, config=config), config)
    await node.start()
    try:
        assert await node.bootstrap([bootstrap]) >= 1
        forged = JobEnd("cancelled", 0, time.time(), "a forger").to_msgpack()
        assert await node.store(end_key(job_id), identity.peer_id, forged, time.time() + 120) >= 1
    finally:
        await node.stop()
    return identity.peer_id


def test_a_forged_end_is_refused_and_a_cancelled_job_is_left_with_its_remote_trainer(kit, three, swarm_root,
                                                                                      swarmctl) -> None:
    a, b, c = three
    job_id = submit(kit, swarmctl, swarm_root, a, "cancelling", 10_000, trainers=0)
    pin(swarmctl, three, job_id)
    data = swarm_root / "cancelling.txt"
    trained = swarmctl("--socket", str(b.socket), "train", job_id, "--data", str(data))
    assert trained.returncode == 0, trained.stderr
    kit.wait_for(lambda: job_view(swarmctl, b, job_id)["step"] >= 1, 240, "the trainer on b to commit a step")

    forger = asyncio.run(forge_end(a.status["announce"], bytes.fromhex(job_id)))
    for daemon in (b, c):  # the submitter never reads its own jobs' ends
        kit.wait_for(lambda: f"signed by peer {forger.hex()[:16]}" in daemon.log.read_text(), 30,
                 f"{daemon.name} to refuse the forged end")
    step = job_view(swarmctl, b, job_id)["step"]
    kit.wait_for(lambda: job_view(swarmctl, b, job_id)["step"] > step, 120, "training to go on past the forgery")
    for stage, daemon in enumerate(three):
        assert daemon.client.status()["serving"]["stages"] == [f"{job_id[:16]}/{stage}"]
        assert job_view(swarmctl, daemon, job_id)["end"] is None

    assert swarmctl("--socket", str(a.socket), "cancel", job_id).returncode == 0
    for daemon in three:
        kit.wait_for(lambda: has_left(swarmctl, daemon, job_id), 60, f"{daemon.name} to leave the cancelled job")
    ends = []
    for daemon in three:
        view = job_view(swarmctl, daemon, job_id)
        print(daemon.name, view["status"])
        assert view["state"] == "cancelled" and "cancelled at step" in view["status"]
        assert "by swarmctl cancel (uid" in view["status"]
        ends.append(view["end"])
    assert ends[0]["state"] == "cancelled" and ends.count(ends[0]) == 3  # one record, read alike everywhere
    kit.wait_for(lambda: "trainer 0 of cancelling stopped: the job cancelled" in b.log.read_text(), 30,
             "b's trainer to stop")
    refused = swarmctl("--socket", str(c.socket), "train", job_id, "--data", str(data))
    assert refused.returncode == 1 and "cancelled at step" in refused.stderr


def test_a_job_trained_elsewhere_is_ended_by_its_submitter_from_the_stages_announcements(kit, three, swarm_root,
                                                                                         swarmctl) -> None:
    """No trainer on the submitter (`--trainers 0`), one on `c`: once every stage announces the last
    step committed (at the stages' next DHT refresh, up to 30 s), the submitter ends the job."""
    a, b, c = three
    job_id = submit(kit, swarmctl, swarm_root, a, "elsewhere", STEPS, trainers=0)
    pin(swarmctl, three, job_id)
    trained = swarmctl("--socket", str(c.socket), "train", job_id, "--data", str(swarm_root / "elsewhere.txt"))
    assert trained.returncode == 0, trained.stderr
    view = kit.wait_for(lambda: (lambda v: v if v["end"] else None)(job_view(swarmctl, a, job_id)), 180,
                    "the submitter to end the job")
    print(view["status"])
    assert view["state"] == "done" and view["end"]["step"] == STEPS
    assert view["status"] == f"job finished at step {STEPS} (every stage committed step {STEPS})"
    for daemon in three:
        kit.wait_for(lambda: has_left(swarmctl, daemon, job_id), 60, f"{daemon.name} to leave the job's stages")
    events = [json.loads(line) for line in swarmctl("--socket", str(a.socket), "--json", "logs", job_id,
                                                    "--follow").stdout.splitlines()]
    assert events[-1]["kind"] == "done" and "finished at step" in events[-1]["message"]
