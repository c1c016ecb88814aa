"""A stage-1 mate behind a slow uplink during all-reduce (issue 14): real daemons, the mate in its
own network namespace whose egress is shaped by `tc tbf` (bench/netns.py; the other direction stays
fast). Needs root for the namespaces; skipped with the reason otherwise (CI runs as root).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import chaos_harness as ch  # noqa: E402
from netns_link import MARKS, netns  # noqa: E402

from swarmd.swarmproc import LocalSwarm, SwarmSettings  # noqa: E402

pytestmark = MARKS

STEPS = 30
FAST_MBIT = 200
#: The slow mate's uplink: its stage's gradient (d_model 128: 230k parameters, about 0.46 MB in
#: the all-reduce's fp16) takes ~1 s to leave, against a few ms the other way; its measured send
#: rate is far below its mate's. A smaller stage would send less than the 64 KiB a send rate is
#: measured from, and the test would rest only on the mate being late.
SLOW_MBIT = 4
D_MODEL = 128


@pytest.mark.slow
def test_a_stage_mate_with_a_slow_uplink_owns_no_shard_and_the_job_trains_exactly(tmp_path: Path) -> None:
    """1. Namespaces a and b joined by a veth pair: a's egress 200 Mbit/s, b's 4 Mbit/s.
       2. In a: peer0 (trains), peer1 (stage 0), peer2 (stage 1); in b: peer3 (stage 1). Both
          stage-1 mates are announced before stage 0 is served, so no step trains without them.
       Expected: the job finishes (I3); every step's stage records hold exactly global_samples
       with no microbatch summed twice (I1) and the loss goes down; once its rate is measured the
       slow mate owns no shard in its stage's rounds (the leader's log says so), so the all-gather
       never waits on its uplink; every daemon exits 0 when drained and no process is left."""
    data = ch.write_corpus(tmp_path)
    raw = ch.spec("chaos-slow-uplink", STEPS, 2, data)
    raw["model"]["d_model"] = D_MODEL
    with netns.shaped_link(rate_mbit=FAST_MBIT) as link:
        subprocess.run(["tc", "-n", link.ns_b, "qdisc", "change", "dev", link.dev_b, "root", "tbf", "rate",
                        f"{SLOW_MBIT}mbit", "burst", netns.DEFAULT_BURST, "latency", netns.DEFAULT_LATENCY],
                       check=True, capture_output=True)
        swarm = LocalSwarm(tmp_path / "swarm", SwarmSettings(log_level="info", env=ch.CHAOS_ENV))
        try:
            trainer = swarm.spawn(host=link.addr_a, netns=link.ns_a)
            p1 = swarm.spawn(bootstrap=(trainer.address,), host=link.addr_a, netns=link.ns_a)
            p2 = swarm.spawn(bootstrap=(trainer.address,), host=link.addr_a, netns=link.ns_a)
            p3 = swarm.spawn(bootstrap=(trainer.address,), host=link.addr_b, netns=link.ns_b)
            swarm.wait_ready([trainer, p1, p2, p3])
            run = ch.Run(swarm, trainer, ch.submit(swarm, trainer, raw, data), STEPS)
            # Both stage-1 mates are announced before stage 0 has a peer, so the job cannot train
            # a step without the slow mate: a job of 0.1 s steps would otherwise run to its end
            # while the slow mate, joining late, only downloads state and never meets a round.
            run.serve(p3, 1)
            run.serve(p2, 1)
            run.wait("both stage-1 mates announced",
                     lambda v: all(run.announced(v, p, 1) is not None for p in (p2, p3)), timeout=60)
            run.serve(p1, 0)
            final = run.wait("the job to finish", lambda v: v["state"] == "done", timeout=600)
            assert final["step"] == STEPS
            events = ch.check_steps(run, raw)
            # Two ways keep its uplink out of the rounds' critical path, and either is enough: the
            # stage gives it no shard (its leader logs it), or the trainer, which measures the slow
            # mate's calls slow too (its replies cross the same uplink), withholds work from it, so
            # it holds nothing of a step and is no round's member (it catches up by download).
            logs = p2.log_path.read_text(errors="replace") + p3.log_path.read_text(errors="replace")
            no_shard = [line for line in logs.splitlines() if "own no shard" in line and p3.peer_id[:8] in line]
            withheld = [line for line in trainer.log_path.read_text(errors="replace").splitlines()
                        if "withheld for slowness" in line and p3.address in line]
            assert no_shard or withheld, f"the slow mate kept its shard and its work\n{run.story()}"
            print(f"{len(no_shard)} rounds with the slow mate owning no shard, withheld by the trainer "
                  f"{len(withheld)} times; losses {events[0]['loss']:.3f} -> {events[-1]['loss']:.3f}")
            ch.drain_all(swarm)
        finally:
            swarm.close()
    assert ch.processes_mentioning(str(tmp_path)) == []
