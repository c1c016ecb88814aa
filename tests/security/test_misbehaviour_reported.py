"""A hostile stage peer found through the DHT by a real daemon's trainer is banned, and
`swarmctl job` on that daemon names it (issue #8: misbehaving peers are reported).

Only the trainer's ban is checked against a real daemon: a daemon's stages all-reduce with the
exact mean (its StageLimits.aggregate is not a daemon setting), so its step records never list
outliers; the robust aggregate's outlier reports are tested against in-process stages
(test_hostile_pipeline_peers.py) and their rendering in tests/daemon/test_swarmd_swarmctl.py."""

import asyncio
import json

STEPS = 12


def ctl(swarmctl, daemon, *args: str):
    done = swarmctl("--socket", str(daemon.socket), *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_a_nan_peer_joining_through_the_dht_is_banned_and_shown_in_swarmctl_job(daemons, jobs_kit, swarmctl,
                                                                                       start_hostile):
    """Steps: daemon A (trainer, stage 0) and daemon B (stage 1) bootstrapped from A; a two-stage
    job submitted to A with no trainer yet, stages pinned with `swarmctl serve`; a `nan` process
    (NaN input gradients) joins stage 1 through A's DHT and announces itself there; once A's
    `job` lists it in stage 1, `swarmctl train` starts A's trainer for 12 steps.
    Expected: the job finishes (state done, step 12) though the nan peer keeps serving; `swarmctl
    --json job` on A lists the nan peer (its proven peer id, its address, stage 1) as banned for a
    non-finite reply, and no other peer; the text form prints that ban on a `banned` line; every
    reply carries an `outliers` list (empty here: the daemons' stages use the exact mean)."""
    a = await asyncio.to_thread(daemons.start, "ma")
    b = await asyncio.to_thread(daemons.start, "mb", "--bootstrap", a.status["announce"])
    data, spec = jobs_kit.write_job(daemons.root, "misbehaving", seed=11, steps=STEPS, pipeline={"stages": 2})
    job = json.loads(await asyncio.to_thread(ctl, swarmctl, a, "--json", "submit", "--trainers", "0", str(spec)))["job"]
    for stage, daemon in enumerate((a, b)):
        await asyncio.to_thread(ctl, swarmctl, daemon, "serve", job, "--stage", str(stage))

    hostile = await start_hostile(spec, bytes.fromhex(job), 1, "nan", a.status["announce"])

    def lists_hostile() -> bool:
        view = a.client.job(job)
        return any(p["peer_id"] == hostile.peer_id.hex() for p in view["stages"][1]["peers"])

    await asyncio.to_thread(jobs_kit.wait_for, lists_hostile, 60, "A's view of stage 1 to list the nan peer")
    await asyncio.to_thread(ctl, swarmctl, a, "train", job, "--data", str(data))
    done = await asyncio.to_thread(jobs_kit.wait_for, lambda: jobs_kit.finished(a, job), 240, "the job to finish")
    assert done["state"] == "done" and done["step"] == STEPS, done
    assert hostile.process.returncode is None  # it served to the end: banning, not its exit, kept it out

    view = json.loads(await asyncio.to_thread(ctl, swarmctl, a, "--json", "job", job))
    print("banned", view["banned"], "outliers", view["outliers"])
    assert view["banned"], view
    assert {(ban["peer"], ban["addr"], ban["stage"]) for ban in view["banned"]} == {
        (hostile.peer_id.hex(), hostile.addr, 1)}
    assert all("not finite" in ban["reason"] for ban in view["banned"]), view["banned"]
    assert view["outliers"] == []
    text = await asyncio.to_thread(ctl, swarmctl, a, "job", job)
    ban = view["banned"][0]
    assert f"banned     stage 1 peer {hostile.peer_id.hex()[:16]} ({hostile.addr}): {ban['reason']}" in text, text
    assert json.loads(await asyncio.to_thread(ctl, swarmctl, b, "--json", "job", job))["banned"] == []
