"""The daemon's security settings on real `swarmd` processes (docs/security.md): who may join a
private swarm, encryption agreement, `jobs.accept_jobs_from`, bad key files and a per-peer RPC flood."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobspec import job_spec
from waiting import wait_for

from swarmd.dht.protocol import PING
from swarmd.exitcodes import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK
from swarmd.swarmkey import generate
from transport.errors import RemoteError
from transport.identity import Identity
from transport.rpc import Message, Pool, RpcConfig

pytestmark = pytest.mark.slow

FAST = {"SWARMD_PEERS_PING_INTERVAL_S": "0.5", "SWARMD_PEERS_LIVENESS_WINDOW_S": "5",
        "SWARMD_PEERS_DISCOVERY_INTERVAL_S": "1", "SWARMD_NETWORK_BOOTSTRAP_RETRY_INITIAL_S": "0.3",
        "SWARMD_NETWORK_BOOTSTRAP_RETRY_MAX_S": "1", "SWARMD_JOBS_SERVE": "none"}
#: How long an outsider keeps trying (bootstrap retries, pings) while we watch that nobody lists it.
OUTSIDER_WATCH_S = 5.0



def listed(daemon) -> set[str]:
    return {p["peer_id"] for p in daemon.client.peers()}


def key_file(path: Path) -> str:
    generate(path)
    return str(path)


@pytest.mark.parametrize("case", ["swarm key", "encryption"])
def test_only_peers_that_agree_join(spawn, tmp_path: Path, case: str) -> None:
    """1. Start A and B (--bootstrap A) with the same private setting, and C (--bootstrap A) with a
          different one: another swarm key, or encryption off while A and B encrypt.
       2. A and B list each other, alive: the setting works on both ends of a connection.
       3. C's peers list stays itself alone and its bootstrap never joins, while neither A nor B
          ever lists C; A's log names the reason it refused C's hello (for encryption: the
          daemon's setting, network.encrypt)."""
    if case == "swarm key":
        members = ("--swarm-key-file", key_file(tmp_path / "swarm.key"))
        outsider = ("--swarm-key-file", key_file(tmp_path / "other.key"))
        reason = "swarm key"
    else:
        # The daemon names its own setting, not the transport's RpcConfig field.
        members, outsider, reason = ("--encrypt",), (), "the same network.encrypt (--encrypt)"
    a = spawn("a", *members, env=FAST)
    b = spawn("b", *members, "--bootstrap", a.address, env=FAST, ready=False)
    c = spawn("c", *outsider, "--bootstrap", a.address, env=FAST, ready=False)
    b.wait_ready()
    c.wait_ready()
    ab = {a.status["peer_id"], b.status["peer_id"]}
    wait_for(lambda: {p["peer_id"] for p in a.client.peers() if p["alive"]} == ab
               and {p["peer_id"] for p in b.client.peers() if p["alive"]} == ab, 60, "A and B to see each other")

    outsider_id = c.status["peer_id"]
    deadline = time.monotonic() + OUTSIDER_WATCH_S  # a window in which nothing may happen: nobody admits C
    while time.monotonic() < deadline:
        assert listed(c) == {outsider_id}
        assert outsider_id not in listed(a) | listed(b)
        time.sleep(0.5)
    assert c.client.status()["bootstrap"]["joined"] is False
    wait_for(lambda: "hello with" in a.logs() and reason in a.logs(), 30, f"A to log why it refused ({reason})")


def test_jobs_from_unlisted_submitters_are_refused(spawn, tmp_path: Path, swarmctl) -> None:
    """1. A submits a job (no trainers). B accepts jobs from A's peer id; C only from a key nobody has.
       2. B learns the job (`swarmctl job` shows it, submitter A) and serves a stage of it.
       3. C never learns it: `swarmctl jobs` does not list it, and `swarmctl serve` fails with a
          `forbidden` error naming accept_jobs_from and A's peer id; C serves nothing."""
    a = spawn("a", env=FAST)
    b = spawn("b", "--bootstrap", a.address, env={**FAST, "SWARMD_JOBS_ACCEPT_JOBS_FROM": a.status["peer_id"]},
              ready=False)
    c = spawn("c", "--bootstrap", a.address, env={**FAST, "SWARMD_JOBS_ACCEPT_JOBS_FROM": "ab" * 32}, ready=False)
    b.wait_ready()
    c.wait_ready()
    data = tmp_path / "data.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 200)
    spec = tmp_path / "tiny.toml"
    spec.write_text(job_spec("tiny", seed=3, steps=5, files=["data.txt"], model={"d_model": 16}, data={"seq_len": 8},
                             batch={"global_samples": 2, "microbatch_samples": 1}, optim=None, pipeline={"stages": 2}))
    submitted = swarmctl("--socket", str(a.socket), "--json", "submit", "--trainers", "0", str(spec))
    assert submitted.returncode == EXIT_OK, submitted.stderr
    job_id = json.loads(submitted.stdout)["job"]

    def b_knows() -> bool:
        result = swarmctl("--socket", str(b.socket), "--json", "job", job_id)
        return result.returncode == EXIT_OK

    wait_for(b_knows, 60, "B to learn the job")
    job = json.loads(swarmctl("--socket", str(b.socket), "--json", "job", job_id).stdout)
    assert job["name"] == "tiny"
    served = swarmctl("--socket", str(b.socket), "--json", "serve", job_id, "--stage", "0")
    assert served.returncode == EXIT_OK, served.stderr

    refused = swarmctl("--socket", str(c.socket), "serve", job_id, "--stage", "0")
    assert refused.returncode == EXIT_FAILURE
    assert "forbidden" in refused.stderr and "accept_jobs_from" in refused.stderr
    assert a.status["peer_id"] in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr
    jobs = json.loads(swarmctl("--socket", str(c.socket), "--json", "jobs").stdout)
    assert job_id not in json.dumps(jobs)
    assert c.client.status()["serving"]["stages"] == []


def run_swarmd(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "swarmd.cli", "--listen", "127.0.0.1:0", "--socket", str(tmp_path / "s.sock"),
         "--state-dir", str(tmp_path / "state"), "--device", "cpu", "--log-level", "warning", *flags],
        capture_output=True, text=True, timeout=120,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp", "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.parametrize("problem", ["missing", "world-readable"])
def test_bad_swarm_key_file_exits_2_naming_the_key(tmp_path: Path, problem: str) -> None:
    path = tmp_path / "swarm.key"
    if problem == "world-readable":
        generate(path)
        os.chmod(path, 0o644)
    result = run_swarmd(tmp_path, "--swarm-key-file", str(path))
    assert result.returncode == EXIT_CONFIG, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "network.swarm_key_file" in lines[0] and str(path) in lines[0]
    assert ("keygen" if problem == "missing" else "chmod 600") in lines[0]


@pytest.mark.parametrize("problem", ["missing", "world-readable", "malformed"])
def test_check_config_refuses_a_bad_swarm_key_file_like_the_daemon(tmp_path: Path, problem: str) -> None:
    """1. Make a key file that is missing, mode 0644, or mode 0600 with 10 bytes of text.
       2. `swarmd --check-config --swarm-key-file PATH` exits 2 with one line naming
          network.swarm_key_file, the path and what is wrong, and prints no config.
       3. The daemon started with the same flag exits 2 and its line says the same thing.
       4. With a good key file, --check-config exits 0 and prints the key file's path."""
    path = tmp_path / "swarm.key"
    if problem == "world-readable":
        generate(path)
        os.chmod(path, 0o644)
    elif problem == "malformed":
        path.write_text("not a key\n")
        os.chmod(path, 0o600)
    checked = run_swarmd(tmp_path, "--check-config", "--swarm-key-file", str(path))
    assert checked.returncode == EXIT_CONFIG and checked.stdout == "", (checked.stdout, checked.stderr)
    line = checked.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert line.startswith("swarmd: network.swarm_key_file: ") and str(path) in line, line
    assert {"missing": "keygen", "world-readable": "chmod 600", "malformed": "hex digits"}[problem] in line
    started = run_swarmd(tmp_path, "--swarm-key-file", str(path))
    assert started.returncode == EXIT_CONFIG
    message = line.removeprefix("swarmd: ")
    assert started.stderr.strip().endswith(message), (started.stderr, message)

    good = tmp_path / "good.key"
    generate(good)
    ok = run_swarmd(tmp_path, "--check-config", "--swarm-key-file", str(good))
    assert ok.returncode == EXIT_OK and str(good) in ok.stdout, ok.stderr


def test_an_rpc_flood_from_one_peer_is_rate_limited_while_others_are_answered(spawn) -> None:
    """1. A daemon allows 20 calls/s per peer (burst 20).
       2. A flooder (a real peer with its own identity, over TCP) pings it as fast as it can for a
          few seconds: most of its calls come back `rate_limited`, no handler ran for them.
       3. Meanwhile an honest peer pinging 4 times a second gets every answer, and the daemon
          answers its control socket too."""
    a = spawn("a", env={**FAST, "SWARMD_NETWORK_RPC_RATE_LIMIT_PER_S": "20", "SWARMD_NETWORK_RPC_RATE_LIMIT_BURST": "20"})

    async def scenario() -> tuple[int, int, int, int]:
        flood_pool = Pool(RpcConfig(identity=Identity.generate()))
        honest_pool = Pool(RpcConfig(identity=Identity.generate()))
        ok = limited = honest_ok = honest_failed = 0
        stop = asyncio.Event()

        async def flood() -> None:
            nonlocal ok, limited
            while not stop.is_set():
                try:
                    await flood_pool.call(a.address, PING, Message({}), timeout=10)
                    ok += 1
                except RemoteError as exc:
                    assert exc.code == "rate_limited", exc
                    limited += 1

        async def honest() -> None:
            nonlocal honest_ok, honest_failed
            while not stop.is_set():
                try:
                    await honest_pool.call(a.address, PING, Message({}), timeout=10)
                    honest_ok += 1
                except RemoteError:
                    honest_failed += 1
                await asyncio.sleep(0.25)

        try:
            async with asyncio.TaskGroup() as tg:
                for _ in range(8):
                    tg.create_task(flood())
                tg.create_task(honest())
                await asyncio.sleep(4.0)
                stop.set()
        finally:
            await flood_pool.close()
            await honest_pool.close()
        return ok, limited, honest_ok, honest_failed

    ok, limited, honest_ok, honest_failed = asyncio.run(scenario())
    assert limited > 5 * ok > 0, (ok, limited)
    assert ok <= 20 + 20 * 10  # burst + rate x (4 s and slack for a slow start)
    assert honest_failed == 0 and honest_ok >= 8, (honest_ok, honest_failed)
    assert a.client.status()["peer_id"] == a.status["peer_id"]
