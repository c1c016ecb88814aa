"""The lz4 bomb against a real daemon (issue 13, hole 4): a peer with a proven identity sends, three
times, a request of 1024 lz4 tensors of ~4 KiB each announcing 1 MiB (4.2 MB on the wire). On
ae25aed one such message took a daemon's RSS from 0.3 to 2.4 GB. Now each is refused before any
tensor inflates (the connection is closed), the daemon's peak RSS grows by less than BOUND, and it
goes on answering its control socket and its peers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
#: Measured: ~12 MiB of peak growth for three bombs (the messages' own 4.2 MB buffers, received in
#: 1 MiB chunks, and the refusal); on ae25aed the same run peaked 1034 MiB above (bombs decoded).
BOUND = 64 * MiB

BOMBER = """
import asyncio, json, sys
import lz4.block, torch
import transport.payload as payload
from transport.errors import ConnectionLost, RemoteError
from transport.identity import Identity
from transport.rpc import Message, Pool, RpcConfig

ZEROS = lz4.block.compress(bytes(1 << 20), store_size=False)
META = {"dtype": "float32", "shape": [1 << 18], "codec": "lz4", "raw": 1 << 20}
honest_encode = payload.encode_all
payload.encode_all = lambda tensors, codec: ([dict(META) for _ in range(1024)], [ZEROS] * 1024)

async def main():
    outcomes = []
    for _ in range(3):
        pool = Pool(RpcConfig(identity=Identity.generate()))
        try:
            await pool.call(sys.argv[1], "dht.ping", Message({}, [torch.zeros(1)]), timeout=60)
            outcomes.append("answered")
        except (ConnectionLost, RemoteError, TimeoutError) as exc:
            outcomes.append(type(exc).__name__)
        finally:
            await pool.close()
    payload.encode_all = honest_encode
    pool = Pool(RpcConfig(identity=Identity.generate()))
    try:
        reply = await pool.call(sys.argv[1], "dht.ping", Message({}, [torch.zeros(4)]), timeout=60)
        outcomes.append("answered" if reply.meta == {} else repr(reply.meta))
    finally:
        await pool.close()
    print(json.dumps({"outcomes": outcomes, "wire_bytes": 1024 * len(ZEROS)}))

asyncio.run(main())
"""


def memory(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def test_lz4_bomb_does_not_grow_the_daemon_and_it_goes_on_answering(daemons) -> None:
    daemon = daemons.start("bombed")
    pid = daemon.proc.pid
    before = memory(pid)
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
    done = subprocess.run([sys.executable, "-c", BOMBER, daemon.status["announce"]], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    after = memory(pid)
    growth = after["VmHWM"] - before["VmRSS"]
    print(f"\nbomber saw {seen}; daemon RSS {before['VmRSS'] / MiB:.0f} MiB before, peak "
          f"{after['VmHWM'] / MiB:.0f} MiB during (growth {growth / MiB:.1f} MiB), {after['VmRSS'] / MiB:.0f} after")
    assert seen["wire_bytes"] > 4 * 10**6 and seen["outcomes"] == ["ConnectionLost"] * 3 + ["answered"]
    assert growth < BOUND
    assert daemon.client.status()["pid"] == pid
    logs = daemon.log.read_text()
    assert "lz4 expansion" in logs
