"""What every chaos test needs around a `LocalSwarm`: a job to train, waiting on its progress while
sampling each daemon's memory, and the checks a run must pass however it was abused.

The swarm is driven from the test's own thread by polling (`job.get` on the trainer's daemon):
chaos is applied at step thresholds, not at times, so a slow, shared machine changes how long a
run takes but not what it exercises.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from jobspec import job_spec
from procfs import process_state, processes_mentioning  # noqa: F401 (ch.processes_mentioning)
from waiting import wait_for

from swarmd.client import ControlError, DaemonUnavailable
from swarmd.exitcodes import EXIT_OK
from swarmd.swarmproc import FAST_ENV, LocalSwarm, PeerProcess

#: FAST_ENV plus stage announcements refreshed every 2 s (expiring after 8): `job.get` then shows a
#: peer's step within seconds and forgets a killed one quickly, instead of the WAN's 30 s / 90 s.
#: Stages are placed by the test alone (`swarmctl serve`): no daemon joins a job's stages on its own
#: or moves between them, so each disturbance hits the stage the test means.
CHAOS_ENV = {**FAST_ENV, "SWARMD_DHT_REFRESH_INTERVAL": "2", "SWARMD_DHT_ANNOUNCE_TTL": "8",
             "SWARMD_JOBS_SERVE": "none", "SWARMD_REBALANCE_ENABLED": "false"}

#: A step takes well under a second here even on a loaded machine; a hung peer costs a heartbeat
#: timeout (10 s) plus a stage's missing-gradient grace (10 s) before the trainer re-sends around it.
STEP_TIMEOUT_S = 90.0
#: A peer that just started has not read the job's record from the DHT yet.
SERVE_TIMEOUT_S = 30.0
#: "Memory does not grow without bound", with room for allocator warm-up and a loaded machine:
#: the late RSS may be at most this factor of the early one, plus a fixed slack.
RSS_GROWTH_FACTOR = 1.5
RSS_SLACK_KIB = 96 * 1024
#: Job steps after a process's first sample before its memory counts (see check_memory).
WARM_STEPS = 20

def write_corpus(root: Path) -> Path:
    """A few hundred KiB of real text: the standard library's json and textwrap sources."""
    import json as json_module
    import textwrap

    corpus = root / "corpus.txt"
    texts = [Path(m.__file__).read_text() for m in (json_module, textwrap)]
    texts += [p.read_text() for p in sorted(Path(json_module.__file__).parent.glob("*.py"))]
    corpus.write_text("\n".join(texts))
    return corpus


def spec(name: str, steps: int, stages: int, data: Path) -> dict[str, Any]:
    """TINY_JOB on `data` without dropout, with samples of 32 tokens, AdamW and no checkpoints."""
    import tomllib

    return tomllib.loads(job_spec(name, seed=3, steps=steps, corpus=data, model={"dropout": 0.0}, data={"seq_len": 32},
                                  batch={"global_samples": 8}, optim={"name": "adamw", "lr": 1e-2, "clip_norm": 1.0},
                                  pipeline={"stages": stages}, checkpoint={"every_steps": 0}))


