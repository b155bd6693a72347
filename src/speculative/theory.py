"""Closed-form theory of speculative decoding (Leviathan et al., Chen et al., 2023).

- α = Σ_x min(p(x), q(x)) = 1 − TV(p, q): probability a drafted token is accepted.
- Expected emitted tokens per round with γ drafted tokens (i.i.d. acceptance):
  (1 − α^{γ+1}) / (1 − α).
- Speedup with draft cost c = t_draft / t_target: tokens per round ÷ (γc + 1).
- Generalized speedup: the verification pass scores k = γ + 1 new tokens (the last
  emitted token plus γ drafted ones) and costs T(k)/T(1) decode steps, so a round costs
  γc + T(γ+1)/T(1). The seed's formula is the special case T(k) = T(1).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from speculative.sampling.verify import check_distribution

VerifyCost = Mapping[int, float] | Callable[[int], float]


def _check_alpha(alpha: float) -> float:
    if not isinstance(alpha, int | float) or math.isnan(alpha) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    return float(alpha)


def _check_gamma(gamma: int) -> int:
    if isinstance(gamma, bool) or not isinstance(gamma, int | np.integer) or gamma < 1:
        raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")
    return int(gamma)


def _check_cost(c: float) -> float:
    if not isinstance(c, int | float) or math.isnan(c) or c < 0:
        raise ValueError(f"c (draft cost relative to a target step) must be >= 0, got {c!r}")
    return float(c)


def _pair(p: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    p = check_distribution(p, "p")
    q = check_distribution(q, "q")
    if p.shape != q.shape:
        raise ValueError(f"p and q have different vocabulary sizes ({p.size} vs {q.size})")
    return p, q


def acceptance_rate(p: np.ndarray, q: np.ndarray) -> float:
    """α = Σ min(p, q), the overlap of the two distributions."""
    p, q = _pair(p, q)
    return float(np.minimum(p, q).sum())


def tv_distance(p: np.ndarray, q: np.ndarray) -> float:
    """Total-variation distance ½ Σ |p − q|."""
    p, q = _pair(p, q)
    return float(0.5 * np.abs(p - q).sum())


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens emitted per round: (1 − α^{γ+1}) / (1 − α)  (γ + 1 at α = 1)."""
    alpha, gamma = _check_alpha(alpha), _check_gamma(gamma)
    if alpha == 1:
        return float(gamma + 1)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def ceiling(alpha: float) -> float:
    """Limit of expected tokens per round as γ → ∞: 1 / (1 − α)."""
    alpha = _check_alpha(alpha)
    return math.inf if alpha == 1 else 1 / (1 - alpha)


def speedup(alpha: float, gamma: int, c: float) -> float:
    """The seed's wall-clock speedup: expected tokens ÷ (γc + 1)."""
    return expected_tokens(alpha, gamma) / (_check_gamma(gamma) * _check_cost(c) + 1)


def verify_cost_at(verify_cost: VerifyCost, k: int, known: Sequence[int] | None = None) -> float:
    """T(k)/T(1) from a mapping (nearest measured k at or below, else above; linear
    between measured points) or a callable. ``known``: the mapping's keys, sorted, for a
    caller that reads one mapping many times (else sorted here, on every call)."""
    if callable(verify_cost):
        value = float(verify_cost(k))
    else:
        if not verify_cost:
            raise ValueError("verify_cost mapping is empty")
        if known is None:
            known = sorted(int(x) for x in verify_cost)
        at = bisect.bisect_right(known, k) - 1  # the largest measured point <= k
        value = float(verify_cost[known[max(at, 0)]])
        if at >= 0 and known[at] != k and at + 1 < len(known):
            lo, hi = known[at], known[at + 1]  # interpolate linearly between them
            frac = (k - lo) / (hi - lo)
            value = (1 - frac) * float(verify_cost[lo]) + frac * float(verify_cost[hi])
    if math.isnan(value) or value <= 0:
        raise ValueError(f"verify cost T({k})/T(1) must be > 0, got {value}")
    return value


