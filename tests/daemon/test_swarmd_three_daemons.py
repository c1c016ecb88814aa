"""Three real daemons on loopback, chained with --bootstrap: everyone sees everyone, and a killed one
is reported dead within the liveness window."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from waiting import wait_for

from swarmd.exitcodes import EXIT_OK

pytestmark = pytest.mark.slow

#: Short liveness and discovery settings so the test sees joins and deaths in seconds.
FAST = {"SWARMD_PEERS_PING_INTERVAL_S": "0.5", "SWARMD_PEERS_LIVENESS_WINDOW_S": "3",
        "SWARMD_PEERS_PING_TIMEOUT_S": "1", "SWARMD_PEERS_DISCOVERY_INTERVAL_S": "1",
        "SWARMD_NETWORK_BOOTSTRAP_RETRY_INITIAL_S": "0.3",
        "SWARMD_NETWORK_BOOTSTRAP_RETRY_MAX_S": "1"}


def alive_ids(peers: list[dict]) -> set[str]:
    return {p["peer_id"] for p in peers if p["alive"]}



def test_three_daemons_see_each_other_and_notice_a_death(spawn, free_port) -> None:
    """1. Start A, B (--bootstrap A) and C (--bootstrap B) at once, on ports chosen upfront; B and C
          may start before their bootstrap peer listens, so they join through the retry path.
       2. Wait until each one's peers list has all three alive; then `swarmctl peers --json` on each
          (three real CLI processes) must list all three peer ids, alive.
       3. SIGKILL C: within liveness window + ping interval + ping timeout (+ slack for a loaded
          machine), A and B report C not alive, and still report each other alive."""
    ports = [free_port() for _ in range(3)]
    addr = [f"127.0.0.1:{p}" for p in ports]
    a = spawn("a", "--listen", addr[0], env=FAST, ready=False)
    b = spawn("b", "--listen", addr[1], "--bootstrap", addr[0], env=FAST, ready=False)
    c = spawn("c", "--listen", addr[2], "--bootstrap", addr[1], env=FAST, ready=False)
    trio = (a, b, c)
    ids = {d.wait_ready()["peer_id"] for d in trio}
    assert len(ids) == 3
    wait_for(lambda: all(alive_ids(d.client.peers()) == ids for d in trio), 60, "all three to see all three")

    clis = [subprocess.Popen([str(Path(sys.executable).parent / "swarmctl"), "--socket", str(d.socket),
                              "peers", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for d in trio]
    for cli in clis:
        out, err = cli.communicate(timeout=120)
        assert cli.returncode == EXIT_OK, err
        listed = json.loads(out)
        assert {p["peer_id"] for p in listed} >= ids and alive_ids(listed) == ids
        assert sum(p["self"] for p in listed) == 1

    dead = c.status["peer_id"]
    c.proc.kill()
    c.proc.wait(timeout=30)
    budget = float(FAST["SWARMD_PEERS_LIVENESS_WINDOW_S"]) + 0.5 + 1.0 + 5.0
    started = time.monotonic()
    wait_for(lambda: all(dead not in alive_ids(d.client.peers()) for d in (a, b)), budget, "A and B to report C dead")
    took = time.monotonic() - started
    print(f"killed peer reported dead after {took:.1f} s (window 3 s)")
    for d in (a, b):
        assert alive_ids(d.client.peers()) == ids - {dead}
