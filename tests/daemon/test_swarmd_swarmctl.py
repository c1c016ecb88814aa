"""swarmctl against one real daemon: data on stdout, messages on stderr, --json everywhere, typed
`not_available` for the job commands, `dht get` of a record a peer stored, metrics, drain.

Most commands run `swarmd.ctl.main` in this process (the same code the console script runs) to
spare a torch import per command; the console script itself runs for `status` and `drain`."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarmd import ctl
from swarmd.dht import dht_key
from swarmd.dht import protocol as P
from swarmd.dht.records import sign_record
from swarmd.exitcodes import EXIT_CONFIG, EXIT_OK, EXIT_UNAVAILABLE
from transport.identity import Identity
from transport.message import Message
from transport.pool import Pool
from transport.config import RpcConfig


@pytest.fixture(scope="module")
def daemon(spawn_module):
    return spawn_module("solo", "--metrics", "127.0.0.1:0")


def run_ctl(capsys, *args: str) -> tuple[int, str, str]:
    status = ctl.main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.slow
def test_status_json_from_the_console_script(daemon, swarmctl) -> None:
    done = swarmctl("--socket", str(daemon.socket), "status", "--json")
    assert done.returncode == EXIT_OK and done.stderr == ""
    status = json.loads(done.stdout)
    assert status["pid"] == daemon.proc.pid and len(status["peer_id"]) == 64
    assert status["listen"] == status["announce"] and status["listen"].startswith("127.0.0.1:")
    assert status["bootstrap"]["state"] == "first node of a new swarm" and status["draining"] is False


@pytest.mark.slow
def test_status_text_and_peers(daemon, capsys) -> None:
    status, out, err = run_ctl(capsys, "--socket", str(daemon.socket), "status")
    assert status == EXIT_OK and err == "" and out.startswith("peer id    ")
    assert "\nrebalance  on, every 300 s; 0 moves\n" in out  # the defaults; no job served, no move yet
    status, out, err = run_ctl(capsys, "peers", "--socket", str(daemon.socket), "--json")
    (me,) = json.loads(out)
    assert me["self"] and me["alive"] and me["address"] == daemon.status["announce"]


def test_status_text_shows_rebalancing_checks_and_the_last_move() -> None:
    """The text of `status`'s `rebalance` section, from a section as the daemon sends it."""
    now = 1_000_000.0
    job = "ab" * 32
    section = {
        "enabled": True, "period_s": 60.0, "moves_total": 2, "failed_moves_total": 1,
        "jobs": [{"job": job, "stages": [1], "moves": 2, "failed_moves": 1, "moving_s": 9.5, "last_check_s_ago": 12.0,
                  "last_decision": {"move_to": None, "reason": "stage 1 is not the strongest", "next_check_in_s": 48.0},
                  "gossip": {}}],
        "moves": [{"job": job, "source": 0, "target": 1, "drain_s": 2.3, "join_s": 0.4, "total_s": 2.7, "step": 5,
                   "error": "", "at": now - 125}],
    }
    rows = dict(enumerate(ctl._rebalance_rows(section, now)))
    assert rows[0] == ("rebalance", "on, every 60 s; 2 moves (1 failed)")
    assert rows[1] == ("", f"job {job[:16]} (stage 1): last check 12s ago: stage 1 is not the strongest; next in 48s")
    assert rows[2] == ("last move", f"job {job[:16]} stage 0 -> 1 in 2.7 s (2.3 s draining), 2m 5s ago")
    section["moves"].append({**section["moves"][0], "target": 2, "error": "no live peer serves stage 2", "at": now})
    section["jobs"][0]["last_decision"] = section["jobs"][0]["last_check_s_ago"] = None
    rows = ctl._rebalance_rows(section, now)
    assert rows[1][1].endswith("(stage 1): not checked yet")
    assert rows[2] == ("last move", f"job {job[:16]} stage 0 -> 2 failed after 2.7 s: no live peer serves stage 2, 0s ago")
    assert ctl._rebalance_rows({**section, "enabled": False}, now) == [("rebalance", "off")]


