"""Control API pieces in one process over real Unix sockets: binding, admission, reserved methods."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from controlsock import serve_control

from swarmd import control
from swarmd.client import Client, ControlError, DaemonUnavailable
from transport.message import RemoteInfo


def remote(uid: int, gid: int) -> RemoteInfo:
    return RemoteInfo(None, None, {}, "", peercred=(1234, uid, gid))


def test_admission_rules(tmp_path: Path) -> None:
    """The socket file's group is read at each check: chgrp takes effect without a restart."""
    path = tmp_path / "s.sock"
    path.touch()
    os.chown(path, -1, 65534)
    admission = control.Admission(daemon_uid=999, path=path)
    assert admission.check(remote(0, 5)) is None  # root
    assert admission.check(remote(999, 5)) is None  # the daemon's own user
    assert admission.check(remote(4242, 65534)) is None  # process in the socket's group
    assert admission.check(remote(65534, 5)) is None  # nobody's group list holds nogroup (65534)
    os.chown(path, -1, 0)
    reason = admission.check(remote(65534, 65534))
    assert reason is not None and "uid 65534" in reason and "root" in reason
    assert admission.check(RemoteInfo(None, None, {}, "")) is not None  # no credentials


def test_bind_sets_mode_and_close_removes_only_our_file(tmp_path: Path) -> None:
    bound = control.bind(tmp_path / "sub" / "s.sock")
    assert (os.stat(bound.path).st_mode & 0o777) == control.SOCKET_MODE
    bound.close()
    assert not bound.path.exists()
    again = control.bind(tmp_path / "s.sock")
    os.unlink(again.path)
    replacement = tmp_path / "s.sock"
    replacement.write_text("someone else's")
    again.close()  # the path now names another file: left alone
    assert replacement.read_text() == "someone else's"


def test_stale_socket_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))
    dead.close()  # the file stays, nobody listens: what a crashed daemon leaves
    bound = control.bind(path)
    with socket.socket(socket.AF_UNIX) as probe:
        probe.connect(str(path))
    bound.close()


def test_live_socket_and_other_files_are_not_taken(tmp_path: Path) -> None:
    live = control.bind(tmp_path / "live.sock")
    with pytest.raises(control.ControlSocketError, match="another daemon is listening"):
        control.bind(live.path)
    live.close()
    regular = tmp_path / "file"
    regular.write_text("keep")
    with pytest.raises(control.ControlSocketError, match="not a socket"):
        control.bind(regular)
    assert regular.read_text() == "keep"


class View:
    def status(self) -> dict:
        return {"ok": True}

    def peers(self) -> list:
        return []

    async def dht_get(self, key: bytes) -> dict:
        return {"records": [], "key": key}

    def request_drain(self, reason: str) -> dict:
        return {"draining": True, "drain_timeout_s": 1.0}


@pytest.fixture
async def served(tmp_path: Path):
    async with serve_control(tmp_path / "c.sock", View()) as path:
        yield path


@pytest.mark.parametrize("key", [[], [1, "x"], ["ns", 1.5], ["ns", "x" * 300], ["ns"] * 9, "ns"])
async def test_dht_get_refuses_malformed_keys(served: Path, key: object) -> None:
    async with Client(served, timeout=10) as client:
        with pytest.raises(ControlError, match="bad_request"):
            await client.call("dht.get", key=key)


async def test_client_explains_a_missing_or_stale_socket(tmp_path: Path) -> None:
    with pytest.raises(DaemonUnavailable, match="no daemon socket"):
        async with Client(tmp_path / "missing.sock", timeout=5):
            pass
    stale = tmp_path / "stale.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(stale))
    dead.close()
    with pytest.raises(DaemonUnavailable, match="stale"):
        async with Client(stale, timeout=5):
            pass
