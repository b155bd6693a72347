"""What a round costs on this machine, learnt while decoding: V(k), the seconds of a round
that verifies k tokens (the target's pass, then verification and commit), kept as a scale
times a shape (:class:`VerifyTimes`).

One estimator for every chooser of draft lengths: the adaptive γ policy
(:class:`~speculative.engine.gamma.AdaptiveGamma`) and the ``auto`` drafter
(:class:`~speculative.drafters.auto.AutoDrafter`) both price a round of g drafts as
g · (drafting per token) + V(g + 1) against a plain round's V(1). A calibration's
T(k)/T(1) is the prior shape only: one calibration can be off by tens of percent on a
shared machine (T(3)/T(1) 1.00 where rounds of 3 tokens took 1.23× a plain one, their
sampling and commit included), and a length priced from it loses to plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from speculative.theory import decayed_average, verify_cost_at

PRIOR_SLOPE = 0.1  # V(k) / V(1) - 1 per extra verified token, until V(k) is timed
PAIR_WEIGHT = 0.05  # weight of an adjacent pair of rounds in V(k)'s shape, once learnt


def prior_shape(k: int, curve: dict[int, float] | None = None) -> float:
    """V(k) / V(1) before any verification of k tokens is timed: the measured verify-cost
    curve T(k)/T(1) where given (:func:`~speculative.theory.verify_cost_at` up to its last
    point, linear between measured points; past it, extended by its last step), else
    1 + PRIOR_SLOPE (k − 1)."""
    if not curve or len(curve) < 2:
        return 1.0 + PRIOR_SLOPE * (k - 1)
    if k in curve:  # a measured point (every k of a calibration): no sort on the hot path
        return curve[k]
    keys = sorted(curve)
    before, last = keys[-2], keys[-1]
    if k <= last:
        return verify_cost_at(curve, k, keys)
    step = max((curve[last] - curve[before]) / (last - before), 0.0)
    return curve[last] + step * (k - last)


@dataclass
class VerifyTimes:
    """Running estimate of V(k), the seconds of a round that verifies k tokens, as a scale
    times a shape: V(k) = scale · shape(k), shape(1) = 1.

    Every timed round updates the scale, so a machine that slows down or speeds up moves
    every V(k) at once, including lengths no longer chosen. The shape is learnt from
    adjacent rounds only: a round of k tokens right after a plain one, or a plain one right
    after a round of k, moves shape(k) toward the ratio of the two times, taken
    milliseconds apart (a running mean over the first pairs, then PAIR_WEIGHT a pair).
    Learnt against the scale instead (toward seconds ÷ scale), the shape of a length that
    most rounds use cannot move: the scale is then that length's own time ÷ its shape,
    whatever the shape (a prior of 0.97 where rounds of 2 tokens take 1.2× a plain one
    stays at 1.08 after 1,200 rounds with one in ten plain; the pairs reach 1.18). Until k is
    paired, shape(k) is the nearest learnt shape scaled by the prior: the target's measured
    verify-cost curve where given, else 1 + PRIOR_SLOPE (k − 1)."""

    scale: float | None = None  # seconds of V(1)
    shape: dict[int, float] = field(default_factory=lambda: {1: 1.0})
    prior: dict[int, float] | None = None  # a measured T(k)/T(1), if given
    pairs: dict[int, int] = field(default_factory=dict)  # k -> adjacent pairs learnt from
    last: tuple[int, float] | None = None  # the previous round's tokens and seconds
    decay: float = 0.9  # weight of the past in the scale
    counts: dict[int, int] = field(default_factory=dict)  # k -> rounds timed

    def shape_at(self, k: int) -> float:
        if k in self.shape:
            return self.shape[k]
        near = min(self.shape, key=lambda m: (abs(m - k), m))
        return self.shape[near] * prior_shape(k, self.prior) / prior_shape(near, self.prior)

    def record(self, k: int, seconds: float) -> None:
        """One round that verified ``k`` tokens took ``seconds``."""
        if k < 1 or seconds <= 0:
            return
        self.scale = decayed_average(self.scale, seconds / self.shape_at(k), self.decay)
        self.counts[k] = self.counts.get(k, 0) + 1
        pair = adjacent_ratio(self.last, k, seconds)
        if pair is not None:
            longer, ratio = pair
            count = self.pairs.get(longer, 0)
            weight = max(PAIR_WEIGHT, 1.0 / (count + 2))  # the prior counts as one pair
            self.shape[longer] = (1 - weight) * self.shape_at(longer) + weight * ratio
            self.pairs[longer] = count + 1
        self.last = (k, seconds)

    def at(self, k: int) -> float:
        """V(k) in seconds (in units of V(1) = 1 while nothing is timed)."""
        return self.shape_at(k) * (1.0 if self.scale is None else self.scale)


def adjacent_ratio(
    last: tuple[int, float] | None, k: int, seconds: float
) -> tuple[int, float] | None:
    """(k', V(k') ÷ V(1)) from this round (``k`` tokens, ``seconds``) and the one before
    (``last``) when one of the two was plain and the other verified k' > 1 tokens."""
    if last is None:
        return None
    before, before_seconds = last
    if k > 1 and before == 1:
        return k, seconds / before_seconds
    if k == 1 and before > 1:
        return before, before_seconds / seconds
    return None
