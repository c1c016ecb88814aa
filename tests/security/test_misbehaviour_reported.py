"""Hostile stage peers found through the DHT by real daemons' trainers and stages are reported
by `swarmctl job` on those daemons (issue #8: misbehaving peers are reported): a `nan` peer is
banned by the trainer; an `outlier` peer, in a job whose spec asks for the CenteredClip aggregate,
is clipped and named by its honest stage-mates' all-reduce."""

import asyncio
import json
import math

import pytest

pytestmark = pytest.mark.slow

STEPS = 12
OUTLIER_STEPS = 20  # enough that the outlier reports are read while the stages still serve the job


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
    reply carries an `outliers` list (empty here: the job's spec leaves the exact mean)."""
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


async def test_an_outlier_peer_is_clipped_and_named_by_the_daemons_sharing_its_stage(daemons, jobs_kit, swarmctl,
                                                                                   start_hostile):
    """Steps: daemons A (trainer, stage 0) and B (stage 0) bootstrapped from A; a one-stage job with
    `[optim] aggregate = "centered_clip"` (τ 10) and 6 microbatches a step, submitted to A with no
    trainer, stage 0 pinned on both with `swarmctl serve`; an `outlier` process (its all-reduce
    gradient sums × 1e3; the spec's aggregate, as a daemon) joins stage 0 through A's DHT: three
    contributors, so a majority to tell the odd one by. Once A lists it, A trains 20 steps.
    Expected, while the stages still serve the job (their reports go when they leave it):
    `swarmctl --json job` on A and on B lists outlier reports naming the outlier peer and no other,
    and A's text form prints one on an `outliers stage 0 step N:` line; then the job finishes
    (done, step 20) with the outlier still serving, every step's loss finite and the last below
    the first (its pull was bounded: a plain mean of a × 1e3 part would wreck the model), and no
    peer banned (its replies to the trainer were honest)."""
    a = await asyncio.to_thread(daemons.start, "oa")
    b = await asyncio.to_thread(daemons.start, "ob", "--bootstrap", a.status["announce"])
    data, spec = jobs_kit.write_job(daemons.root, "outlying", seed=5, steps=OUTLIER_STEPS, pipeline={"stages": 1},
                                    batch={"global_samples": 12, "microbatch_samples": 2},
                                    optim={"aggregate": "centered_clip", "clip_tau": 10.0})
    job = json.loads(await asyncio.to_thread(ctl, swarmctl, a, "--json", "submit", "--trainers", "0", str(spec)))["job"]
    for daemon in (a, b):
        await asyncio.to_thread(ctl, swarmctl, daemon, "serve", job, "--stage", "0")

    hostile = await start_hostile(spec, bytes.fromhex(job), 0, "outlier", a.status["announce"])
    bad = hostile.peer_id.hex()

    def lists_hostile() -> bool:
        return any(p["peer_id"] == bad for p in a.client.job(job)["stages"][0]["peers"])

    await asyncio.to_thread(jobs_kit.wait_for, lists_hostile, 60, "A's view of stage 0 to list the outlier peer")
    await asyncio.to_thread(ctl, swarmctl, a, "train", job, "--data", str(data))

    def reported() -> tuple[dict, dict, str] | None:
        views = [json.loads(ctl(swarmctl, d, "--json", "job", job)) for d in (a, b)]
        text = ctl(swarmctl, a, "job", job)
        if all(view["outliers"] for view in views) and "outliers   stage 0 step " in text:
            return views[0], views[1], text
        return None

    view_a, view_b, text = await asyncio.to_thread(jobs_kit.wait_for, reported, 240,
                                                   "A and B to report outliers in stage 0")
    print("A outliers", view_a["outliers"], "B outliers", view_b["outliers"])
    for view in (view_a, view_b):
        assert {found["stage"] for found in view["outliers"]} == {0}, view["outliers"]
        assert {peer for found in view["outliers"] for peer in found["peers"]} == {bad}, view["outliers"]
    step = view_a["outliers"][0]["step"]
    assert f"outliers   stage 0 step {step}: {bad[:16]}" in text, text

    done = await asyncio.to_thread(jobs_kit.wait_for, lambda: jobs_kit.finished(a, job), 300, "the job to finish")
    assert done["state"] == "done" and done["step"] == OUTLIER_STEPS, done
    assert hostile.process.returncode is None
    losses = [e["loss"] for e in await asyncio.to_thread(jobs_kit.step_events, a, job)]
    print("losses", losses)
    assert len(losses) == OUTLIER_STEPS and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses
    view = json.loads(await asyncio.to_thread(ctl, swarmctl, a, "--json", "job", job))
    assert view["banned"] == [], view["banned"]
