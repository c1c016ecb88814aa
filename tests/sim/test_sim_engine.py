"""The simulator: determinism, move cost accounting, the rules' behaviour on small hand-made traces."""

import json

import pytest

from swarmd.rebalance.policy import PolicyConfig, choose_join_stage
from swarmd.rebalance.table import PeerLoad, StageTable
from swarmd.sim.__main__ import main
from swarmd.sim.engine import Rule, SimConfig, simulate, standard_rules
from swarmd.sim.experiment import Variant, run_variant
from swarmd.sim.trace import TraceEvent, TraceModel, generate

SMALL = TraceModel(peers=60, hours=3.0)


def joins(n, time=0.0, prefix="p"):
    return [TraceEvent(time, "join", f"{prefix}{i}", 1.0) for i in range(n)]


def test_same_seed_same_result_different_seed_different_result():
    events = generate(SMALL, seed=4)
    config = SimConfig(stages=4)
    for rule in standard_rules().values():
        a = simulate(events, rule, config, seed=4, timeline=True)
        b = simulate(events, rule, config, seed=4, timeline=True)
        assert (a.ratio, a.moves, a.timeline) == (b.ratio, b.moves, b.timeline)
    none = standard_rules()["none"]
    assert simulate(events, none, config, seed=4).ratio != simulate(events, none, config, seed=5).ratio


def test_move_cost_the_mover_serves_nothing_while_it_downloads():
    """3 peers bottleneck-join 2 stages (2|1); the lone peer leaves at t=100 (2|0, throughput 0).
    Checks every 20 s without jitter: the check at t=100 names one mover, its confirming check at
    t=105 moves it, it serves from t=165. Expected work: 100 s at 1, 65 s at 0, 235 s at 1."""
    table = StageTable(2)
    for name in ("p0", "p1", "p2"):
        table.put(PeerLoad(name.encode(), choose_join_stage(table, name.encode()), 1.0))
    lone = next(pid.decode() for pid, peer in table.by_id.items() if len(table.members[peer.stage]) == 1)
    events = joins(3) + [TraceEvent(100.0, "leave", lone, 0.0)]
    policy = PolicyConfig(period_s=20.0, jitter=0.0, confirm_after_s=5.0)
    rule = Rule("swarmd", joins="bottleneck", policy=policy)
    result = simulate(events, rule, SimConfig(stages=2, move_cost_s=60.0), duration_s=400.0)
    assert result.moves == 1
    assert result.moving_peer_s == pytest.approx(60.0)
    assert result.throughput_avg * 400.0 == pytest.approx(100.0 + 235.0)
    assert result.optimal_avg == pytest.approx(1.0)


def test_none_never_moves_and_paper_rule_does():
    events = generate(SMALL, seed=1)
    rules = standard_rules()
    assert simulate(events, rules["none"], SimConfig(stages=4)).moves == 0
    assert simulate(events, rules["T300"], SimConfig(stages=4)).moves > 0


def test_rebalancing_beats_none_and_swarmd_beats_the_paper_rule_on_a_small_swarm():
    variant = Variant("small", SMALL, SimConfig(stages=4))
    summary, _ = run_variant(variant, standard_rules(), seeds=[0, 1])
    p = summary["policies"]
    assert p["none"]["mean"] < p["T300"]["mean"] < p["swarmd"]["mean"] <= 1.0 + 1e-9
    assert 0 < p["swarmd"]["moving_share"] < 0.05


def test_cli_prints_json_and_refuses_a_bad_trace(tmp_path, capsys):
    assert main(["--hours", "0.5", "--peers", "40", "--stages", "4", "--rules", "none,swarmd"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["rules"]) == {"none", "swarmd"}
    bad = tmp_path / "bad.csv"
    bad.write_text("time,event,peer,speed\n0,leave,x,\n")
    assert main(["--trace", str(bad)]) == 2
    assert "not live" in capsys.readouterr().err
    assert main(["--rules", "nope", "--hours", "0.1"]) == 2


def test_plot_writes_a_png_of_throughput_against_optimum(tmp_path):
    from swarmd.sim.plot import plot_timelines

    events = generate(SMALL, seed=2)
    results = {name: simulate(events, rule, SimConfig(stages=4), seed=2, timeline=True)
               for name, rule in standard_rules().items() if name in ("none", "swarmd")}
    path = plot_timelines({"small": results}, tmp_path / "out" / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
