"""Monte Carlo tests of exactness, each with negative controls that must fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

import broken
from speculative.sampling import sample, speculative_step, verify
from speculative.simulation import SEED_P, SEED_Q, markov_experiment, single_step_experiment
from speculative.theory import expected_tokens

P_VALUE_FLOOR = 1e-3  # fixed seeds make these deterministic; the floor is for robustness

pytestmark = pytest.mark.usefixtures("single_thread")


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    return float(stats.chisquare(counts, probs * counts.sum()).pvalue)


def single_step_checks(verifier) -> tuple[bool, bool]:
    """(acceptance within 4 SE of 0.65, output passes chi-square against p)."""
    draws = 200_000
    report = single_step_experiment(SEED_P, SEED_Q, draws=draws, seed=3, verifier=verifier)
    se = np.sqrt(0.65 * 0.35 / draws)
    accept_ok = abs(report.accept_rate - 0.65) < 4 * se
    counts = np.array(report.empirical) * draws
    return accept_ok, chi_square_p_value(counts, SEED_P) > P_VALUE_FLOOR


def test_single_step_acceptance_and_distribution():
    assert single_step_checks(verify) == (True, True)


@pytest.mark.parametrize("verifier", [broken.always_accept, broken.resample_from_target])
def test_single_step_negative_controls(verifier):
    accept_ok, distribution_ok = single_step_checks(verifier)
    assert not distribution_ok
    if verifier is broken.always_accept:
        assert not accept_ok


def test_numpy_primitive_matches_target():
    rng = np.random.default_rng(0)
    draws = 40_000
    counts = np.zeros(6)
    accepts = 0
    for _ in range(draws):
        token, accepted = speculative_step(SEED_P, SEED_Q, rng)
        counts[token] += 1
        accepts += accepted
    assert chi_square_p_value(counts, SEED_P) > P_VALUE_FLOOR
    assert abs(accepts / draws - 0.65) < 4 * np.sqrt(0.65 * 0.35 / draws)


def tokens_per_block(verifier, gamma: int, blocks: int = 100_000) -> tuple[float, float]:
    """Mean emitted tokens per block with i.i.d. per-position acceptance α = 0.65."""
    g = torch.Generator().manual_seed(gamma)
    p = torch.tensor(SEED_P, dtype=torch.float32)
    q = torch.tensor(SEED_Q, dtype=torch.float32)
    drafted = sample(q.expand(blocks * gamma, -1), g).reshape(blocks, gamma)
    result = verifier(drafted, q.expand(blocks, gamma, -1), p.expand(blocks, gamma + 1, -1), g)
    emitted = (result.tokens >= 0).sum(dim=1).double()
    return float(emitted.mean()), float(emitted.std() / np.sqrt(blocks))


@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_expected_tokens_matches_verifier(gamma):
    mean, se = tokens_per_block(verify, gamma)
    assert abs(mean - expected_tokens(0.65, gamma)) < 4 * se


@pytest.mark.parametrize("gamma", [1, 4])
def test_expected_tokens_negative_control_forgotten_bonus(gamma):
    mean, se = tokens_per_block(broken.forget_bonus, gamma)
    assert abs(mean - expected_tokens(0.65, gamma)) > 4 * se


def markov_checks(verifier, sequences: int = 20_000):
    report = markov_experiment(sequences=sequences, verifier=verifier)
    return report, report.max_abs_diff < 4.5 * report.standard_error


def test_markov_sequence_level_exact():
    report, ok = markov_checks(verify)
    assert ok
    assert abs(report.tokens_per_target_call - 3.54) < 0.03


@pytest.mark.parametrize("verifier", [broken.always_accept, broken.resample_from_target])
def test_markov_negative_controls(verifier):
    _, ok = markov_checks(verifier)
    assert not ok


@pytest.mark.slow
def test_markov_seed_size_reproduces_spec():
    report = markov_experiment()  # 60,000 sequences × 64 tokens, γ = 4, seed 2
    assert report.max_abs_diff < 4.5 * report.standard_error
    assert round(report.tokens_per_target_call, 2) in (3.53, 3.54, 3.55)
    assert round(report.target_calls_saved * 100) == 72
