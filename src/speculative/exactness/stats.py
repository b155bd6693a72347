"""Two-sample statistics for exactness checks (pure functions, torch only).

Two samples of categorical outcomes (e.g. the first token of N continuations drawn by
plain decoding and N drawn by speculative decoding) are compared with

* a **homogeneity test** on their 2 × K contingency table: Pearson's chi-square (or the
  G-test), K - 1 degrees of freedom, p-value from the chi-square survival function
  (``torch.special.gammaincc``). Categories too rare for the chi-square approximation
  are binned into "other" first (:func:`bin_counts`: every kept cell expects >= 5 in
  each sample).
* **Holm** (or Bonferroni) correction over the family of tests of one run.
* an **upper confidence bound on the total-variation distance** of the two (binned)
  distributions, from the plug-in estimate TV̂ = ½ Σ_k |a_k/n − b_k/m|:
  - TV(P, Q) ≤ E[TV̂]: each |a_k/n − b_k/m| is convex in the counts, whose means are
    P_k and Q_k (Jensen), so the estimate is biased upwards, never downwards;
  - TV̂ is a function of n + m independent draws, and redrawing one of them moves it by
    at most 1/n (or 1/m): by McDiarmid's inequality
    P(E[TV̂] ≥ TV̂ + t) ≤ exp(−2t² / (1/n + 1/m)).

  So with probability ≥ 1 − δ,

      TV(P, Q) ≤ TV̂ + sqrt(ln(1/δ) · (1/n + 1/m) / 2),

  for any number of bins K: more bins only raise TV̂'s upward bias. (The bound used
  before, the two-sample Bretagnolle–Huber–Carol inequality, had K ln 2 + ln(1/δ) under
  the root: a union over all 2^K sets of bins; at K = 8 and δ = 0.001/3 that needs 1.7×
  the N for the same margin.) It bounds the TV of the BINNED distributions (binning can
  only lower a TV), at the N actually drawn. Against an exact law the bins follow from the
  law and N alone (:func:`bin_against_law`), so the argument holds as stated; two samples
  are binned from their pooled counts (:func:`bin_counts`), so there it is a bound for
  the bins as drawn, as the union bound was.
* **sample sizes**: the N that makes that bound reach ε, and the N at which a given TV
  (or a pilot's measured effect) is detected by the chi-square test with a given power
  (noncentral chi-square, normal approximation; λ ≥ 2nε² for any TV ε by Cauchy–Schwarz).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

OTHER = "other"
MIN_EXPECTED = 5.0  # chi-square validity: every cell expects at least this many, each sample


def chi2_sf(statistic: float, df: int) -> float:
    """P(X ≥ statistic) for X ~ chi-square(df): the regularized upper incomplete gamma."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if statistic <= 0:
        return 1.0
    x = torch.tensor(statistic / 2.0, dtype=torch.float64)
    a = torch.tensor(df / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(a, x))


