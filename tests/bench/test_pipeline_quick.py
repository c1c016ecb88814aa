"""bench/pipeline.py at its smallest size, run for real, and its helpers on known inputs.

The quick run starts five real `swarmd` processes (2 stages x 2 peers + the trainer's daemon),
kills stage peers with SIGKILL and restarts them, and measures wire bytes over real loopback TCP,
in-process by codec and from the daemons' own transport counters for the swarm's codec.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from benchmod import load_bench
from procfs import processes_mentioning
from waiting import wait_for

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "pipeline.py"
#: `--quick` takes about a minute on a busy 2-core machine, most of it starting daemons.
QUICK_TIMEOUT_S = 170


pb = load_bench("pipeline.py")


@pytest.mark.slow
def test_quick_run_reports_sane_figures():
    """1. Run the bench at its smallest size (--quick): 2 stages x 2 peers, a 6 s no-fault window, a 10 s
          fault window with a SIGKILL + restart every 4 s, wire bytes for every codec.
       Expected: exit 0 and one JSON object with positive rates, ratios above 0, at least one
       preemption, wire bytes ordered int8 < fp16 < none (fp16+lz4 and lz4 no larger than what they
       compress), the swarm's own bytes per sample (from its daemons' counters) positive, the swarm-wide
       count at least the trainer daemon's, both within a small factor of the in-process figure for
       the same codec, the config it ran; and no swarmd process of the run is left afterwards."""
    # The bench's daemons put Unix sockets under TMPDIR, three folders deep: pytest's tmp_path under a
    # worker's basetemp can push them past AF_UNIX's 107 bytes, so the run gets a short folder of its own.
    with tempfile.TemporaryDirectory(prefix="swp-", dir="/tmp") as short:
        report, elapsed = _quick_run(Path(short))
        assert processes_mentioning(short) == []  # the bench's daemons have their state dir on theirs
    _check_quick_report(report, elapsed)


def _quick_run(tmp: Path) -> tuple[dict, float]:
    started = time.monotonic()
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True,
                         timeout=QUICK_TIMEOUT_S, env={**os.environ, "TMPDIR": str(tmp)})
    elapsed = time.monotonic() - started
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, run.stdout
    report = json.loads(lines[0])
    return report, elapsed


def _check_quick_report(report: dict, elapsed: float) -> None:
    print(f"quick pipeline bench in {elapsed:.0f} s: local {report['local_samples_per_s']:.1f}, swarm "
          f"{report['swarm_samples_per_s']:.1f}, faults {report['faults']['samples_per_s']:.1f} samples/s, "
          f"{report['faults']['preemptions']} preemptions; bytes/sample {report['wire_bytes_per_sample']}")

    assert report["local_samples_per_s"] > 0 and report["swarm_samples_per_s"] > 0
    assert report["swarm_to_local_ratio"] == pytest.approx(
        report["swarm_samples_per_s"] / report["local_samples_per_s"], rel=1e-2)
    faults = report["faults"]
    assert faults["samples_per_s"] > 0 and faults["ratio_to_no_faults"] > 0
    assert faults["preemptions"] >= 1 and faults["rejoined"] >= 1 and faults["mean_rejoin_s"] > 0
    assert len(faults["victims"]) == faults["preemptions"] and faults["restart_failures"] == 0
    assert report["swarm"]["job_state"] == "running" and report["swarm"]["peers"] == 4
    windows = report["swarm"]["windows"]
    assert set(windows) == {"no_faults_before", "no_faults_after"}  # the fault window is bracketed
    assert sum(w["steps"] for w in windows.values()) == report["swarm"]["steps"]
    local = report["local"]
    assert local["before"]["samples_per_s"] > 0 and local["after"]["samples_per_s"] > 0

    wire = report["wire_bytes_per_sample"]
    assert set(wire) == {"none", "fp16", "lz4", "fp16+lz4", "int8"}
    assert 0 < wire["int8"] < wire["fp16"] < wire["none"]
    assert wire["lz4"] <= wire["none"] * 1.01 and wire["fp16+lz4"] <= wire["fp16"] * 1.01
    # Per sample, at least the activations that must cross: stage 0's output and stage 1's input
    # gradient, fp32 (B=1 row of T x C), on top of token ids.
    assert wire["none"] > 2 * 16 * 32 * 4

    counted = report["swarm"]["wire"]
    print(f"daemons' counters, {counted['codec']}: {counted}; to in-process x{report['swarm_wire_to_in_process']}")
    assert counted["codec"] == report["config"]["codec"] and counted["samples"] > 0
    assert report["swarm_wire_bytes_per_sample"] == counted["trainer_bytes_per_sample"] > 0
    # Every byte the trainer's daemon received was sent by some daemon of the run (the snapshots of
    # the daemons are a few ms apart, hence the slack).
    assert counted["swarm_sent_bytes"] >= 0.95 * counted["trainer_bytes"]
    # The same links counted by the transport and by the kernel: the daemon's figure adds DHT and
    # liveness traffic and hellos, and its steps overlap the window edges, so not equal, but close.
    assert 0.5 < report["swarm_wire_to_in_process"] < 4

    # Control traffic is measured, briefly (2 s per size): its figure is the full run's to judge.
    assert set(report["control_traffic"]) == {"2", "4", "8"} and min(report["control_traffic"].values()) > 0

    config = report["config"]
    assert config["quick"] and {k: config[k] for k in pb.QUICK} == pb.QUICK


def test_quick_sets_the_defaults_and_explicit_flags_win():
    args = pb.parse_args(pb.build_parser(), ["--quick", "--d-model", "64"])
    assert args.stages == pb.QUICK["stages"] and args.kill_every == pb.QUICK["kill_every"]
    assert args.d_model == 64
    assert pb.parse_args(pb.build_parser(), []).stages == 4


def test_windowed_rate_counts_steps_committed_inside_the_window():
    """Step events at known times: the rate is (committed at end - committed at start) x batch / length."""
    run = pb.SwarmRun(events=[{"kind": "step", "ts": 10.0 + i, "step": i + 1} for i in range(20)]
                      + [{"kind": "info", "ts": 12.5, "step": 99}])
    run.windows["w"] = (12.5, 17.5)  # steps 3 (ts 12) and 8 (ts 17) committed by then
    got = run.window(("w",), 8)
    assert got["steps"] == 5 and got["samples_per_s"] == pytest.approx(5 * 8 / 5.0)
    run.windows["v"] = (20.5, 29.5)  # steps 11 (ts 20) and 20 (ts 29): 9 more in 9 s
    both = run.window(("w", "v"), 8)
    assert both["steps"] == 14 and both["samples_per_s"] == pytest.approx(14 * 8 / 14.0)
    assert run.committed_by(0.0) == 0


def test_wire_bytes_come_from_the_daemons_counters_over_the_windows():
    """Counter snapshots at known values: the trainer's daemon's sent + received and every daemon's
    sent bytes, over the windows' steps times the batch; a counter that went back is refused."""
    run = pb.SwarmRun(events=[{"kind": "step", "ts": 10.0 + i, "step": i + 1} for i in range(20)])
    run.windows = {"a": (12.5, 17.5), "b": (20.5, 29.5)}  # 5 steps, then 9
    run.traffic = {"a": ({"t": (100, 50), "s": (10, 20)}, {"t": (600, 850), "s": (710, 520)}),
                   "b": ({"t": (600, 850), "s": (710, 520)}, {"t": (900, 1050), "s": (1010, 720)})}
    got = run.wire(("a", "b"), "t", 2)
    assert got["samples"] == 28 and got["trainer_bytes"] == (1450 - 150) + (1950 - 1450)
    assert got["trainer_bytes_per_sample"] == pytest.approx(got["trainer_bytes"] / 28)
    assert got["swarm_sent_bytes"] == (500 + 700) + (300 + 300)
    run.traffic["b"] = ({"t": (600, 850), "s": (710, 520)}, {"t": (900, 1050), "s": (5, 720)})
    with pytest.raises(RuntimeError, match="went back in window b"):
        run.wire(("a", "b"), "t", 2)


