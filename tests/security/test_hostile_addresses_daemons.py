"""A stranger's claimed address against real daemons (adversary's attack; the unit tests are in
test_hostile_addresses.py): one `dht.find_node` per daemon claiming `a..b:1`, a host name the
resolver refuses with UnicodeError, used to make every DHT store and get of those daemons raise."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CLAIMER = Path(__file__).with_name("hostile_addr_claimer.py")
REPO = Path(__file__).resolve().parents[2]


async def test_a_claimed_address_nobody_can_dial_does_not_stop_publishing(daemons, jobs_kit, swarmctl):
    """Steps: daemons A and B (B bootstrapped from A); a stranger calls `dht.find_node` once on each
    claiming `a..b:1` as its address; then a two-stage job is submitted to A (no trainer). Expected:
    the submit succeeds and B learns the job from the DHT. On the old code A's publish raised out
    of the DHT (the contact's dial raised UnicodeError) and the submit failed with `internal`."""
    claim = "a..b:1"
    a = await asyncio.to_thread(daemons.start, "ha")
    b = await asyncio.to_thread(daemons.start, "hb", "--bootstrap", a.status["announce"])
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(CLAIMER), "--targets", a.status["announce"], b.status["announce"], "--claim", claim,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = await asyncio.wait_for(process.stdout.readline(), 90)
        print("stranger's calls:", line.decode().strip())
        _, spec = jobs_kit.write_job(daemons.root, "claimed", seed=3, steps=2, pipeline={"stages": 2})
        done = await asyncio.to_thread(swarmctl, "--socket", str(a.socket), "--json", "submit", "--trainers", "0",
                                       str(spec))
        assert done.returncode == 0, done.stderr
        job = json.loads(done.stdout)["job"]

        def b_knows() -> bool:
            return any(j["job"] == job for j in b.client.jobs())

        await asyncio.to_thread(jobs_kit.wait_for, b_knows, 90, "B to learn the job from the DHT")
    finally:
        process.stdin.close()
        await asyncio.wait_for(process.wait(), 30)
