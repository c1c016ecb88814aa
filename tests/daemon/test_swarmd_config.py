"""Configuration: precedence, strict parsing, and the CLI's one-line exit-2 answer to bad input."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from swarmd import config as c
from swarmd.cli import parser
from swarmd.exitcodes import EXIT_CONFIG

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "systemd" / "swarmd.toml"


def load(argv: list[str], env: dict[str, str]) -> c.Config:
    return c.load(parser().parse_args(argv), env)


def run_swarmd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "swarmd.cli", *args], capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", **(env or {})},
    )


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    cfg = tmp_path / "swarmd.toml"
    cfg.write_text('[network]\nlisten = "10.0.0.1:1000"\nannounce = "10.0.0.9:9"\n[log]\nlevel = "debug"\n')
    env = {"SWARMD_NETWORK_LISTEN": "10.0.0.2:2000", "SWARMD_NETWORK_ANNOUNCE": "10.0.0.8:8"}
    got = load(["--config", str(cfg), "--listen", "10.0.0.3:3000"], env)
    assert got.network.listen == c.Address("10.0.0.3", 3000)  # flag
    assert got.network.announce == c.Address("10.0.0.8", 8)  # env over file
    assert got.log.level == "debug"  # file over default
    assert got.log.format == "text"  # default
    assert got.config_file == cfg


def test_config_file_from_env_and_repeatable_bootstrap(tmp_path: Path) -> None:
    cfg = tmp_path / "a.toml"
    cfg.write_text('[network]\nbootstrap = ["h1:1", "[::1]:2"]\n')
    got = load([], {"SWARMD_CONFIG": str(cfg)})
    assert got.network.bootstrap == (c.Address("h1", 1), c.Address("::1", 2))
    got = load(["--bootstrap", "a:1", "--bootstrap", "b:2"], {"SWARMD_CONFIG": str(cfg)})
    assert [str(a) for a in got.network.bootstrap] == ["a:1", "b:2"]
    assert load([], {"SWARMD_NETWORK_BOOTSTRAP": "x:1,y:2"}).network.bootstrap == (
        c.Address("x", 1), c.Address("y", 2))


def test_derived_paths_follow_systemd_directories(tmp_path: Path) -> None:
    env = {"RUNTIME_DIRECTORY": str(tmp_path / "run"), "STATE_DIRECTORY": str(tmp_path / "state")}
    got = load([], env)
    assert got.control.socket == tmp_path / "run" / "swarmd.sock"
    assert got.daemon.state_dir == tmp_path / "state"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:80", c.Address("127.0.0.1", 80)), ("[::1]:7", c.Address("::1", 7)),
     ("host.example:65535", c.Address("host.example", 65535))],
)
def test_parse_address(text: str, expected: c.Address) -> None:
    assert c.parse_address(text) == expected
    assert c.parse_address(str(expected)) == expected


@pytest.mark.parametrize("text", ["", "host", ":80", "host:", "host:65536", "host:0", "a b:1", "::1:80"])
def test_parse_address_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        c.parse_address(text)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ('[network]\nlisen = "0.0.0.0:1"\n', "network.lisen"),  # unknown key
        ('[netwrk]\nlisten = "0.0.0.0:1"\n', "netwrk"),  # unknown section
        ("[daemon]\ndrain_timeout_s = \"20\"\n", "daemon.drain_timeout_s"),  # wrong type
        ("[peers]\nmax_peers_reported = true\n", "peers.max_peers_reported"),  # bool is not an int
        ('[network]\nlisten = "nohost"\n', "network.listen"),  # unparsable address
        ('[network]\nbootstrap = ["a:1", "b"]\n', "network.bootstrap"),
        ('[log]\nlevel = "loud"\n', "log.level"),
        ('[daemon]\ndevice = "tpu"\n', "daemon.device"),
    ],
)
def test_bad_file_exits_2_with_one_line_naming_file_and_key(tmp_path: Path, toml: str, key: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(toml)
    done = run_swarmd("--config", str(cfg), "--check-config")
    assert done.returncode == EXIT_CONFIG
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert str(cfg) in lines[0] and key in lines[0]
    assert "Traceback" not in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--listen", "bad"], {}, "--listen"),
        (["--bootstrap", "h:1", "--bootstrap", "h:99999"], {}, "--bootstrap"),
        ([], {"SWARMD_NETWORK_LISTEN": "x"}, "SWARMD_NETWORK_LISTEN"),
        ([], {"SWARMD_NETWORK_LISTN": "x:1"}, "SWARMD_NETWORK_LISTN"),  # unknown variable
        ([], {"SWARMD_DAEMON_DRAIN_TIMEOUT_S": "soon"}, "SWARMD_DAEMON_DRAIN_TIMEOUT_S"),
        # valid one by one, refused together, as the daemon would when it builds its rebalancer
        ([], {"SWARMD_REBALANCE_JITTER": "1.5"}, "[rebalance]: jitter"),
        ([], {"SWARMD_REBALANCE_SPEED_TOLERANCE": "1"}, "[rebalance]: speed_tolerance"),
    ],
)
def test_bad_flag_or_env_exits_2(args: list[str], env: dict[str, str], named: str) -> None:
    done = run_swarmd(*args, "--check-config", env=env)
    assert done.returncode == EXIT_CONFIG
    assert len(done.stderr.splitlines()) == 1 and named in done.stderr, done.stderr


@pytest.mark.slow
def test_not_toml_and_missing_file_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "x.toml"
    cfg.write_text("[network\n")
    for path in (cfg, tmp_path / "missing.toml"):
        done = run_swarmd("--config", str(path), "--check-config")
        assert done.returncode == EXIT_CONFIG and len(done.stderr.splitlines()) == 1 and str(path) in done.stderr


@pytest.mark.slow
def test_check_config_output_loads_back_unchanged(tmp_path: Path) -> None:
    env = {"SWARMD_CONTROL_SOCKET": str(tmp_path / "s.sock"), "SWARMD_DAEMON_STATE_DIR": str(tmp_path)}
    done = run_swarmd("--listen", "[::1]:0", "--bootstrap", "a:1", "--metrics", "127.0.0.1:9",
                      "--check-config", env=env)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "effective.toml"
    out.write_text(done.stdout)
    again = load(["--config", str(out)], {})
    assert again.network.listen == c.Address("::1", 0)
    assert again.metrics.listen == c.Address("127.0.0.1", 9)
    assert again.control.socket == tmp_path / "s.sock"
    assert dataclasses.replace(again, config_file=None) == dataclasses.replace(
        load(["--listen", "[::1]:0", "--bootstrap", "a:1", "--metrics", "127.0.0.1:9"], env), config_file=None)


@pytest.mark.slow
def test_version() -> None:
    done = run_swarmd("--version")
    assert done.returncode == 0 and re.fullmatch(r"swarmd \d+\.\d+\.\d+\S*\n", done.stdout)


def test_example_file_documents_every_key_and_is_valid(tmp_path: Path) -> None:
    """Every daemon setting appears in systemd/swarmd.toml under its section, commented or not, with
    its environment variable named; the [dht] section (DHTConfig's own fields, which grow with the
    DHT) names the rule and its most tuned keys, each a real one; uncommenting everything loads."""
    text = EXAMPLE.read_text()
    section, seen = None, set()
    for line in text.splitlines():
        if m := re.fullmatch(r"\[(\w+)\]", line):
            section = m[1]
        elif m := re.fullmatch(r"(?:# )?(\w+) = .*", line):
            seen.add((section, m[1]))
    for name, f in c.settings():
        if name != "dht":
            assert (name, f.name) in seen, f"{name}.{f.name} missing from {EXAMPLE}"
            assert c.env_name(name, f.name) in text
    dht_keys = {f.name for name, f in c.settings() if name == "dht"}
    listed = {key for section, key in seen if section == "dht"}
    assert listed and listed <= dht_keys, listed - dht_keys
    uncommented = tmp_path / "all.toml"
    uncommented.write_text(re.sub(r"(?m)^# (\w+ = )", r"\1", text))
    load(["--config", str(uncommented)], {})
    load(["--config", str(EXAMPLE)], {})


def test_a_dht_combination_refused_by_dhtconfig_is_named_under_dht() -> None:
    """DHTConfig checks its fields together; the refusal is a ConfigError keyed `dht.<field>`."""
    with pytest.raises(c.ConfigError) as refused:
        load([], {"SWARMD_DHT_REFRESH_INTERVAL": "500"})
    assert refused.value.key == "dht.max_announce_ttl" and refused.value.source == "configuration"


@pytest.mark.slow
def test_dht_settings_are_configurable_with_their_own_kinds(tmp_path: Path) -> None:
    cfg = tmp_path / "d.toml"
    cfg.write_text('[dht]\nk = 8\nrpc_timeout = 3\nopen_namespaces = ["open", "scratch"]\n')
    got = load(["--config", str(cfg)], {"SWARMD_DHT_ALPHA": "2"})
    assert (got.dht.k, got.dht.rpc_timeout, got.dht.alpha) == (8, 3.0, 2)
    assert got.dht.open_namespaces == frozenset({"open", "scratch"})
    cfg.write_text("[dht]\nk = 2.5\n")
    done = run_swarmd("--config", str(cfg), "--check-config")
    assert done.returncode == EXIT_CONFIG and "dht.k" in done.stderr and len(done.stderr.splitlines()) == 1



def test_trainer_settings_make_the_daemons_trainer_config() -> None:
    """[trainer] reaches the TrainerConfig a daemon's trainers run with: ceilings, the floor and
    factor of the rate-derived timeout, and the takeover bound."""
    got = load([], {"SWARMD_TRAINER_TIMEOUT_FLOOR_S": "2", "SWARMD_TRAINER_BACKWARD_TIMEOUT_S": "200",
                    "SWARMD_TRAINER_TAKEOVER_MIN_S": "7"}).trainer.trainer_config()
    assert (got.backward_timeout_s, got.forward_timeout_s) == (200.0, 30.0)
    assert (got.wiring.timeout_floor_s, got.wiring.timeout_factor, got.takeover.min_s) == (2.0, 4.0, 7.0)
    polls = load([], {"SWARMD_TRAINER_STAGE_INFO_STRAGGLER_S": "0.25", "SWARMD_TRAINER_STAGE_INFO_SKIP_S": "3",
                      "SWARMD_TRAINER_STAGE_INFO_SKIP_MAX_S": "30"}).trainer.trainer_config()
    assert (polls.stage_info_straggler_s, polls.stage_info_skip_s, polls.stage_info_skip_max_s) == (0.25, 3.0, 30.0)
