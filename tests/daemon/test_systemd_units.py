"""The shipped systemd units: `systemd-analyze verify` is silent and the service's exposure is OK."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from swarmd.config import DaemonSection
from swarmd.exitcodes import EXIT_CONFIG

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "systemd"
EXPOSURE_OK = 2.0  # systemd's bands: below 1 SAFE, below 2 OK, then MEDIUM, EXPOSED, UNSAFE


@pytest.fixture(scope="module")
def systemd_analyze() -> str:
    """The tool as the set-up installed it (`make test` runs scripts/test-deps.sh first)."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is missing: scripts/test-deps.sh installs it (as root)")
    return tool


@pytest.fixture
def installed_units(tmp_path: Path) -> Path:
    """The units as shipped, with ExecStart pointed at this venv's swarmd (verify checks it exists)."""
    swarmd = Path(sys.executable).parent / "swarmd"
    assert swarmd.exists(), "the venv's swarmd console script is missing"
    for name in ("swarmd.service", "swarmd.socket"):
        text = (UNITS / name).read_text()
        if name == "swarmd.service":
            assert "ExecStart=/usr/bin/swarmd\n" in text
            text = text.replace("ExecStart=/usr/bin/swarmd\n", f"ExecStart={swarmd}\n")
        (tmp_path / name).write_text(text)
    return tmp_path


def unit_settings(name: str) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


def test_verify_prints_nothing(systemd_analyze: str, installed_units: Path) -> None:
    done = subprocess.run(
        [systemd_analyze, "verify", "--man=no", "./swarmd.service", "./swarmd.socket"],
        cwd=installed_units, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0 and done.stderr == "" and done.stdout == "", done.stderr + done.stdout


def test_security_exposure_is_ok_or_better(systemd_analyze: str, installed_units: Path) -> None:
    done = subprocess.run(
        [systemd_analyze, "security", "--offline=yes", "--no-pager", "./swarmd.service"],
        cwd=installed_units, capture_output=True, text=True, timeout=60,
    )
    match = re.search(r"Overall exposure level for swarmd\.service: ([0-9.]+) (\w+)", done.stdout)
    assert match, done.stdout + done.stderr
    print(f"systemd-analyze security: exposure {match[1]} {match[2]}")
    assert float(match[1]) < EXPOSURE_OK and match[2] in ("SAFE", "OK")


def test_service_contract() -> None:
    """What operators rely on: notify + watchdog, a stop timeout above the drain timeout, GPUs kept."""
    s = unit_settings("swarmd.service")
    assert s["Type"] == ["notify"] and s["Restart"] == ["on-failure"] and s["KillMode"] == ["mixed"]
    assert s["User"] == ["swarmd"] and "DynamicUser" not in s
    assert s["RestartPreventExitStatus"] == [str(EXIT_CONFIG)]
    assert float(s["TimeoutStopSec"][0].rstrip("s")) > DaemonSection().drain_timeout_s
    assert "WatchdogSec" in s and s["EnvironmentFile"] == ["-/etc/default/swarmd"]
    for key in ("RuntimeDirectory", "StateDirectory", "ConfigurationDirectory"):
        assert s[key] == ["swarmd"]
    assert "PrivateDevices" not in s and "MemoryDenyWriteExecute" not in s
    assert any("nvidia" in rule for rule in s["DeviceAllow"])
    sock = unit_settings("swarmd.socket")
    assert sock["ListenStream"] == ["/run/swarmd/swarmd.sock"] and sock["SocketMode"] == ["0660"]


def test_sysusers_and_tmpfiles_apply_to_an_empty_root(systemd_analyze: str, tmp_path: Path) -> None:
    """systemd-sysusers creates the static user in a scratch root; systemd-tmpfiles then creates the
    state dir private to it and the runtime dir open to its group."""
    (tmp_path / "etc").mkdir()
    for tool, conf in (("systemd-sysusers", "sysusers.d"), ("systemd-tmpfiles", "tmpfiles.d")):
        args = [tool, f"--root={tmp_path}", *(["--create"] if tool == "systemd-tmpfiles" else []),
                str(UNITS / conf / "swarmd.conf")]
        done = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    (user,) = [line for line in (tmp_path / "etc" / "passwd").read_text().splitlines() if line.startswith("swarmd:")]
    uid = int(user.split(":")[2])
    state, run = (tmp_path / "var" / "lib" / "swarmd").stat(), (tmp_path / "run" / "swarmd").stat()
    assert (state.st_uid, state.st_mode & 0o777) == (uid, 0o700)
    assert (run.st_uid, run.st_mode & 0o777) == (uid, 0o750)
