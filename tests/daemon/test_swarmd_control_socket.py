"""The control socket of real daemons: a stale file is replaced, a live daemon's socket is not, and
a process of another uid is refused (by file mode, and by SO_PEERCRED when the mode is loosened)."""

from __future__ import annotations

import asyncio
import grp
import os
import shutil
import socket
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from swarmd.client import Client, DaemonUnavailable
from swarmd.exitcodes import EXIT_FAILURE, EXIT_OK, EXIT_UNAVAILABLE

pytestmark = pytest.mark.slow

MAX_CONNECTIONS = 3
AS_NOBODY = ("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups")


@pytest.fixture(scope="module")
def shared_dir():
    """A socket directory other users can traverse (pytest's tmp dirs are 0700 to root)."""
    path = Path(tempfile.mkdtemp(prefix="swarmd-ctl-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(spawn_module, shared_dir):
    """A daemon started where a crashed one left its socket file behind."""
    path = shared_dir / "swarmd.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))
    dead.close()
    return spawn_module("ctl", socket=path, env={"SWARMD_CONTROL_MAX_CONNECTIONS": str(MAX_CONNECTIONS)})


def test_stale_socket_file_was_replaced(daemon) -> None:
    assert "removing stale control socket" in daemon.logs()
    assert daemon.client.status()["control_socket"] == str(daemon.socket)
    assert (daemon.socket.stat().st_mode & 0o777) == 0o660


def test_live_daemons_socket_is_not_taken(daemon, spawn) -> None:
    second = spawn("second", socket=daemon.socket, ready=False)
    assert second.proc.wait(timeout=120) == EXIT_FAILURE
    assert "another daemon is listening on" in second.logs()
    assert daemon.client.status()["pid"] == daemon.proc.pid


def test_another_uid_is_refused(daemon, swarmctl) -> None:
    """1. Mode 0660, group root: `nobody` cannot even connect; swarmctl says permission denied.
       2. Mode loosened to 0666: the kernel lets nobody connect, SO_PEERCRED admission refuses it
          with a reason naming its uid.
       3. Group changed to nogroup (mode 0660 again): nobody is a member, and is admitted."""
    path = str(daemon.socket)
    denied = swarmctl("--socket", path, "status", prefix=AS_NOBODY)
    assert denied.returncode == EXIT_UNAVAILABLE and "permission denied" in denied.stderr, denied.stderr

    os.chmod(path, 0o666)
    try:
        refused = swarmctl("--socket", path, "status", prefix=AS_NOBODY)
    finally:
        os.chmod(path, 0o660)
    assert refused.returncode == EXIT_UNAVAILABLE and refused.stdout == ""
    assert "refused" in refused.stderr and "uid 65534" in refused.stderr, refused.stderr
    assert "refused control connection from pid" in daemon.logs() and "uid 65534" in daemon.logs()

    os.chown(path, -1, grp.getgrnam("nogroup").gr_gid)
    try:
        admitted = swarmctl("--socket", path, "status", "--json", prefix=AS_NOBODY)
    finally:
        os.chown(path, -1, 0)
    assert admitted.returncode == EXIT_OK, admitted.stderr


async def test_connections_past_the_cap_are_refused(daemon) -> None:
    """control.max_connections clients may hold connections; the next is refused by name, and a
    slot freed by a closing client is usable again."""
    async with AsyncExitStack() as stack:
        held = [await stack.enter_async_context(Client(daemon.socket, timeout=30)) for _ in range(MAX_CONNECTIONS)]
        with pytest.raises(DaemonUnavailable, match="control.max_connections"):
            async with Client(daemon.socket, timeout=30):
                pass
        assert (await held[0].status())["pid"] == daemon.proc.pid
    for _ in range(50):  # the daemon notices the closed connections within a few loop turns
        try:
            async with Client(daemon.socket, timeout=30) as again:
                assert (await again.status())["pid"] == daemon.proc.pid
                return
        except DaemonUnavailable:
            await asyncio.sleep(0.1)
    raise AssertionError("no control connection admitted after the held ones closed")

