"""The planner's pure decision (router/planning): the capacity model's queueing math and online
calibration, and the planner's targets on recorded signals — ramps, a burst, a dip, noise —
with hysteresis, cool-downs, bounds and the node cap. An injected clock throughout."""

from __future__ import annotations

import math
import random

import pytest

from pdcluster.router.planning.capacity import CapacityModel, Workload, erlang_c, wait_exceeds
from pdcluster.router.planning.planner import (
    PlanDecision,
    Planner,
    PlannerConfig,
    RoleBounds,
    Signals,
)

WINDOW_S = 10.0


def make_signals(rate: float, num_prefill: int, num_decode: int, *, prefill_tokens=3000.0,
                 output_tokens=300.0, context_tokens=4000.0, queued=0.0, ttft=None,
                 itl=None) -> Signals:
    return Signals(WINDOW_S, round(rate * WINDOW_S), prefill_tokens, output_tokens,
                   context_tokens, num_prefill, num_decode, queued, ttft, itl)


def make_config(**overrides) -> PlannerConfig:
    fields = {"slo_ttft_s": 2.0, "slo_itl_s": 0.05, "prefill": RoleBounds(1, 16),
              "decode": RoleBounds(1, 16), "interval_s": WINDOW_S, **overrides}
    return PlannerConfig(**fields)


class Replayer:
    """Feeds recorded rates to a planner, applying each decision as the cluster would."""

    def __init__(self, planner: Planner, num_prefill: int = 1, num_decode: int = 1) -> None:
        self.planner, self.now = planner, 0.0
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.decisions: list[PlanDecision] = []

    def step(self, rate: float, **kw) -> PlanDecision:
        self.now += WINDOW_S
        decision = self.planner.decide(make_signals(rate, self.num_prefill, self.num_decode,
                                                    **kw), self.now)
        self.num_prefill, self.num_decode = decision.prefill, decision.decode
        self.decisions.append(decision)
        return decision

    def run(self, rates: list[float], **kw) -> list[tuple[int, int]]:
        return [(d.prefill, d.decode) for d in (self.step(r, **kw) for r in rates)]


# ---- the capacity model ----------------------------------------------------------------------

def test_erlang_c_matches_known_values() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(3, 3.0) == 1.0 and erlang_c(4, 0.0) == 0.0
    # the waiting-time tail of M/M/1: rho * exp(-(mu - lambda) t)
    assert wait_exceeds(1, 0.5, 1.0, 2.0) == pytest.approx(0.5 * math.exp(-1.0))
    assert wait_exceeds(2, 1.0, 1.0, -0.1) == 1.0


def test_prefill_nodes_grow_with_rate_and_backlog() -> None:
    model = CapacityModel(prefill_tokens_per_s=10_000)
    need = [model.prefill_nodes(Workload(rate, 3000, 300, 4000), 2.0, 0.02, 32)
            for rate in (1, 5, 10, 20, 40)]
    assert need == sorted(need) and need[0] == 1
    # 40 req/s x 0.305 s = 12.2 Erlangs: more than 12 nodes, not many more
    assert 13 <= need[-1] <= 16
    backlog = Workload(10, 3000, 300, 4000, queued_prefill_tokens=200_000)
    assert model.prefill_nodes(backlog, 2.0, 0.02, 32) > need[2]


def test_decode_nodes_from_the_itl_slo() -> None:
    model = CapacityModel(step_base_s=0.012, step_per_seq_s=0.0002, step_per_ctx_token_s=4e-8)
    # per sequence 0.2 ms + 4000 x 40 ns = 0.36 ms: 105 sequences within 50 ms
    assert model.max_batch_for(0.05, 4000) == 105
    assert model.max_batch_for(0.05, 100_000) == 4  # KV memory: 450k tokens / 100k
    need = [model.decode_nodes(Workload(rate, 3000, 300, 4000), 0.05, 2.0, 32)
            for rate in (1, 5, 10, 20)]
    assert need == sorted(need) and need[0] == 1 and need[-1] >= 3
    assert model.decode_nodes(Workload(20, 3000, 300, 4000), 0.03, 2.0, 32) > need[-1]


def test_calibration_converges_to_measured_capacity() -> None:
    model = CapacityModel(prefill_tokens_per_s=10_000, step_base_s=0.012,
                          step_per_seq_s=0.0002, step_per_ctx_token_s=4e-8)
    rng = random.Random(0)
    for _ in range(600):
        tokens = rng.uniform(500, 8000)
        model.observe_prefill(tokens, tokens / 4000)  # the nodes are 2.5x slower
        batch = rng.randint(1, 120)
        ctx = batch * rng.uniform(1000, 6000)
        model.observe_step(batch, ctx, 0.020 + 0.0001 * batch + 2e-8 * ctx)
    assert model.prefill_tokens_per_s == pytest.approx(4000, rel=0.02)
    base, per_seq, per_token = model.step_coefficients
    assert base == pytest.approx(0.020, rel=0.05)
    assert per_seq == pytest.approx(0.0001, rel=0.1)
    assert per_token == pytest.approx(2e-8, rel=0.1)


# ---- decisions on recorded signals -------------------------------------------------------------

