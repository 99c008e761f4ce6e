"""`pdcluster bench curve --quick`: the three kinds of socket (plaintext, shared-key CURVE,
per-principal identity) each answer every round trip — a message the identity server's checks
refused would leave its round trip without a reply and fail the run — and every figure and
ratio is reported."""

from __future__ import annotations

import json

from pdcluster.benchmarks.curve_bench import KINDS, _turn
from pdcluster.cluster.cli import main


def test_bench_curve_reports_every_kind_and_ratio(capsys):
    assert main(["bench", "curve", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for name in ("handshake_ms", "rtt_us_p50", "rtt_us_p99", "side_channel_rtt_us_p50"):
        for kind in KINDS:
            assert result[f"{name}_{kind}"] > 0, (name, kind)
        assert result[f"{name}_ratio"] > 0 and result[f"{name}_identity_ratio"] > 0
    assert result["bulk_mbps_plain"] > 0 and result["bulk_mbps_curve"] > 0


def test_kinds_take_turns_in_a_rotating_order():
    orders = [_turn(i) for i in range(len(KINDS))]
    assert all(sorted(order) == sorted(KINDS) for order in orders)
    assert {order[0] for order in orders} == set(KINDS)  # each kind leads once per cycle