def decayed_average(previous: float | None, value: float, decay: float) -> float:
    """A running estimate: ``value`` at first, then ``decay · previous + (1 − decay) · value``
    (how the γ policies and ``auto`` follow measured costs that drift)."""
    return value if previous is None else decay * previous + (1 - decay) * value


def generalized_speedup(alpha: float, gamma: int, c: float, verify_cost: VerifyCost) -> float:
    """Speedup when verifying k = γ + 1 new tokens costs T(k)/T(1) decode steps.

    round cost = γc + T(γ+1)/T(1); plain decoding costs T(1) per token.
    ``verify_cost`` maps k to T(k)/T(1) (or is a callable); T(k) ≡ T(1) gives :func:`speedup`.
    """
    gamma, c = _check_gamma(gamma), _check_cost(c)
    return expected_tokens(alpha, gamma) / (gamma * c + verify_cost_at(verify_cost, gamma + 1))


def mixed_speedup(
    acceptance: float | Sequence[float],
    rounds: Mapping[int, int],
    c: float,
    verify_cost: VerifyCost,
) -> float:
    """:func:`generalized_speedup` for a run whose rounds drafted different γ: ``rounds``
    maps γ (0: a plain step) to how many rounds drafted it. Expected tokens over expected
    cost, summed over the rounds: Σ n_γ E(γ) / Σ n_γ (γc + T(γ+1)/T(1)), with E(γ) from
    one α (``acceptance`` a float: :func:`expected_tokens`) or from the conditional
    acceptance of each draft position (a sequence: :func:`expected_tokens_positional`).
    A run that mixes γ (γ = auto, n-gram rounds without a match) is not a run at its mean
    γ: half plain steps and half rounds of 2 drafts at α = 0.5, c = 0.01 and T(2), T(3) =
    1.05, 1.1 give 1.30x, where γ = 1 every round would give 1.42x."""
    c = _check_cost(c)
    if isinstance(acceptance, Sequence):
        rates = list(acceptance)

        def tokens_of(gamma: int) -> float:
            return expected_tokens_positional(rates, gamma)
    else:
        alpha = _check_alpha(acceptance)

        def tokens_of(gamma: int) -> float:
            return expected_tokens(alpha, gamma)

    tokens = cost = 0.0
    for gamma, count in rounds.items():
        if gamma < 0 or count < 0:
            raise ValueError(f"need γ >= 0 and counts >= 0, got {count} rounds of γ = {gamma}")
        tokens += count * (tokens_of(gamma) if gamma else 1.0)
        cost += count * (gamma * c + verify_cost_at(verify_cost, gamma + 1))
    if cost <= 0:
        raise ValueError("need at least one round")
    return tokens / cost


def optimal_gamma(
    alpha: float,
    c: float,
    max_gamma: int = 20,
    verify_cost: VerifyCost | None = None,
) -> tuple[int, float]:
    """(γ*, speedup at γ*) over γ = 1..max_gamma; uses the cost curve when given."""
    max_gamma = _check_gamma(max_gamma)
    best = (1, -math.inf)
    for gamma in range(1, max_gamma + 1):
        value = (
            speedup(alpha, gamma, c)
            if verify_cost is None
            else generalized_speedup(alpha, gamma, c, verify_cost)
        )
        if value > best[1]:
            best = (gamma, value)
    return best


def expected_tokens_positional(acceptance: list[float], gamma: int) -> float:
    """Expected tokens per round when position i is accepted w.p. acceptance[i-1].

    ``acceptance[i]`` is the conditional acceptance of drafted position i+1 given all
    before it were accepted; positions past the list reuse its last value.
    """
    gamma = _check_gamma(gamma)
    if not acceptance:
        raise ValueError("acceptance must hold at least one rate")
    total, survive = 1.0, 1.0
    for i in range(gamma):
        survive *= _check_alpha(acceptance[min(i, len(acceptance) - 1)])
        total += survive
    return total