def test_a_ramp_scales_both_roles_up_and_back_down() -> None:
    replay = Replayer(Planner(make_config(down_cooldown_s=30, down_window_s=60)))
    up = replay.run([2 + i for i in range(18)])  # 2 -> 19 req/s over 3 minutes
    hold = replay.run([19] * 6)
    down = replay.run([19 - i for i in range(18)] + [2] * 30)
    assert up[0][0] <= 2 and up[0][1] == 1
    assert up[-1][0] >= 6 and up[-1][1] >= 3
    assert [p for p, _ in up] == sorted(p for p, _ in up)  # never down on the way up
    assert hold[-1] == up[-1] or hold[-1] >= up[-1]
    last = replay.decisions[-1]
    assert down[-1] == (last.required_prefill, last.required_decode) == (2, 1)
    assert [p for p, _ in down] == sorted((p for p, _ in down), reverse=True)


def test_the_trend_scales_up_ahead_of_the_load() -> None:
    """On a steady ramp the planner asks now for what the rate will need `lead_s` later."""
    ahead = Replayer(Planner(make_config(lead_s=60)))
    flat = Replayer(Planner(make_config(lead_s=0)))
    rates = [2 + 0.5 * i for i in range(20)]
    assert ahead.run(rates)[-1][0] > flat.run(rates)[-1][0]
    needed_at_the_end = flat.run([rates[-1] + 3] * 3)[-1][0]  # what the rate 60 s on needs
    assert ahead.num_prefill >= needed_at_the_end - 1


def test_a_short_dip_moves_nothing_and_noise_does_not_flap() -> None:
    replay = Replayer(Planner(make_config(down_cooldown_s=60, down_window_s=120)))
    replay.run([15] * 12)
    steady = (replay.num_prefill, replay.num_decode)
    dip = replay.run([3] * 6)  # a minute-long dip, shorter than the window
    assert set(dip) == {steady}
    replay = Replayer(Planner(make_config(down_cooldown_s=60, down_window_s=120)))
    replay.run([15] * 12)
    rng = random.Random(1)
    targets = replay.run([15 * rng.uniform(0.85, 1.15) for _ in range(60)])
    changes = sum(a != b for a, b in zip(targets, targets[1:], strict=False))
    assert changes <= 3  # ten minutes of +-15% noise: a few steps, no flapping


def test_a_burst_scales_up_at_once() -> None:
    replay = Replayer(Planner(make_config(rate_half_life_s=60)))
    replay.run([4] * 10)
    before = replay.num_prefill
    burst = replay.step(20)
    assert burst.prefill > before and burst.required_prefill == burst.prefill


def test_scale_in_waits_for_its_cooldown_and_steps_one_at_a_time() -> None:
    replay = Replayer(Planner(make_config(down_cooldown_s=50, down_window_s=20,
                                          max_down_step=1)),
                      num_prefill=8, num_decode=6)
    targets = replay.run([1] * 30)
    assert targets[0] == (8, 6)  # the window has not seen 60 s of low load yet
    downs = [i for i in range(1, len(targets)) if targets[i][0] < targets[i - 1][0]]
    assert all(targets[i - 1][0] - targets[i][0] == 1 for i in downs)
    assert all(b - a >= 5 for a, b in zip(downs, downs[1:], strict=False))  # 50 s apart
    assert targets[-1] == (3, 1) or targets[-1][0] < 8


def test_bounds_and_the_node_cap() -> None:
    config = make_config(prefill=RoleBounds(2, 5), decode=RoleBounds(1, 3), max_nodes=6)
    replay = Replayer(Planner(config), num_prefill=2, num_decode=1)
    replay.step(0.1)
    assert (replay.num_prefill, replay.num_decode) == (2, 1)
    big = replay.step(200)
    assert big.prefill + big.decode == 6 and big.prefill <= 5 and big.decode <= 3
    assert big.prefill >= 2 and big.decode >= 1
    assert any("capped" in r for r in big.reasons)


def test_measured_slo_misses_add_a_node_when_the_model_says_enough() -> None:
    replay = Replayer(Planner(make_config()), num_prefill=2, num_decode=2)
    calm = replay.step(1)
    assert (calm.prefill, calm.decode) == (2, 2)
    missed = replay.step(1, ttft=5.0, itl=0.2)
    assert (missed.prefill, missed.decode) == (3, 3)
    assert any("prefill: measured" in r for r in missed.reasons)


def test_the_mix_moves_the_split() -> None:
    """Long prompts with short answers need prefill; short prompts with long answers, decode."""
    docs = Planner(make_config()).decide(make_signals(8, 1, 1, prefill_tokens=12_000,
                                                      output_tokens=80), 10)
    chats = Planner(make_config()).decide(make_signals(8, 1, 1, prefill_tokens=800,
                                                       output_tokens=1500), 10)
    assert docs.prefill > docs.decode and chats.decode > chats.prefill


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        RoleBounds(3, 2)
    with pytest.raises(ValueError):
        PlannerConfig(slo_ttft_s=0)
    with pytest.raises(ValueError):
        PlannerConfig(prefill=RoleBounds(2, 4), decode=RoleBounds(2, 4), max_nodes=3)
    with pytest.raises(ValueError):
        Planner(make_config()).decide(make_signals(1, 1, 1))  # no clock, no `now`
    with pytest.raises(ValueError):
        Workload(-1, 0, 0, 0)