def test_socket_bytes_counts_what_the_kernel_carried():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            peer, _ = server.accept()
            with peer:
                before = pb.socket_bytes(client)
                client.sendall(b"x" * 100_000)
                got = 0
                while got < 100_000:
                    got += len(peer.recv(1 << 20))
                peer.sendall(b"y" * 777)
                got = 0
                while got < 777:
                    got += len(client.recv(1 << 20))
                wait_for(lambda: pb.socket_bytes(client) - before >= 100_777, 10,  # the last ACK may trail the reply
                         "the socket's byte count to take in the last ACK", interval=0.01)
                assert pb.socket_bytes(client) - before == 100_777


@pytest.mark.parametrize("argv, message", [
    (["--stages", "0"], "--stages must be at least 1"),
    (["--global-samples", "10", "--microbatch-samples", "4"], "the job these flags describe is invalid"),
    (["--peers-per-stage", "1"], "faults need --peers-per-stage >= 2"),
    (["--kill-every", "0"], "must be positive"),
    (["--trainers", "9"], "--trainers cannot exceed"),
    (["--codecs", "none,zstd"], "unknown codec"),
    pytest.param(["--device", "cuda"], "needs a CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")),
    (["--device", "tpu"], "needs a CUDA device"),
])
def test_bad_flags_are_refused_before_any_work(argv, message, capsys):
    parser = pb.build_parser()
    with pytest.raises(SystemExit) as exc:
        pb.check_args(parser, pb.parse_args(parser, argv))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
