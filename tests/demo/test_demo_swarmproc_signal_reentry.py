"""A LocalSwarm closed by a signal handler while the same thread is starting a daemon.

`install_signal_handlers` runs `close_all` in the main thread between bytecodes, so a Ctrl-C can land
while that thread is inside `spawn`, holding the swarm's lock around the daemon's Popen. The lock was
not re-entrant: the handler's `close` waited for it for ever (the demo hung on Ctrl-C under load,
faulthandler showing `close` inside the handler inside `Popen`). No process is started here: the
launch itself is the seam where the "signal" lands."""

from __future__ import annotations

import threading

import pytest

from swarmd.swarmproc import LocalSwarm, SwarmError


def test_a_close_from_inside_a_launch_neither_deadlocks_nor_leaves_the_peer(tmp_path, monkeypatch) -> None:
    swarm = LocalSwarm(tmp_path / "swarm")
    reaped = []

    def launch_interrupted(peer) -> None:
        swarm.close()  # what the SIGINT handler does, on this very thread

    monkeypatch.setattr(swarm, "_launch", launch_interrupted)
    monkeypatch.setattr(swarm, "_reap", lambda peer: reaped.append(peer.name))
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            swarm.spawn(port=1)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test reads what happened
            outcome.append(exc)

    worker = threading.Thread(target=start, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "close() from inside the launch deadlocked on the swarm's lock"
    assert isinstance(outcome[0], SwarmError) and "closed" in str(outcome[0])
    assert reaped[-1] == "peer0"  # the peer launched as the swarm closed is reaped too
    with pytest.raises(SwarmError):
        swarm.spawn(port=2)
