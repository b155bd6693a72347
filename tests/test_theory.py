"""The closed-form theory against the specification's tables."""

from __future__ import annotations

import math

import numpy as np
import pytest

from speculative.simulation import SEED_P, SEED_Q, round_length_experiment
from speculative.theory import (
    acceptance_rate,
    ceiling,
    expected_tokens,
    expected_tokens_positional,
    generalized_speedup,
    mixed_speedup,
    optimal_gamma,
    speedup,
    tv_distance,
)


def test_acceptance_is_one_minus_tv():
    assert acceptance_rate(SEED_P, SEED_Q) == pytest.approx(0.65)
    assert 1 - tv_distance(SEED_P, SEED_Q) == pytest.approx(0.65)
    rng = np.random.default_rng(0)
    for _ in range(20):
        p, q = rng.dirichlet(np.ones(10)), rng.dirichlet(np.ones(10))
        assert acceptance_rate(p, q) == pytest.approx(1 - tv_distance(p, q))


SEED_TABLE = [  # alpha, gamma, formula (from the specification)
    (0.5, 1, 1.5000),
    (0.5, 4, 1.9375),
    (0.5, 8, 1.9961),
    (0.7, 1, 1.7000),
    (0.7, 4, 2.7731),
    (0.7, 8, 3.1988),
    (0.9, 1, 1.9000),
    (0.9, 4, 4.0951),
    (0.9, 8, 6.1258),
]


@pytest.mark.parametrize("alpha, gamma, value", SEED_TABLE)
def test_expected_tokens_table(alpha, gamma, value):
    assert expected_tokens(alpha, gamma) == pytest.approx(value, abs=5e-5)


def test_expected_tokens_against_simulation():
    for row in round_length_experiment(trials=100_000):
        # the per-round count is bounded by γ+1, so its SE is at most (γ+1)/(2√n)
        assert abs(row.simulated - row.formula) < 4 * (row.gamma + 1) / (2 * math.sqrt(100_000))


def test_optimal_gamma_table():
    expected = [(0.5, 2, 1.46), (0.6, 3, 1.67), (0.7, 4, 1.98), (0.8, 6, 2.47), (0.9, 10, 3.43)]
    for alpha, gamma, value in expected:
        best_gamma, best = optimal_gamma(alpha, 0.1)
        assert best_gamma == gamma and round(best, 2) == value
        assert ceiling(alpha) == pytest.approx(1 / (1 - alpha))


def test_generalized_speedup_reduces_to_seed_and_shifts_optimum():
    flat = {k: 1.0 for k in range(1, 22)}
    for gamma in (1, 4, 9):
        assert generalized_speedup(0.8, gamma, 0.1, flat) == pytest.approx(speedup(0.8, gamma, 0.1))
    cpu = {1: 1.0, **{k: 1.8 for k in range(2, 22)}}  # verification ≈ 1.8 decode steps
    g_flat, s_flat = optimal_gamma(0.8, 0.1)
    g_cpu, s_cpu = optimal_gamma(0.8, 0.1, verify_cost=cpu)
    assert s_cpu < s_flat and g_cpu != g_flat
    assert generalized_speedup(0.8, 4, 0.1, lambda k: 1.0) == pytest.approx(speedup(0.8, 4, 0.1))


def test_positional_expected_tokens():
    assert expected_tokens_positional([0.7], 4) == pytest.approx(expected_tokens(0.7, 4))
    assert expected_tokens_positional([1.0, 0.0], 3) == pytest.approx(2.0)


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: expected_tokens(1.2, 3), "alpha"),
        (lambda: expected_tokens(0.5, 0), "gamma"),
        (lambda: speedup(0.5, 2, -1), "c "),
        (lambda: optimal_gamma(0.5, 0.1, max_gamma=0), "gamma"),
        (lambda: acceptance_rate(np.ones(3) / 3, np.ones(4) / 4), "vocabulary"),
        (lambda: tv_distance(np.array([0.5, 0.6]), np.array([0.5, 0.5])), "sum"),
        (lambda: generalized_speedup(0.5, 2, 0.1, {}), "empty"),
    ],
)
def test_theory_rejects_bad_input(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()


def test_mixed_speedup_is_what_rounds_of_mixed_gamma_deliver():
    """Rounds that draft different γ (plain steps among them), each draft kept with
    probability α until the first rejection: the simulated tokens over the simulated cost
    is mixed_speedup's value; pricing the run at its mean γ (the control) is far off."""
    rng = np.random.default_rng(0)
    alpha, c = 0.55, 0.02
    curve = {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.2, 5: 1.45}
    rounds = {0: 30000, 1: 10000, 4: 20000}  # plain steps, short and long drafts
    tokens = cost = 0.0
    for gamma, count in rounds.items():
        kept = rng.random((count, gamma)) < alpha  # [rounds, γ] each draft's test
        run = np.cumprod(kept, axis=1).sum(axis=1) if gamma else np.zeros(count)
        tokens += float((run + 1).sum())
        cost += count * (gamma * c + curve[gamma + 1])
    simulated = tokens / cost
    assert mixed_speedup(alpha, rounds, c, curve) == pytest.approx(simulated, rel=0.01)
    mean_gamma = round(sum(g * n for g, n in rounds.items()) / sum(rounds.values()))
    assert abs(generalized_speedup(alpha, mean_gamma, c, curve) / simulated - 1) > 0.05
    assert mixed_speedup(alpha, {3: 10}, c, curve) == generalized_speedup(alpha, 3, c, curve)


def test_mixed_speedup_by_position_is_what_correlated_drafts_deliver():
    """Drafts kept as n-gram copies are: the first 0.4 of the time, each later one 0.85 of
    the time once the one before was kept. Priced by position the rounds' simulated speedup
    is met; one pooled α (accepted ÷ drafted, the control) misses it by far."""
    rng = np.random.default_rng(1)
    first, later, c = 0.4, 0.85, 0.01
    curve = {1: 1.0, 2: 1.02, 3: 1.05, 4: 1.1, 5: 1.2}
    rounds = {0: 20000, 2: 20000, 4: 20000}
    tokens = cost = drafted = kept_total = 0.0
    for gamma, count in rounds.items():
        odds = np.array([first] + [later] * (gamma - 1))  # [γ]
        kept = rng.random((count, gamma)) < odds  # [rounds, γ]
        run = np.cumprod(kept, axis=1).sum(axis=1) if gamma else np.zeros(count)
        tokens += float((run + 1).sum())
        cost += count * (gamma * c + curve[gamma + 1])
        drafted += count * gamma
        kept_total += float(run.sum())
    simulated = tokens / cost
    by_position = mixed_speedup([first, later, later, later], rounds, c, curve)
    assert by_position == pytest.approx(simulated, rel=0.01)
    pooled = mixed_speedup(kept_total / drafted, rounds, c, curve)
    assert abs(pooled / simulated - 1) > 0.05