def test_job_text_names_banned_peers_and_outliers() -> None:
    """The text of `job`, from a reply as the daemon sends it: one `banned` line per ban of this
    daemon's trainers, one `outliers` line per step in which a stage served here found outliers;
    neither line without entries."""
    bad, other = "3f" * 32, "a1" * 32
    job = {"job": "cd" * 32, "name": "tiny", "status": "running: every stage has peers", "step": 8, "steps": 20,
           "loss": 2.5, "samples_per_s": 3.0,
           "stages": [{"stage": 1, "peers": [{"address": "127.0.0.1:7001", "step": 8, "samples_per_s": 3.0,
                                              "queue": 0}]}],
           "banned": [{"stage": 1, "peer": bad, "addr": "127.0.0.1:7002", "at": 1_000_000.0,
                       "reason": "stage.forward_backward returned a bad reply: input gradient is not finite"}],
           "outliers": [{"stage": 1, "step": 7, "peers": [bad, other]}]}
    lines = ctl._job_text(job).splitlines()
    assert lines[-2] == (f"banned     stage 1 peer {bad[:16]} (127.0.0.1:7002): "
                         "stage.forward_backward returned a bad reply: input gradient is not finite")
    assert lines[-1] == f"outliers   stage 1 step 7: {bad[:16]}, {other[:16]}"
    quiet = ctl._job_text({**job, "banned": [], "outliers": []})
    assert "banned" not in quiet and "outliers" not in quiet


@pytest.mark.slow
def test_bad_spec_file_is_a_usage_error(daemon, capsys, tmp_path) -> None:
    spec = tmp_path / "bad.toml"
    spec.write_text("name = \n")
    with pytest.raises(SystemExit) as exit_info:
        ctl.main(["--socket", str(daemon.socket), "submit", str(spec)])
    assert exit_info.value.code == EXIT_CONFIG
    assert str(spec) in capsys.readouterr().err


def test_missing_daemon_is_exit_4(capsys, tmp_path) -> None:
    status, out, err = run_ctl(capsys, "--socket", str(tmp_path / "none.sock"), "status")
    assert status == EXIT_UNAVAILABLE and out == "" and "no daemon socket" in err


@pytest.mark.slow
def test_dht_get_shows_a_record_a_peer_stored(daemon, capsys) -> None:
    """A peer (this test, with its own identity, over a real TCP connection) stores a signed record
    on the daemon with the DHT's store RPC; `swarmctl dht get` then shows it."""
    writer = Identity.from_seed(b"test writer")
    key = dht_key("test", "swarmctl", 7)

    async def store() -> dict:
        pool = Pool(RpcConfig(identity=writer))
        try:
            record = sign_record(writer, key, writer.peer_id, b"hello from a peer", time.time() + 60)
            reply = await pool.call(daemon.address, P.STORE, Message(P.store_request(key, [record])), timeout=30)
            return reply.meta
        finally:
            await pool.close()

    assert P.parse_store_reply(asyncio.run(store()), 1) == ["ok"]
    status, out, err = run_ctl(capsys, "--socket", str(daemon.socket), "dht", "get", "test", "swarmctl", "7")
    assert status == EXIT_OK, err
    assert writer.peer_id.hex()[:16] in out and "hello from a peer" in out
    status, out, err = run_ctl(capsys, "--socket", str(daemon.socket), "--json", "dht", "get", "test", "swarmctl", "7")
    (record,) = json.loads(out)["records"]
    assert bytes.fromhex(record["value"]) == b"hello from a peer" and 0 < record["expires_in_s"] <= 60
    status, out, err = run_ctl(capsys, "--socket", str(daemon.socket), "dht", "get", "test", "nothing")
    assert status == EXIT_OK and out.strip() == "(no live records)"


@pytest.mark.slow
def test_metrics_count_control_calls(daemon) -> None:
    daemon.client.status()
    address = daemon.client.status()["metrics"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as reply:
        families = {f.name: f for f in text_string_to_metric_families(reply.read().decode())}
    calls = {(s.labels["service"], s.labels["method"], s.labels["outcome"]): s.value
             for s in families["swarmd_rpc_requests"].samples if s.name.endswith("_total")}
    assert calls[("control", "status", "ok")] >= 2
    assert families["swarmd_dht_contacts"].samples[0].value == 0


@pytest.mark.slow
def test_drain_stops_the_daemon_cleanly(daemon, swarmctl) -> None:
    """Last in this module: `swarmctl drain` answers, then the daemon exits 0 and removes its socket."""
    done = swarmctl("--socket", str(daemon.socket), "drain")
    assert done.returncode == EXIT_OK and done.stdout.startswith("draining") and done.stderr == ""
    assert daemon.proc.wait(timeout=30) == EXIT_OK
    assert not daemon.socket.exists()