def chi2_isf(p: float, df: int) -> float:
    """The statistic whose survival probability is ``p`` (bisection on :func:`chi2_sf`)."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    lo, hi = 0.0, max(1.0, float(df))
    while chi2_sf(hi, df) > p:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > p else (lo, mid)
        if hi - lo < 1e-10 * hi:
            break
    return (lo + hi) / 2


def normal_isf(p: float) -> float:
    """z with P(Z ≥ z) = p for a standard normal Z."""
    return math.sqrt(2.0) * float(torch.special.erfinv(torch.tensor(1.0 - 2.0 * p)).item())


@dataclass(frozen=True)
class Table:
    """A 2 × K contingency table: ``a[k]``, ``b[k]`` counts of bin ``labels[k]``."""

    labels: tuple[Hashable, ...]
    a: tuple[int, ...]
    b: tuple[int, ...]

    @property
    def n_a(self) -> int:
        return sum(self.a)

    @property
    def n_b(self) -> int:
        return sum(self.b)

    @property
    def bins(self) -> int:
        return len(self.labels)


def bin_counts(
    a: Counter, b: Counter, max_bins: int = 8, min_expected: float = MIN_EXPECTED
) -> Table:
    """Bin two samples' counts for a 2 × K test: the most frequent outcomes (pooled) keep
    their own bin while each expects >= ``min_expected`` in both samples, at most
    ``max_bins - 1`` of them; everything else goes to "other" (merged with the rarest kept
    bin while it expects fewer than ``min_expected`` itself)."""
    n_a, n_b = sum(a.values()), sum(b.values())
    if n_a == 0 or n_b == 0:
        raise ValueError("both samples need at least one outcome")
    pooled = Counter(a) + Counter(b)
    share = min(n_a, n_b) / (n_a + n_b)  # expected count of a cell in the smaller sample
    ranked = sorted(pooled, key=lambda k: (-pooled[k], str(k)))
    kept = [k for k in ranked if pooled[k] * share >= min_expected][: max(1, max_bins - 1)]
    rest = pooled.total() - sum(pooled[k] for k in kept)
    while kept and 0 < rest * share < min_expected:
        rest += pooled[kept.pop()]
    labels = tuple(kept) + ((OTHER,) if rest else ())
    counts_a = [a.get(k, 0) for k in kept]
    counts_b = [b.get(k, 0) for k in kept]
    if rest:
        counts_a.append(n_a - sum(counts_a))
        counts_b.append(n_b - sum(counts_b))
    return Table(labels, tuple(counts_a), tuple(counts_b))


@dataclass(frozen=True)
class TestResult:
    statistic: float
    df: int
    p_value: float


def homogeneity_test(table: Table, method: str = "chi2") -> TestResult:
    """Pearson chi-square ("chi2") or G-test ("g") that both rows share one distribution.
    A table of one bin has nothing to test: statistic 0, p-value 1."""
    if method not in ("chi2", "g"):
        raise ValueError(f"method must be 'chi2' or 'g', got {method!r}")
    if table.bins < 2:
        return TestResult(0.0, 0, 1.0)
    n_a, n_b = table.n_a, table.n_b
    total = n_a + n_b
    statistic = 0.0
    for x, y in zip(table.a, table.b, strict=True):
        column = x + y
        for observed, row in ((x, n_a), (y, n_b)):
            expected = row * column / total
            if method == "chi2":
                statistic += (observed - expected) ** 2 / expected
            elif observed > 0:
                statistic += 2.0 * observed * math.log(observed / expected)
    df = table.bins - 1
    return TestResult(statistic, df, chi2_sf(statistic, df))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values (step-down, monotone, capped at 1)."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def bonferroni(p_values: Sequence[float]) -> list[float]:
    m = len(p_values)
    return [min(1.0, m * p) for p in p_values]


def tv_distance(table: Table) -> float:
    """Empirical TV distance ½ Σ |a_k/n_a − b_k/n_b| of the two binned samples."""
    n_a, n_b = table.n_a, table.n_b
    return 0.5 * sum(abs(x / n_a - y / n_b) for x, y in zip(table.a, table.b, strict=True))


def tv_margin(n_a: int, n_b: int, delta: float) -> float:
    """Half-width t of the TV bound: sqrt(ln(1/δ) (1/n + 1/m) / 2) (see the module
    docstring: Jensen, then McDiarmid)."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    return math.sqrt(math.log(1 / delta) * (1 / n_a + 1 / n_b) / 2)


def tv_upper_bound(table: Table, delta: float) -> float:
    """With probability >= 1 − δ the binned distributions' TV is at most this."""
    return min(1.0, tv_distance(table) + tv_margin(table.n_a, table.n_b, delta))


def samples_for_tv_bound(epsilon: float, delta: float, tv_hat: float = 0.0) -> int:
    """N per sample (both samples of size N) at which the TV bound reaches ``epsilon``."""
    room = epsilon - tv_hat
    if room <= 0:
        raise ValueError(f"the measured TV {tv_hat:.4f} already exceeds epsilon {epsilon}")
    return math.ceil(math.log(1 / delta) / room**2)


def samples_to_detect(
    effect: float, df: int, alpha: float, power: float = 0.99, max_n: int = 10**9
) -> int:
    """N per sample at which a chi-square homogeneity test at level ``alpha`` rejects with
    probability ``power``, when its noncentrality grows as λ = effect · N.

    The statistic is approximated as normal with mean df + λ and variance 2(df + 2λ).
    ``effect`` is 2ε² for a TV ε between the binned distributions (a lower bound, by
    Cauchy–Schwarz), or (X² − df)/n measured on a pilot of n per sample.
    """
    if effect <= 0:
        raise ValueError("the effect must be > 0 to be detectable")
    critical = chi2_isf(alpha, df)
    z = normal_isf(1 - power)  # the statistic exceeds mean − z·sd with probability `power`

    def detected(n: int) -> bool:
        lam = effect * n
        return df + lam - z * math.sqrt(2 * (df + 2 * lam)) >= critical

    hi = 1
    while not detected(hi):
        hi *= 2
        if hi > max_n:
            return max_n
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if detected(mid) else (mid, hi)
    return hi