def rss_kib(pid: int | None) -> int | None:
    """Resident set size of a live process, from /proc (None once it is gone)."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


@dataclass
class Run:
    """One job on a local swarm: its trainer's daemon, its stage peers, and what was observed."""

    swarm: LocalSwarm
    trainer: PeerProcess
    job: str
    steps: int
    # (peer name, pid) -> [(job step when sampled, RSS KiB)]: a restart is a new process.
    rss: dict[tuple[str, int], list[tuple[int, int]]] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    last_step: int = 0  # the job's step at the last poll
    duplicates: int = 0  # microbatches summed on two peers, over the steps' records

    def note(self, text: str) -> None:
        self.log.append(f"{time.strftime('%H:%M:%S')} step {self.last_step}: {text}")
        print(self.log[-1], flush=True)

    def view(self) -> dict[str, Any]:
        return self.trainer.client().job(self.job)

    def sample_memory(self) -> None:
        for peer in self.swarm.live():
            kib = rss_kib(peer.pid)
            if kib is not None:
                self.rss.setdefault((peer.name, peer.pid), []).append((self.last_step, kib))

    def wait(self, what: str, predicate: Callable[[dict[str, Any]], bool], timeout: float = STEP_TIMEOUT_S) -> dict:
        """Poll `job.get` (sampling memory each time) until `predicate(view)`; fail with the swarm's story."""
        seen: dict[str, Any] = {}

        def reached() -> dict[str, Any] | None:
            view = self.view()
            seen.update(view)
            self.last_step = view["step"]
            self.sample_memory()
            if predicate(view):
                return view
            if view["state"] in ("failed", "cancelled"):
                raise AssertionError(f"job {view['state']} while waiting for {what}\n{self.story()}")
            return None

        return wait_for(reached, timeout, what, interval=0.3,
                        detail=lambda: f"at step {seen.get('step')}, {seen.get('status')}\n"
                                       f"{self.placement_seen(seen)}\n{self.story()}")

    def placement_seen(self, view: dict[str, Any]) -> str:
        """The last view's stages as `stage I: peer state@step [unreachable|not serving]`: what a
        wait on placement saw when it gave up."""
        names = {p.peer_id: p.name for p in self.swarm.peers}
        lines = []
        for stage in view.get("stages", []):
            entries = [f"{names.get(e['peer_id'], e['peer_id'][:8])} {e['state']}@{e['step']}"
                       + ("" if e["reachable"] else " unreachable") + ("" if e["serves"] else " not serving")
                       for e in stage["peers"]]
            lines.append(f"stage {stage['stage']}: " + (", ".join(entries) or "nobody"))
        return "\n".join(lines)

    def wait_step(self, step: int, timeout: float = STEP_TIMEOUT_S) -> dict:
        return self.wait(f"step {step}", lambda v: v["step"] >= step or v["state"] == "done", timeout)

    def serve(self, peer: PeerProcess, stage: int) -> None:
        """`swarmctl serve JOB --stage I` on that peer; retried while it has not yet seen the job."""

        def served() -> dict[str, Any] | None:
            try:
                return peer.client().serve(self.job, stage)
            except ControlError as exc:
                if exc.code != "not_found":
                    raise
                return None

        reply = wait_for(served, SERVE_TIMEOUT_S, f"{peer.name} to know the job and serve it", interval=0.3)
        assert reply["stage"] == stage

    def announced(self, view: dict[str, Any], peer: PeerProcess, stage: int) -> dict[str, Any] | None:
        """The peer's own announcement on that stage in a `job.get` view, if any."""
        for entry in view["stages"][stage]["peers"]:
            if entry["peer_id"] == peer.peer_id:
                return entry
        return None

    def serving_past(self, view: dict[str, Any], peer: PeerProcess, stage: int, step: int) -> bool:
        """The peer announces itself serving the stage at a step beyond `step`. Announcements are
        refreshed every 2 s, so they lag the job by a few steps: only "beyond a step the job had
        already passed" proves the peer caught up and commits with its mates."""
        entry = self.announced(view, peer, stage)
        return entry is not None and entry["state"] == "serving" and entry["step"] > step

    def story(self) -> str:
        tails = "\n".join(f"--- {p.name} ({'alive' if p.alive else 'dead'}):\n{p.log_tail(15)}"
                          for p in self.swarm.peers)
        return "chaos so far:\n" + "\n".join(self.log) + "\n" + tails


def hang_and_resume(run: Run, swarm: LocalSwarm, hung: PeerProcess, stage: int, settle_steps: int) -> None:
    """SIGSTOP a stage peer (its sockets stay open, it answers nothing): `settle_steps` commit
    around it while it stays stopped; SIGCONT: it announces serving a step past the job's step at
    the SIGCONT (it caught up from a mate and commits again)."""
    run.note(f"SIGSTOP {hung.name} (stage {stage})")
    swarm.stop(hung)
    hung_at = run.last_step
    run.wait_step(hung_at + settle_steps)
    assert process_state(hung.pid) == "T", f"{hung.name} must have stayed stopped while the steps committed"
    run.note(f"{run.last_step - hung_at} steps committed around the hung {hung.name}; SIGCONT")
    swarm.cont(hung)
    resumed_at = run.last_step
    run.wait(f"{hung.name} to announce a step past the ones it slept through",
             lambda v: run.serving_past(v, hung, stage, resumed_at))
    run.note(f"{hung.name} caught up")


