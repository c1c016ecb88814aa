"""A swarm split across a slow link: two network namespaces joined by a veth pair shaped by `tc tbf`.

The trainer's daemon and stage 0 live in namespace a, stage 1's peers in namespace b, so every
activation and gradient between the stages crosses the shaped link (bench/netns.py). Mid-run a
far-side peer is SIGKILLed and a fresh one joins across the link, and the link is slowed further.
Needs root for the namespaces; skipped with the reason otherwise (CI runs as root).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import chaos_harness as ch  # noqa: E402
from netns_link import MARKS, netns  # noqa: E402

from swarmd.swarmproc import LocalSwarm, SwarmSettings  # noqa: E402

pytestmark = MARKS

STEPS = 150
SETTLE_STEPS = 10
#: Slow enough that the link, not loopback speed, carries the stages' traffic; the tiny model's
#: activations (a few KiB per microbatch) still fit many steps a second.
RATE_MBIT = 20
SLOWER_MBIT = 10


def sent_bytes(qdisc_stats: str) -> int:
    match = re.search(r"Sent (\d+) bytes", qdisc_stats)
    assert match, qdisc_stats
    return int(match.group(1))


@pytest.mark.slow
def test_training_across_a_tbf_link_survives_a_far_side_kill(tmp_path: Path) -> None:
    """1. Namespaces a and b joined by a veth pair, tbf at 20 Mbit/s on both ends.
       2. In a: peer0 (trains) and peer1 (serves stage 0); in b: peer2 and peer3 (stage 1),
          bootstrapping across the link.
       3. After some steps, SIGKILL peer2; a fresh peer4 in b joins across the link and serves
          stage 1; the link drops to 10 Mbit/s for the rest of the run.
       Expected: every step committed, each stage's record covering global_samples, the loss lower
       at the end, bounded RSS, both ends' tbf qdiscs passed the stages' traffic, every daemon
       exits 0 when drained, and no process is left."""
    data = ch.write_corpus(tmp_path)
    raw = ch.spec("chaos-tbf", STEPS, 2, data)
    with netns.shaped_link(rate_mbit=RATE_MBIT) as link:
        swarm = LocalSwarm(tmp_path / "swarm", SwarmSettings(log_level="info", env=ch.CHAOS_ENV))
        try:
            trainer = swarm.spawn(host=link.addr_a, netns=link.ns_a)
            p1 = swarm.spawn(bootstrap=(trainer.address,), host=link.addr_a, netns=link.ns_a)
            p2 = swarm.spawn(bootstrap=(trainer.address,), host=link.addr_b, netns=link.ns_b)
            p3 = swarm.spawn(bootstrap=(p2.address,), host=link.addr_b, netns=link.ns_b)
            swarm.wait_ready([trainer, p1, p2, p3])
            run = ch.Run(swarm, trainer, ch.submit(swarm, trainer, raw, data), STEPS)
            for peer, stage in ((p1, 0), (p2, 1), (p3, 1)):
                run.serve(peer, stage)
            run.wait_step(SETTLE_STEPS)
            before = sent_bytes(link.qdisc_stats("a")), sent_bytes(link.qdisc_stats("b"))

            run.note("SIGKILL peer2 (stage 1, across the link)")
            swarm.kill(p2)
            p4 = swarm.spawn(bootstrap=(trainer.address, p3.address), host=link.addr_b, netns=link.ns_b)
            swarm.wait_ready([p4])
            run.serve(p4, 1)
            run.note(f"peer4 serves stage 1; link slowed to {SLOWER_MBIT} Mbit/s")
            link.set_rate(SLOWER_MBIT)
            slowed_at = run.last_step
            run.wait("peer4 to serve stage 1 past the step it joined at",
                     lambda v: run.serving_past(v, p4, 1, slowed_at))
            run.wait_step(slowed_at + SETTLE_STEPS)
            assert slowed_at + SETTLE_STEPS < STEPS, "the kill and the slow-down must land before the last step"

            final = run.wait("the job to finish", lambda v: v["state"] == "done", timeout=240)
            assert final["step"] == STEPS
            after = sent_bytes(link.qdisc_stats("a")), sent_bytes(link.qdisc_stats("b"))
            # Each direction carried the stages' traffic for every step after the first ten:
            # a few KiB of activations (a -> b) and as many of gradients (b -> a) per microbatch.
            per_step = raw["batch"]["global_samples"] * raw["data"]["seq_len"] * raw["model"]["d_model"]
            for side, (b0, b1) in zip("ab", zip(before, after)):
                assert b1 - b0 > per_step * (STEPS - SETTLE_STEPS), f"link end {side} sent only {b1 - b0} bytes"
            events = ch.check_steps(run, raw)
            memory = ch.check_memory(run)
            ch.dump(tmp_path / "chaos-tbf.json", run, events, memory)
            print({name: f"{e // 1024}->{late // 1024} MiB" for name, (e, late) in memory.items()},
                  {"sent_a": after[0], "sent_b": after[1]})
            ch.drain_all(swarm)
        finally:
            swarm.close()
    assert ch.processes_mentioning(str(tmp_path)) == []
