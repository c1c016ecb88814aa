"""sd_notify datagrams to a test-owned NOTIFY_SOCKET, the watchdog interval, and LISTEN_FDS."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import wait_for

from swarmd import notify


def receiver(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    return sock


def fields(datagram: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in datagram.decode().splitlines())


def test_ready_status_stopping(tmp_path: Path) -> None:
    with receiver(tmp_path / "n") as sock:
        n = notify.Notifier({"NOTIFY_SOCKET": str(tmp_path / "n")})
        n.ready("listening")
        n.status("draining")
        n.stopping("bye")
        got = [fields(sock.recv(4096)) for _ in range(3)]
        n.close()
    assert got[0] == {"READY": "1", "STATUS": "listening", "MAINPID": str(os.getpid())}
    assert got[1] == {"STATUS": "draining"}
    assert got[2] == {"STOPPING": "1", "STATUS": "bye"}


def test_abstract_socket_address() -> None:
    name = f"swarmd-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    with sock:
        notify.Notifier({"NOTIFY_SOCKET": "@" + name}).watchdog()
        assert sock.recv(100) == b"WATCHDOG=1"


def test_without_notify_socket_nothing_is_sent_and_nothing_fails(tmp_path: Path) -> None:
    n = notify.Notifier({})
    assert not n.enabled
    n.ready("x")
    gone = notify.Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    gone.ready("x")  # logged, not raised: systemd going away must not kill the daemon


@pytest.mark.parametrize(
    ("env", "expected"),
    [({"WATCHDOG_USEC": "4000000"}, 2.0), ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}, None),
     ({"WATCHDOG_USEC": "0"}, None), ({"WATCHDOG_USEC": "x"}, None), ({}, None)],
)
def test_watchdog_interval_is_half_and_only_for_us(env: dict[str, str], expected: float | None) -> None:
    assert notify.watchdog_interval(env) == expected


async def test_watchdog_loop_pings_at_the_interval(tmp_path: Path) -> None:
    with receiver(tmp_path / "w") as sock:
        sock.setblocking(False)
        n = notify.Notifier({"NOTIFY_SOCKET": str(tmp_path / "w")})
        task = asyncio.create_task(notify.watchdog_loop(n, 0.05))
        await asyncio.sleep(0.33)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        pings = 0
        while True:
            try:
                assert sock.recv(100) == b"WATCHDOG=1"
            except BlockingIOError:
                break
            pings += 1
        n.close()
    assert 5 <= pings <= 8, pings


CHILD = """
import os, socket, sys
from swarmd import notify
sockets = notify.listen_fds(os.environ)
listener = notify.unix_listener(sockets)
assert "LISTEN_FDS" not in os.environ
conn, _ = listener.accept()
conn.sendall(b"from-activated-child")
conn.close()
"""


@pytest.mark.slow
def test_listen_fds_takes_the_socket_systemd_socket_activate_passes(tmp_path: Path) -> None:
    """systemd-socket-activate binds the socket and execs the child with LISTEN_FDS=1 and its pid
    in LISTEN_PID; the child must find the listener on fd 3 and serve on it."""
    path = tmp_path / "ctl.sock"
    child = subprocess.Popen(
        ["systemd-socket-activate", "-l", str(path), sys.executable, "-c", CHILD],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        wait_for(path.exists, 10, "the socket to be bound", interval=0.02)
        with socket.socket(socket.AF_UNIX) as client:
            client.settimeout(10)
            client.connect(str(path))
            assert client.recv(100) == b"from-activated-child"
        assert child.wait(timeout=10) == 0, child.stderr.read()
    finally:
        child.kill()
        child.wait()


def test_listen_fds_for_another_pid_are_not_ours() -> None:
    env = {"LISTEN_FDS": "1", "LISTEN_PID": str(os.getpid() + 1)}
    assert notify.listen_fds(env) == [] and env == {}
