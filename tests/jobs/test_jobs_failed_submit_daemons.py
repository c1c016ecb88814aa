"""A submission whose local trainers cannot start publishes nothing (issue 13, hole 8): other
daemons must never learn, join and serve a job its own submitter refused to run."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_a_submit_refused_at_its_trainers_publishes_nothing(swarm, swarm_root, swarmctl, kit) -> None:
    """Steps: daemons A and B (bootstrapped from A); `swarmctl submit --trainers 3` on A of a job
    with 2 microbatches a step (its trainers cannot start: bad_request); then the same spec with
    `--trainers 1`. Expected: the first submit fails with `trainers: at most 2`, A lists no job and
    B reads no entry under the `jobs` index key nor the job's spec key; the second submit succeeds
    and B reads A's index entry (so the check above could see a publication). On the old code the
    first submit had already published the spec and the index entry when the trainers were refused."""
    a, b = swarm.together(["fa", "fb"])
    _, spec_path = kit.write_job(swarm_root, "refused-trainers", copies=1, seed=5, steps=4)
    refused = swarmctl("--socket", str(a.socket), "--json", "submit", "--trainers", "3", str(spec_path))
    assert refused.returncode != 0 and "trainers: at most 2" in refused.stderr, refused.stderr
    assert a.client.jobs() == []
    assert b.client.dht_get(["jobs"])["records"] == []

    accepted = swarmctl("--socket", str(a.socket), "--json", "submit", "--trainers", "1", str(spec_path))
    assert accepted.returncode == 0, accepted.stderr
    job = bytes.fromhex(json.loads(accepted.stdout)["job"])
    assert [j["job"] for j in a.client.jobs()] == [job.hex()]
    entries = kit.wait_for(lambda: b.client.dht_get(["jobs"])["records"], 30, "B to read A's index entry")
    assert [e["subkey"].hex() for e in entries] == [a.status["peer_id"]]
    assert b.client.dht_get(["job", job, "spec"])["records"]
    swarmctl("--socket", str(a.socket), "cancel", job.hex())
