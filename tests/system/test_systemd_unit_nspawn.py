"""swarmd's units under a real systemd: three booted Debian containers on a bridged private network.

The tests share one swarm (booting it is the expensive part) and run in file order: each leaves
every daemon active again, so a later test starts from a running, joined swarm.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
from jobspec import job_spec
from waiting import wait_for

sys.path.insert(0, str(Path(__file__).parent))
import nspawn  # noqa: E402

pytestmark = pytest.mark.slow

PORT = 7420
SERVICE = "swarmd.service"
#: Generous bounds for a 2-core machine running three containers; the unit's own limits are read
#: from systemd and asserted separately.
START_TIMEOUT_S = 120.0
JOIN_TIMEOUT_S = 90.0


def configure(container: nspawn.Container, addresses: dict[str, str]) -> None:
    """Each daemon announces its own address and bootstraps from every other container."""
    others = [f'"{addr}:{PORT}"' for name, addr in addresses.items() if name != container.name]
    container.write("/etc/swarmd/swarmd.toml", (
        "[daemon]\n"
        'device = "cpu"\n'
        "[network]\n"
        f'listen = "0.0.0.0:{PORT}"\n'
        f'announce = "{container.address}:{PORT}"\n'
        f"bootstrap = [{', '.join(others)}]\n"
    ))


@pytest.fixture(scope="module")
def swarm() -> Iterator[nspawn.Swarm]:
    with nspawn.swarm(3, configure) as booted:
        yield booted


def props(c: nspawn.Container) -> dict[str, str]:
    return c.show(SERVICE, "ActiveState", "SubState", "MainPID", "NRestarts", "Result", "ExecMainStatus",
                  "TimeoutStopUSec", "WatchdogUSec")


def wait_active(c: nspawn.Container, timeout: float = START_TIMEOUT_S, *, not_pid: str = "") -> dict[str, str]:
    """Until the service is active with a main pid (other than `not_pid`, for a restart)."""
    state: dict[str, str] = {}

    def active() -> bool:
        state.update(props(c))
        return state["ActiveState"] == "active" and state["MainPID"] not in ("0", not_pid)

    wait_for(active, timeout, f"{c.name}: {SERVICE} active", interval=0.5,
             detail=lambda: f"{state}\n{c.journal(SERVICE)}")
    return state


def swarmctl(c: nspawn.Container, *args: str, timeout: float = 30.0) -> dict | list:
    done = c.run("swarmctl", "--json", "--timeout", str(timeout), *args, timeout=timeout + 10)
    return json.loads(done.stdout)


def alive_peers(c: nspawn.Container) -> set[str]:
    return {p["address"] for p in swarmctl(c, "peers") if p["alive"] and not p["self"]}


def wait_joined(swarm: nspawn.Swarm) -> None:
    for c in swarm.containers:
        others = {f"{o.address}:{PORT}" for o in swarm.containers if o is not c}
        seen: set[str] = set()

        def sees_all() -> bool:
            seen.clear()
            seen.update(alive_peers(c))
            return others <= seen

        wait_for(sees_all, JOIN_TIMEOUT_S, f"{c.name} sees {sorted(others)}", interval=0.5,
                 detail=lambda: f"it sees {sorted(seen)}")


TIMESPAN_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}


def timespan_s(text: str) -> float:
    """Seconds in a systemd timespan as `systemctl show` prints it ("1min 30s", "25s", "500ms")."""
    parts = re.findall(r"([0-9.]+)(us|ms|s|min|h)\b", text)
    assert parts, f"not a finite systemd timespan: {text!r}"
    return sum(float(number) * TIMESPAN_UNITS[unit] for number, unit in parts)


def stat(c: nspawn.Container, path: str) -> str:
    return c.run("stat", "-c", "%U:%G %a %F", path).stdout.strip()


def test_containers_boot_a_real_systemd(swarm: nspawn.Swarm) -> None:
    for c in swarm.containers:
        assert c.run("cat", "/proc/1/comm").stdout.strip() == "systemd"
        state = c.wait_system_running()
        failed = c.run("systemctl", "list-units", "--failed", "--plain", "--no-legend").stdout
        assert state == "running", f"{c.name} is {state}; failed units:\n{failed}"


def test_units_verify_and_swarmd_starts(swarm: nspawn.Swarm) -> None:
    for c in swarm.containers:
        verify = c.run("systemd-analyze", "verify", SERVICE, "swarmd.socket", check=False)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        c.run("systemctl", "start", "--no-block", SERVICE)
    for c in swarm.containers:
        state = wait_active(c)
        status = swarmctl(c, "status")
        assert str(status["pid"]) == state["MainPID"]
        assert status["state_dir"] == "/var/lib/swarmd"
        assert status["control_socket"] == "/run/swarmd/swarmd.sock"
        assert status["announce"] == f"{c.address}:{PORT}"
        uid_line = c.run("grep", "^Uid:", f"/proc/{state['MainPID']}/status").stdout.split()
        swarmd_uid = c.run("id", "-u", "swarmd").stdout.strip()
        assert uid_line[1:] == [swarmd_uid] * 4, "the daemon must run as the swarmd user"


def test_directories_are_as_the_unit_declares(swarm: nspawn.Swarm) -> None:
    for c in swarm.containers:
        assert stat(c, "/var/lib/swarmd") == "swarmd:swarmd 700 directory"
        assert stat(c, "/var/lib/swarmd/identity.key").startswith("swarmd:swarmd ")
        assert stat(c, "/run/swarmd") == "swarmd:swarmd 750 directory"
        assert stat(c, "/run/swarmd/swarmd.sock") == "swarmd:swarmd 660 socket"


def test_hardening_reaches_the_daemon(swarm: nspawn.Swarm) -> None:
    """The sandboxing lines take effect under a real manager (a linter only reads them)."""
    c = swarm[0]
    pid = wait_active(c)["MainPID"]
    status = dict(line.split(":\t", 1) for line in c.run("cat", f"/proc/{pid}/status").stdout.splitlines()
                  if ":\t" in line)
    assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0, "CapabilityBoundingSet="
    assert status["NoNewPrivs"].strip() == "1", "NoNewPrivileges=yes"
    assert status["Seccomp"].strip() == "2", "SystemCallFilter= installs a seccomp filter"

    def in_its_mounts(*argv: str) -> int:
        return c.run("nsenter", "-t", pid, "-m", "--", *argv, check=False).returncode

    assert in_its_mounts("touch", "/usr/.probe") != 0, "ProtectSystem=strict: /usr is read-only"
    assert in_its_mounts("touch", "/etc/.probe") != 0, "ProtectSystem=strict: /etc is read-only"
    assert in_its_mounts("touch", "/var/lib/swarmd/.probe") == 0, "StateDirectory= stays writable"
    in_its_mounts("rm", "/var/lib/swarmd/.probe")
    assert in_its_mounts("touch", "/tmp/.probe") == 0
    assert c.run("test", "-e", "/tmp/.probe", check=False).returncode == 1, "PrivateTmp=yes"


def test_peers_find_each_other_over_the_bridge(swarm: nspawn.Swarm) -> None:
    wait_joined(swarm)
    for c in swarm.containers:
        assert swarmctl(c, "status")["bootstrap"]["joined"] is True


#: A two-stage byte-level LM small enough that the job adds seconds, not minutes, to the run. Its
#: data is the container's own Python standard library (`{stdlib}`), readable by the swarmd user.
JOB_SPEC = job_spec("system-job", seed=5, steps=20, files=["{stdlib}/json/*.py"], data={"seq_len": 32},
                    batch={"global_samples": 8}, optim={"name": "adamw", "lr": 1e-2}, pipeline={"stages": 2})
JOB_TIMEOUT_S = 180.0
#: A daemon that has not read the job's record from the DHT yet answers `serve` with not_found.
SERVE_TIMEOUT_S = 60.0


def serve(c: nspawn.Container, job: str, stage: int) -> None:
    """`swarmctl serve JOB --stage I` in the container, retried while its daemon has not seen the job."""
    tried = []

    def served() -> bool:
        tried[:] = [c.run("swarmctl", "serve", job, "--stage", str(stage), check=False, timeout=60)]
        return tried[0].returncode == 0

    wait_for(served, SERVE_TIMEOUT_S, f"{c.name}: swarmctl serve {job} --stage {stage}", interval=1.0,
             detail=lambda: f"exit {tried[0].returncode}\n{tried[0].stdout}{tried[0].stderr}\n{c.journal(SERVICE)}")


def test_a_job_trains_across_the_containers(swarm: nspawn.Swarm) -> None:
    """`swarmctl submit` in swt-a (its daemon trains), `swarmctl serve` stage 0 in swt-b and stage 1 in
    swt-c: activations cross the bridge between three service-managed daemons until the last step."""
    a, b, c = swarm.containers
    a.write("/root/system-job.toml", JOB_SPEC)
    job = swarmctl(a, "submit", "/root/system-job.toml")["job"]
    serve(b, job, 0)
    serve(c, job, 1)
    view: dict = {}

    def finished() -> bool:
        view.clear()
        view.update(swarmctl(a, "job", job))
        return view["state"] in ("done", "failed", "cancelled")

    wait_for(finished, JOB_TIMEOUT_S, "the job's last step", interval=0.5,
             detail=lambda: f"{view}\n{a.journal(SERVICE)}\n{b.journal(SERVICE)}\n{c.journal(SERVICE)}")
    assert (view["state"], view["step"]) == ("done", 20), view
    # Daemons may also join stages on their own (jobs.serve); the ones pinned here must be there.
    stage_hosts = [{p["address"] for p in s["peers"]} for s in view["stages"]]
    assert f"{b.address}:{PORT}" in stage_hosts[0] and f"{c.address}:{PORT}" in stage_hosts[1], stage_hosts
    steps = [json.loads(line) for line in a.run("swarmctl", "--json", "logs", job).stdout.splitlines()]
    losses = [e["loss"] for e in steps if e["kind"] == "step"]
    assert len(losses) == 20 and sum(losses[-5:]) < sum(losses[:5]), losses


def test_reload_changes_log_level_in_place(swarm: nspawn.Swarm) -> None:
    c = swarm[0]
    before = wait_active(c)
    config = "/etc/swarmd/swarmd.toml"
    original = (c.root / config.lstrip("/")).read_text()
    c.write(config, original + '[log]\nlevel = "debug"\n')
    try:
        c.run("systemctl", "reload", SERVICE)
        wait_for(lambda: "log level is now debug" in c.journal(SERVICE), 30, "ExecReload's SIGHUP applied",
                 interval=0.5, detail=lambda: c.journal(SERVICE))
    finally:
        c.write(config, original)
        c.run("systemctl", "reload", SERVICE)
    after = props(c)
    assert (after["ActiveState"], after["MainPID"], after["NRestarts"]) == (
        "active", before["MainPID"], before["NRestarts"]), "a reload must not restart the daemon"


def test_sigkill_is_restarted_and_rejoins_with_its_identity(swarm: nspawn.Swarm) -> None:
    c = swarm[2]
    before = wait_active(c)
    peer_id = swarmctl(c, "status")["peer_id"]
    c.run("systemctl", "kill", "-s", "KILL", SERVICE)
    after = wait_active(c, not_pid=before["MainPID"])
    assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1
    assert swarmctl(c, "status")["peer_id"] == peer_id, "the identity key in StateDirectory must survive"
    wait_joined(swarm)


def test_watchdog_restarts_a_wedged_daemon(swarm: nspawn.Swarm) -> None:
    c = swarm[1]
    before = wait_active(c)
    watchdog_s = timespan_s(before["WatchdogUSec"])
    c.run("systemctl", "kill", "-s", "STOP", "--kill-whom=main", SERVICE)
    after = wait_active(c, timeout=watchdog_s + START_TIMEOUT_S, not_pid=before["MainPID"])
    assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1
    assert "Watchdog timeout" in c.journal(SERVICE, lines=200)
    wait_joined(swarm)


def test_stop_drains_within_timeout_and_keeps_state(swarm: nspawn.Swarm) -> None:
    c = swarm[0]
    before = wait_active(c)
    peer_id = swarmctl(c, "status")["peer_id"]
    timeout_stop_s = timespan_s(before["TimeoutStopUSec"])
    started = time.monotonic()
    c.run("systemctl", "stop", SERVICE, timeout=timeout_stop_s + 30)
    took = time.monotonic() - started
    stopped = props(c)
    assert took < timeout_stop_s, f"stop took {took:.1f} s, TimeoutStopSec is {timeout_stop_s:g} s"
    assert (stopped["ActiveState"], stopped["Result"], stopped["ExecMainStatus"]) == ("inactive", "success", "0")
    assert "draining" in c.journal(SERVICE)
    # RuntimeDirectoryPreserve=yes: the socket unit still listens in /run/swarmd, so it stays.
    assert stat(c, "/run/swarmd/swarmd.sock") == "swarmd:swarmd 660 socket"
    # A client on the socket starts the daemon again (socket activation), with the same identity.
    assert swarmctl(c, "status", timeout=START_TIMEOUT_S)["peer_id"] == peer_id
    wait_active(c)
    c.run("systemctl", "stop", SERVICE, "swarmd.socket", timeout=timeout_stop_s + 30)
    assert c.run("test", "-e", "/run/swarmd/swarmd.sock", check=False).returncode == 1, "RemoveOnStop=yes"
    assert stat(c, "/run/swarmd") == "swarmd:swarmd 750 directory", "RuntimeDirectoryPreserve=yes"
    assert stat(c, "/var/lib/swarmd/identity.key").startswith("swarmd:swarmd ")
    c.run("systemctl", "start", SERVICE, timeout=START_TIMEOUT_S)
    assert swarmctl(c, "status")["peer_id"] == peer_id
    wait_joined(swarm)
