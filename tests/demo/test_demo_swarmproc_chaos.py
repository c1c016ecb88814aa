"""LocalSwarm's chaos operations on real daemons: each does to the process what it says."""

from __future__ import annotations

from pathlib import Path

import pytest
from waiting import wait_for

from swarmd.client import DaemonUnavailable, SyncClient
from swarmd.exitcodes import EXIT_OK
from swarmd.swarmproc import LocalSwarm, SwarmError, SwarmSettings

pytestmark = pytest.mark.slow


def alive_ids(peer) -> set[str]:
    return {p["peer_id"] for p in peer.client().peers() if p["alive"]}



def test_stop_cont_restart_kill_drain_and_close(tmp_path: Path, procs) -> None:
    """1. Start three chained daemons; each sees the others alive.
       2. SIGSTOP b: its socket accepts nothing within 1 s; SIGCONT: it answers again.
       3. restart b: a new process, the same peer id (same state dir) at the same address.
       4. kill c: reaped at once; a and b report it dead within the liveness window.
       5. add d: it joins through the live peers and a sees it alive.
       6. drain d: it exits 0 by itself.
       7. close(): every process is gone; spawning afterwards is refused."""
    swarm = LocalSwarm(tmp_path, SwarmSettings(log_level="warning"))
    try:
        a, b, c = swarm.start(3)
        ids = {p.peer_id for p in (a, b, c)}
        wait_for(lambda: all(alive_ids(p) == ids for p in (a, b, c)), 60, "all three to see each other")

        swarm.stop(b)
        with pytest.raises(DaemonUnavailable):
            SyncClient(b.socket, timeout=1.0).status()
        swarm.cont(b)
        assert b.client().status()["peer_id"] == b.peer_id

        old_pid, old_id = b.pid, b.peer_id
        swarm.restart(b)
        assert b.pid != old_pid and b.peer_id == old_id and b.status["listen"] == b.address

        dead_pid = c.pid
        swarm.kill(c)
        assert not c.alive and not procs.running(dead_pid)
        wait_for(lambda: c.peer_id not in alive_ids(a) | alive_ids(b), 20, "c reported dead")

        d = swarm.add()
        wait_for(lambda: d.peer_id in alive_ids(a), 30, "a to see d")
        assert swarm.drain(d) == EXIT_OK and not d.alive

        pids = [p.pid for p in swarm.live()]
        assert len(pids) == 2
    finally:
        swarm.close()
    assert not any(procs.running(pid) for pid in pids)
    assert procs.processes_mentioning(str(tmp_path)) == []
    with pytest.raises(SwarmError):
        swarm.add()