def samples_to_detect_tv(epsilon: float, bins: int, alpha: float, power: float = 0.99) -> int:
    """N per sample that detects any TV ``epsilon`` between two K-bin distributions."""
    return samples_to_detect(2 * epsilon**2, max(1, bins - 1), alpha, power)


# ---- one sample against an exact law (goodness of fit) ---------------------------------


@dataclass(frozen=True)
class FitTable:
    """One sample's counts ``observed[k]`` of bin ``labels[k]`` and the exact law's
    probability ``probs[k]`` of that bin."""

    labels: tuple[Hashable, ...]
    observed: tuple[int, ...]
    probs: tuple[float, ...]

    @property
    def n(self) -> int:
        return sum(self.observed)

    @property
    def bins(self) -> int:
        return len(self.labels)


def bin_against_law(
    observed: Counter,
    law: Mapping[Hashable, float],
    max_bins: int = 8,
    min_expected: float = MIN_EXPECTED,
) -> FitTable:
    """Bin a sample against an exact law: the most probable outcomes (by the law) keep
    their own bin while each expects >= ``min_expected`` at this N, at most ``max_bins -
    1`` of them; everything else (outcomes outside the law's support included) goes to
    "other", merged with the least probable kept bin while it expects too few itself."""
    n = sum(observed.values())
    if n == 0:
        raise ValueError("the sample needs at least one outcome")
    ranked = sorted(law, key=lambda k: (-law[k], str(k)))
    kept = [k for k in ranked if law[k] * n >= min_expected][: max(1, max_bins - 1)]
    rest = sum(law[k] for k in ranked[len(kept) :])  # summed, not 1 − Σ kept: exact 0
    while kept and 0 < rest * n < min_expected:
        rest += law[kept.pop()]
    counts = [observed.get(k, 0) for k in kept]
    probs = [law[k] for k in kept]
    outside = n - sum(counts)  # includes outcomes the law calls impossible
    if rest > 0 or outside:
        return FitTable((*kept, OTHER), (*counts, outside), (*probs, rest))
    return FitTable(tuple(kept), tuple(counts), tuple(probs))


def goodness_of_fit(table: FitTable, method: str = "chi2") -> TestResult:
    """Pearson chi-square ("chi2") or G-test ("g") of the sample against the law, K − 1
    degrees of freedom. An outcome the law gives probability 0 is an infinite statistic
    (p-value 0). A table of one bin has nothing to test: statistic 0, p-value 1."""
    if method not in ("chi2", "g"):
        raise ValueError(f"method must be 'chi2' or 'g', got {method!r}")
    if table.bins < 2:
        return TestResult(0.0, 0, 1.0)
    statistic = 0.0
    for observed, p in zip(table.observed, table.probs, strict=True):
        expected = table.n * p
        if expected <= 0:
            if observed:
                return TestResult(math.inf, table.bins - 1, 0.0)
            continue
        if method == "chi2":
            statistic += (observed - expected) ** 2 / expected
        elif observed > 0:
            statistic += 2.0 * observed * math.log(observed / expected)
    df = table.bins - 1
    return TestResult(statistic, df, chi2_sf(statistic, df))


def fit_tv_distance(table: FitTable) -> float:
    """½ Σ |observed_k / n − p_k|: the sample's binned TV distance from the law."""
    n = table.n
    return 0.5 * sum(abs(x / n - p) for x, p in zip(table.observed, table.probs, strict=True))


def fit_tv_margin(n: int, delta: float) -> float:
    """Half-width of the one-sample TV bound: sqrt(ln(1/δ) / (2n)).

    TV(P, law) ≤ E[½ Σ |observed_k / n − p_k|] (Jensen), and redrawing one of the n
    draws moves that estimate by at most 1/n, so by McDiarmid it falls more than t below
    its mean with probability at most exp(−2nt²). It is the two-sample :func:`tv_margin`
    with the second sample infinitely large."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    return math.sqrt(math.log(1 / delta) / (2 * n))


def fit_tv_upper_bound(table: FitTable, delta: float) -> float:
    """With probability >= 1 − δ the sampled law's binned TV from the exact one is at
    most this."""
    return min(1.0, fit_tv_distance(table) + fit_tv_margin(table.n, delta))


def samples_for_fit_tv_bound(epsilon: float, delta: float, tv_hat: float = 0.0) -> int:
    """N (one sample, against the exact law) at which the TV bound reaches ``epsilon``."""
    room = epsilon - tv_hat
    if room <= 0:
        raise ValueError(f"the measured TV {tv_hat:.4f} already exceeds epsilon {epsilon}")
    return math.ceil(math.log(1 / delta) / (2 * room**2))