def cancel(run: Run, trainer: PeerProcess) -> None:
    """Cancel the job and set `run.steps` to the last step its trainer committed, so
    `check_steps` checks every one of them from the first."""
    trainer.client().cancel(run.job)
    final = run.wait("the job to be cancelled", lambda v: v["state"] == "cancelled")
    run.note(f"cancelled at step {final['step']}")
    run.steps = max(e["step"] for e in trainer.client().logs(run.job) if e["kind"] == "step")
    assert run.steps >= run.last_step - 1, f"step events end at {run.steps}, the job was at {run.last_step}"


def submit(swarm: LocalSwarm, trainer: PeerProcess, raw_spec: dict[str, Any], data: Path) -> str:
    return trainer.client().submit(raw_spec, [str(data)])["job"]


def check_steps(run: Run, raw_spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every step committed once, each stage's step record covering exactly `global_samples` once its
    microbatches summed on two peers (`duplicates` in the step event: the record's summed_duplicates)
    are set apart, and the loss going down."""
    events = [e for e in run.trainer.client().logs(run.job) if e["kind"] == "step"]
    steps = [e["step"] for e in events]
    assert steps == list(range(1, run.steps + 1)), f"steps seen: {steps}"
    batch = raw_spec["batch"]
    unknown = 0
    for event in events:
        for stage, (samples, dups) in enumerate(zip(event["stage_samples"], event["duplicates"])):
            if samples < 0 or dups < 0:
                unknown += 1
                continue
            # Repeats a peer refused or dropped are in neither number (the record's dropped_repeats).
            assert samples - dups * batch["microbatch_samples"] == batch["global_samples"], (
                f"step {event['step']} stage {stage}: {samples} samples with {dups} microbatches summed twice")
    records = len(events) * raw_spec["pipeline"]["stages"]
    # A record a stage had not published yet when the trainer asked 5 times is reported as -1; rare.
    assert unknown <= records // 10, f"{unknown} of {records} stage step records unknown"
    run.duplicates = sum(d for e in events for d in e["duplicates"] if d > 0)
    losses = [e["loss"] for e in events]
    head, tail = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    assert tail < head - 0.3, f"loss did not decrease: first five {head:.3f}, last five {tail:.3f}"
    return events


def check_memory(run: Run, min_samples: int = 20) -> dict[str, tuple[int, int]]:
    """For each process sampled often enough once it has settled: the median RSS of its last fifth
    against that of its first fifth stays bounded. A process settles WARM_STEPS job steps after
    its first sample: before, it may still be importing torch, building its stage or downloading
    its state (a restarted peer's first seconds at ~200 MiB would make any later RSS look grown)."""
    report = {}
    for (name, pid), sampled in run.rss.items():
        samples = [s for s in sampled if s[0] >= sampled[0][0] + WARM_STEPS]
        if len(samples) < min_samples:
            continue
        fifth = len(samples) // 5
        early = statistics.median(k for _, k in samples[:fifth])
        late = statistics.median(k for _, k in samples[-fifth:])
        report[f"{name}/{pid}"] = (int(early), int(late))
        assert late <= early * RSS_GROWTH_FACTOR + RSS_SLACK_KIB, (
            f"{name} (pid {pid}) grew from {early / 1024:.0f} MiB to {late / 1024:.0f} MiB over the run")
    assert report, "no daemon was sampled long enough to judge its memory"
    return report


def drain_all(swarm: LocalSwarm) -> dict[str, int]:
    """`swarmctl drain` every live daemon, stage peers first and the trainer's last; each must exit 0."""
    statuses = {}
    for peer in sorted(swarm.live(), key=lambda p: p.name == "peer0"):
        try:
            statuses[peer.name] = swarm.drain(peer)
        except DaemonUnavailable as exc:
            statuses[peer.name] = -1
            print(f"{peer.name}: {exc}\n{peer.log_tail()}")
    bad = {name: rc for name, rc in statuses.items() if rc != EXIT_OK}
    assert not bad, f"daemons that did not exit cleanly: {bad}\n" + "\n".join(
        f"--- {p.name}:\n{p.log_tail()}" for p in swarm.peers if p.name in bad)
    return statuses


def dump(path: Path, run: Run, events: list[dict[str, Any]], memory: dict[str, tuple[int, int]]) -> None:
    """What the run saw, for a person reading a failure or the docs' figures."""
    path.write_text(json.dumps({"log": run.log, "memory_kib": memory, "duplicates": run.duplicates,
                                "losses": [e["loss"] for e in events]}, indent=1) + "\n")
