"""Issue 13, hole 8, against a real daemon: a local user the control socket does not admit cannot
lock root out by holding unfinished connections; an anonymous hello is refused on the peer port;
and a thousand malformed connections write a bounded number of warnings, then a count."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from waiting import wait_for

from swarmd.dht.protocol import PING
from transport.errors import HandshakeError
from transport.identity import Identity
from transport.rpc import Message, Pool, RpcConfig

pytestmark = pytest.mark.slow

AS_NOBODY = ("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups")
HELD = 40
WINDOW_S = 4.0
PER_SOURCE = 5

#: Run as nobody: open HELD connections to the socket and never say hello; say so; then, once told
#: on stdin, print how many the daemon had closed (without waiting: a refusal at accept is at once);
#: keep the rest open until stdin closes.
HOLDER = """
import socket, sys, json
held = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    held.append(s)
print(json.dumps({"opened": len(held)}), flush=True)
sys.stdin.readline()
closed = 0
for s in held:
    s.setblocking(False)
    try:
        while s.recv(65536):
            pass
        closed += 1
    except BlockingIOError:
        pass
    except OSError:
        closed += 1
print(json.dumps({"closed": closed}), flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def daemon(spawn_module):
    path = Path(tempfile.mkdtemp(prefix="swarmd-hostile-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield spawn_module("hostile-local", socket=path / "swarmd.sock", env={
            "SWARMD_LOG_WARNING_WINDOW_S": str(WINDOW_S), "SWARMD_LOG_WARNINGS_PER_SOURCE": str(PER_SOURCE)})
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_an_unadmitted_user_holding_connections_does_not_lock_root_out(daemon) -> None:
    """Socket mode loosened to 0666: nobody opens 40 connections and never says hello. Each is
    refused at accept (closed at once, before any slot is taken), and root's status answers while
    nobody still holds them; the refusals write at most warnings_per_source warning lines."""
    daemon.socket.chmod(0o666)
    started = time.monotonic()
    holder = subprocess.Popen([*AS_NOBODY, sys.executable, "-c", HOLDER, str(daemon.socket), str(HELD)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(holder.stdout.readline()) == {"opened": HELD}
        windows = int((time.monotonic() - started) // WINDOW_S) + 1
        assert daemon.client.status()["pid"] == daemon.proc.pid
        holder.stdin.write("check\n")
        holder.stdin.flush()
        assert json.loads(holder.stdout.readline()) == {"closed": HELD}
        refusals = [line for line in daemon.logs().splitlines()
                    if "WARNING" in line and "refused control connection" in line and "uid 65534" in line]
        assert 1 <= len(refusals) <= PER_SOURCE * windows, refusals
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        daemon.socket.chmod(0o660)


async def test_an_anonymous_hello_is_refused_on_the_peer_port(daemon) -> None:
    address = daemon.status["announce"]
    anonymous, proven = Pool(RpcConfig()), Pool(RpcConfig(identity=Identity.generate()))
    try:
        with pytest.raises(HandshakeError, match="anonymous hellos are not served"):
            await anonymous.call(address, PING, Message({}), timeout=20)
        assert (await proven.call(address, PING, Message({}), timeout=20)).meta == {}
    finally:
        await anonymous.close()
        await proven.close()


def test_a_thousand_malformed_connections_write_bounded_warnings_and_a_count(daemon) -> None:
    """1,000 connections each send 16 bytes of junk (a bad frame prelude) and close: the daemon
    writes at most warnings_per_source lines about 127.0.0.1 in the window, and once the window is
    over, the next such line counts the ones dropped; the daemon still answers."""
    host, port = daemon.status["announce"].rsplit(":", 1)

    def junk() -> None:
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"\xde\xad\xbe\xef" * 4)
            s.settimeout(10)
            try:
                while s.recv(65536):
                    pass
            except OSError:
                pass

    def closing_lines() -> list[str]:
        return [line for line in daemon.logs().splitlines()
                if "WARNING" in line and "closing connection from ('127.0.0.1'" in line]

    before = len(closing_lines())
    started = time.monotonic()
    for _ in range(1000):
        junk()
    elapsed = time.monotonic() - started
    written = closing_lines()[before:]
    windows = int(elapsed // WINDOW_S) + 1
    print(f"\n1000 junk connections in {elapsed:.1f} s wrote {len(written)} warning lines")
    assert 1 <= len(written) <= PER_SOURCE * windows, written[:20]

    def counted_lines() -> list[str]:
        found = [l for l in closing_lines() if re.search(r"\[(\d+) more such lines about 127\.0\.0\.1", l)]
        if not found:
            junk()  # one more now and then, until one lands after the window and carries the count
        return found

    counted = wait_for(counted_lines, WINDOW_S + 30, "a warning that counts the lines left out", interval=0.5,
                       detail=lambda: str(closing_lines()[-5:]))
    dropped = sum(int(re.search(r"\[(\d+) more such", line)[1]) for line in counted)
    assert dropped >= 1000 - PER_SOURCE * windows
    assert daemon.client.status()["pid"] == daemon.proc.pid
