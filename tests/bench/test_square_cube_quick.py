"""bench/square_cube.py's model and measuring helpers on tiny sizes; the benchmark itself is run by hand.

The pure formulas are checked against hand-computed values, the stage measurement on a 64-wide
block, and the real-run path (stage RPC server, microbatches in flight) over loopback sockets.
"""

from __future__ import annotations

import pytest
import torch
from benchmod import load_bench

from transport.rpc import Message, Pool, RpcConfig, RpcServer


sc = load_bench("square_cube.py")
torch.set_num_threads(1)


def test_fit_exponent_recovers_a_power_law():
    xs = [256, 512, 1024, 2048]
    assert sc.fit_exponent(xs, [3.0 * x**1.5 for x in xs]) == pytest.approx(1.5, abs=1e-9)
    noisy = [7.0 * x**2 * f for x, f in zip(xs, (1.05, 0.95, 1.04, 0.97))]
    assert sc.fit_exponent(xs, noisy) == pytest.approx(2.0, abs=0.05)


@pytest.mark.parametrize("xs, ys", [([1.0], [1.0]), ([1.0, 2.0], [1.0]), ([1.0, 2.0], [0.0, 1.0]),
                                    ([2.0, 2.0], [1.0, 3.0])])
def test_fit_exponent_refuses_what_has_no_slope(xs, ys):
    with pytest.raises(ValueError):
        sc.fit_exponent(xs, ys)


def test_transfer_time_is_bytes_over_goodput():
    assert sc.transfer_s(25e6, 200, 1.0) == pytest.approx(1.0)  # 200 Mb/s = 25 MB/s
    assert sc.transfer_s(25e6, 200, 0.5) == pytest.approx(2.0)
    for rate, goodput in ((0, 0.9), (200, 0.0), (200, 1.2)):
        with pytest.raises(ValueError):
            sc.transfer_s(1, rate, goodput)


def test_traffic_counts_the_trainer_mediated_protocol():
    """The stage receives x twice (forward, then with dy for backward) and sends y and dx."""
    t = sc.stage_traffic(x_act=10, y_act=20, x_grad=11, dy=30, dx=40)
    assert (t.inbound, t.outbound, t.total) == (51, 60, 111)


def test_period_overlap_model():
    # one in flight: nothing overlaps, every term adds up
    assert sc.microbatch_period(1.0, 0.3, 0.2, 0.2, 1) == pytest.approx(1.7)
    # enough in flight and compute is the busiest resource: communication is hidden entirely
    assert sc.microbatch_period(1.0, 0.3, 0.2, 0.2, 4) == pytest.approx(1.0)
    # the inbound link is the busiest resource: it sets the period however many are in flight
    assert sc.microbatch_period(1.0, 2.5, 0.2, 0.2, 8) == pytest.approx(2.5)
    # in between, the cycle shared among the in-flight microbatches
    assert sc.microbatch_period(1.0, 0.9, 0.9, 0.2, 2) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        sc.microbatch_period(1.0, 0.1, 0.1, 0.0, 0)


def test_utilization_is_compute_over_compute_plus_unhidden():
    period = sc.microbatch_period(1.0, 0.9, 0.9, 0.2, 2)
    assert sc.utilization(1.0, period) == pytest.approx(1.0 / (1.0 + 0.5))


def test_square_cube_law_on_synthetic_points():
    """Compute ~n², bytes ~n: compute/communication has exponent 1, and utilisation without overlap
    rises with n at every bandwidth, higher at higher bandwidth."""
    ns = [256, 512, 1024, 2048]
    figures = [sc.point_figures(1e-7 * n * n, sc.Traffic(2000 * n, 1000 * n), 0.95, 0.1, 4) for n in ns]
    ratios = [f["compute_to_comm_200mbps"] for f in figures]
    assert sc.fit_exponent(ns, ratios) == pytest.approx(1.0, abs=0.01)
    for key in ("utilization_100mbps_one_in_flight", "utilization_500mbps_one_in_flight"):
        values = [f[key] for f in figures]
        assert values == sorted(values) and values[0] < values[-1]
    for f in figures:
        assert f["utilization_100mbps"] <= f["utilization_200mbps"] <= f["utilization_500mbps"] <= 1.0
        assert f["utilization_200mbps_one_in_flight"] <= f["utilization_200mbps"]


def test_measure_point_on_a_tiny_stage():
    point = sc.measure_point(64, 1, False, 1, torch.device("cpu"))
    act = sc.SEQ_LEN * 64  # elements of one (1, 512, 64) tensor
    assert point["wire_bytes_by_codec"]["none"] == 5 * act * 4  # x, x, dy in; y, dx out
    assert point["wire_bytes_by_codec"]["fp16"] == 5 * act * 2
    assert point["wire_bytes_by_codec"]["int8"] < point["wire_bytes_by_codec"]["fp16"]
    assert point["wire_bytes"] == point["wire_bytes_by_codec"][sc.DEFAULT_CODEC]
    assert point["wire_bytes_in"] + point["wire_bytes_out"] == point["wire_bytes"]
    assert point["compute_s"] == pytest.approx(point["forward_s"] + point["recompute_backward_s"], abs=1e-4)
    assert point["forward_s"] > 0 and point["recompute_backward_s"] > 0


async def test_stage_server_answers_like_local_compute():
    """Over loopback: the stage's backward over RPC (codec none) returns the same dx as computing it
    here, and microbatches in flight report a positive period and the server's compute."""
    config = sc.stage_config(64, 1, False)
    t = sc.stage_tensors(config, sc.SEED, torch.device("cpu"))
    served = sc.build_stage(config, 1, 3, sc.SEED)
    with sc.ThreadPoolExecutor(max_workers=1) as executor:
        server = await RpcServer.serve_tcp(sc.stage_router(served, executor, "none"), "127.0.0.1", 0, RpcConfig())
        pool = Pool(RpcConfig())
        try:
            address = ("127.0.0.1", server.port)
            reply = await pool.call(address, "backward", Message({}, [t.x, t.dy], codec="none"), timeout=30)
            assert torch.equal(reply.tensors[0], t.dx)
            run = await sc.run_microbatches(pool, address, t.x, t.dy, "none", in_flight=2, count=4)
            assert run["measured_s_per_microbatch"] > 0 and run["server_compute_s_per_microbatch"] > 0
            with pytest.raises(ValueError):
                await sc.run_microbatches(pool, address, t.x, t.dy, "none", in_flight=2, count=2)
        finally:
            await pool.close()
            await server.close()


def test_plot_writes_a_png(tmp_path):
    figures = [{"n": n, "compute_s": 1e-7 * n * n,
                **sc.point_figures(1e-7 * n * n, sc.Traffic(2000 * n, 1000 * n), 0.95, 0.1, 4)} for n in (256, 512)]
    path = sc.plot(figures, sc.BANDWIDTHS_MBIT, 4, tmp_path / "out" / "sc.png", "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [(["--sizes", "4096"], "exceeds 2048 without --gpu"),
                                           (["--sizes", "100"], "multiple of 64"),
                                           (["--layers", "0"], "--layers must be at least 1")])
def test_bad_arguments_are_refused_before_any_work(argv, message, capsys):
    parser = sc.build_parser()
    args = parser.parse_args(argv)
    with pytest.raises(SystemExit) as exc:
        sc.check_args(parser, args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
