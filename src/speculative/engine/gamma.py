"""Draft-length policies: fixed γ, adaptive γ from measured acceptance and costs, and the
transformers-style heuristic. A policy only looks at past rounds, so it never changes the
output distribution, only the speed."""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast, runtime_checkable

from speculative.drafters.base import ChoosesDraftLength
from speculative.round_costs import VerifyTimes
from speculative.theory import (
    VerifyCost,
    decayed_average,
    expected_tokens_positional,
    verify_cost_at,
)


class GammaPolicy(Protocol):
    """Chooses γ before each round and learns from the round's outcome."""

    def next_gamma(self) -> int: ...

    def update(self, drafted: int, num_accepted: int) -> None: ...


@runtime_checkable
class SupportsCostFeedback(Protocol):
    """A policy that learns the measured wall time of each round's drafting and verifying
    (what the engine really paid, catch-up forwards and overheads included)."""

    def observe_costs(self, gamma: int, draft_seconds: float, verify_seconds: float) -> None: ...


@runtime_checkable
class LearnsRoundCosts(Protocol):
    """A policy that learns what a round verifying k tokens really costs: the engine
    reports every round's pass and verification (plain rounds as k = 1)."""

    def observe_round(self, tokens: int, seconds: float) -> None: ...


@runtime_checkable
class SupportsSituations(Protocol):
    """A policy that learns acceptance per round situation (what a drafter that
    :class:`~speculative.drafters.base.SupportsDraftSituation` says of the coming round):
    told the situation before :meth:`GammaPolicy.next_gamma`, it picks γ, and learns from
    the round's :meth:`GammaPolicy.update`, for that situation."""

    def situate(self, situation: Hashable) -> None: ...


@dataclass
class PositionCounts:
    """Exponentially decayed counts of draft positions reached and accepted (position i:
    rounds that drafted an (i+1)-th token whose predecessors were all kept)."""

    reached: list[float]
    accepted: list[float]

    @classmethod
    def empty(cls, positions: int) -> PositionCounts:
        return cls([0.0] * positions, [0.0] * positions)

    def record(self, drafted: int, num_accepted: int, decay: float) -> None:
        self.reached = [r * decay for r in self.reached]
        self.accepted = [a * decay for a in self.accepted]
        for i in range(min(drafted, num_accepted + 1, len(self.reached))):
            self.reached[i] += 1
            self.accepted[i] += float(i < num_accepted)

    def rates(self, priors: Sequence[float], weight: float) -> list[float]:
        """Beta-smoothed acceptance per position (:func:`smoothed_rates`)."""
        return smoothed_rates(self.reached, self.accepted, priors, weight)


def smoothed_rates(
    reached: Sequence[float], accepted: Sequence[float], priors: Sequence[float], weight: float
) -> list[float]:
    """Beta-smoothed acceptance at each of ``len(priors)`` positions from the counts of
    rounds that reached and accepted it (positions past the counts: none); ``priors[i]``
    is position i's prior (a negative one: the estimate of position i − 1, so an
    unreached position inherits what was learnt before it)."""
    rates, previous = [], 0.0
    for i, prior in enumerate(priors):
        mean = previous if prior < 0 else prior
        r, a = (reached[i], accepted[i]) if i < len(reached) else (0, 0)
        previous = (a + mean * weight) / (r + weight)
        rates.append(previous)
    return rates


@dataclass
class FixedGamma:
    gamma: int

    def __post_init__(self) -> None:
        if self.gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {self.gamma}")

    def next_gamma(self) -> int:
        return self.gamma

    def update(self, drafted: int, num_accepted: int) -> None:
        pass


@dataclass
class HeuristicGamma:
    """transformers' "heuristic" schedule: +2 after a fully accepted round, else −1."""

    gamma: int = 5
    max_gamma: int = 16

    def next_gamma(self) -> int:
        return self.gamma

    def update(self, drafted: int, num_accepted: int) -> None:
        if drafted and num_accepted == drafted:
            self.gamma = min(self.max_gamma, self.gamma + 2)
        else:
            self.gamma = max(1, self.gamma - 1)


@dataclass
class AdaptiveGamma:
    """Pick γ maximizing the generalized speedup from running per-position acceptance.

    Acceptance at each draft position is estimated with a Beta prior plus exponentially
    decayed counts, so the estimate follows the text's current predictability. The prior
    of position 1 is ``prior_alpha`` (weight ``prior_weight``); the prior of each later
    position is the estimate of the one before, so positions not yet reached (beyond the
    γ used so far) inherit what was learnt instead of a fixed guess that would hold γ down.

    Costs, in target decode steps: c per draft step and the verify-cost curve T(k)/T(1),
    measured beforehand; plus, learnt from the engine's timings of each round
    (:meth:`observe_costs`), the drafting time a round pays beyond γ·c: the drafter's
    catch-up forward after a recovered or bonus token (which feeds 1–2 tokens), sampling
    and bookkeeping. The value of γ is E[tokens](γ) / (γ c + overhead + T(γ + 1)).

    Situations (:class:`SupportsSituations`): where the drafter classifies its rounds (an
    n-gram match's length), the counts are also kept per situation, each situation's
    positions smoothed towards the pooled estimate of all rounds, and γ is chosen from the
    current situation's: long after long matches, short or none after short ones.

    Round costs (:class:`LearnsRoundCosts`): the measured curve T(k)/T(1) is the prior
    shape of :class:`~speculative.round_costs.VerifyTimes` (the estimator ``auto`` keeps
    too), which learns each length's shape from its rounds next to plain ones
    (:meth:`verify_shapes`). One calibration can be off by tens of percent on a shared
    machine, and a γ priced from it alone loses to plain decoding.
    """

    c: float
    verify_cost: VerifyCost = field(default_factory=lambda: {1: 1.0})
    max_gamma: int = 12
    prior_alpha: float = 0.6
    prior_weight: float = 2.0
    decay: float = 0.9
    probe_every: int = 8
    cost_decay: float = 0.9  # running means of the measured round costs
    pooled: PositionCounts = field(init=False)  # every round's
    by_situation: dict[Hashable, PositionCounts] = field(default_factory=dict)
    situation: Hashable | None = None  # the coming round's (None: the drafter gives none)
    idle_rounds: int = 0
    overhead: float = 0.0  # measured drafting per round beyond γ·c, in target steps
    step_seconds: float | None = None  # measured T(1), from the verification passes
    verify: VerifyTimes = field(init=False)  # V(k), the curve its prior shape (as auto keeps)

    def __post_init__(self) -> None:
        self.pooled = PositionCounts.empty(self.max_gamma)
        self.verify = VerifyTimes(prior=self._prior_shape(), decay=self.cost_decay)

    def _prior_shape(self) -> dict[int, float]:
        """The measured curve as T(k)/T(1) for k = 1..max_gamma + 1, non-decreasing in k (a
        pass over more tokens never costs less; a lower reading is noise)."""
        known = None if callable(self.verify_cost) else sorted(int(k) for k in self.verify_cost)
        unit = verify_cost_at(self.verify_cost, 1, known)
        shape, top = {}, 0.0
        for k in range(1, self.max_gamma + 2):
            top = max(top, verify_cost_at(self.verify_cost, k, known) / unit)
            shape[k] = top
        return shape

    def situate(self, situation: Hashable) -> None:
        self.situation = situation
        self.by_situation.setdefault(situation, PositionCounts.empty(self.max_gamma))

    def position_acceptance(self) -> list[float]:
        """Estimated acceptance of each draft position in the coming round."""
        chained = [self.prior_alpha] + [-1.0] * (self.max_gamma - 1)
        pooled = self.pooled.rates(chained, self.prior_weight)
        if self.situation is None:
            return pooled
        return self.by_situation[self.situation].rates(pooled, self.prior_weight)

    def observe_round(self, tokens: int, seconds: float) -> None:
        """One round's measured pass and verification, over ``tokens`` = γ + 1 tokens."""
        self.verify.record(tokens, seconds)

    def verify_shapes(self, largest: int) -> list[float]:
        """T(k)/T(1) as priced for k = 1..``largest`` (index k − 1): the learnt
        :class:`~speculative.round_costs.VerifyTimes` shape, non-decreasing in k."""
        shapes, top = [], 1.0
        for k in range(1, largest + 1):
            top = max(top, self.verify.shape_at(k))
            shapes.append(top)
        return shapes

    def round_cost(self, gamma: int, shapes: Sequence[float] | None = None) -> float:
        """Cost of a round drafting γ tokens, in target decode steps (``shapes``: the
        :meth:`verify_shapes` to price it with, when already at hand)."""
        shapes = self.verify_shapes(gamma + 1) if shapes is None else shapes
        return gamma * self.c + self.overhead + shapes[gamma]

    def next_gamma(self) -> int:
        rates = self.position_acceptance()
        shapes = self.verify_shapes(self.max_gamma + 1)
        best_gamma, best_value = 1, 0.0
        for gamma in range(1, self.max_gamma + 1):
            value = expected_tokens_positional(rates, gamma) / self.round_cost(gamma, shapes)
            if value > best_value:
                best_gamma, best_value = gamma, value
        plain = 1.0  # a plain round: T(1)/T(1)
        if best_value > plain:
            return best_gamma
        # Speculation does not pay now; still probe now and then so estimates can recover.
        self.idle_rounds += 1
        return 1 if self.idle_rounds % self.probe_every == 0 else 0

    def update(self, drafted: int, num_accepted: int) -> None:
        self.pooled.record(drafted, num_accepted, self.decay)
        if self.situation is not None:
            self.by_situation[self.situation].record(drafted, num_accepted, self.decay)

    def observe_costs(self, gamma: int, draft_seconds: float, verify_seconds: float) -> None:
        """One round's measured drafting and verification times (γ > 0 rounds). The
        drafting is priced in plain rounds, V(1) as the timed rounds give it (the unit
        :meth:`verify_shapes` prices the verification in); before any round is timed, in
        T(1) as this pass and the curve imply."""
        if gamma < 1 or verify_seconds <= 0:
            return
        step = verify_seconds / verify_cost_at(self.verify_cost, gamma + 1)
        self.step_seconds = decayed_average(self.step_seconds, step, self.cost_decay)
        unit = self.verify.scale if self.verify.scale is not None else self.step_seconds
        excess = max(0.0, draft_seconds / unit - gamma * self.c)
        self.overhead = decayed_average(self.overhead, excess, self.cost_decay)


@dataclass(frozen=True)
class RowLoad:
    """What the load-aware policy knows of one row of a batched round."""

    alpha: float  # running estimate of the row's per-token acceptance
    max_gamma: int  # the row's own γ this round (its policy's choice; 0 = no speculation)
    fed: int = 1  # tokens the row feeds besides its drafts (the last token, catch-up)
    cost: float = 0.0  # c: one draft step of the row's drafter ÷ one target step
    call_cost: float = 0.0  # a propose call's fixed cost ÷ one target step (paid if γ > 0)
    # acceptance of draft position 1, 2, … given every one before it was kept (a position
    # past the last takes the last); empty: ``alpha`` at every position
    alphas: tuple[float, ...] = ()

    def rate(self, position: int) -> float:
        """P(the draft at ``position`` (0-based) is kept | every one before it was)."""
        if not self.alphas:
            return self.alpha
        return self.alphas[min(position, len(self.alphas) - 1)]

    def gains(self) -> float:
        """Σ_{g=1..max_gamma} P(the first g drafts are all kept): every gain it can add."""
        total, gain = 0.0, 1.0
        if not self.alphas:
            return _geometric(self.alpha, self.max_gamma)
        for position in range(self.max_gamma):
            gain *= self.rate(position)
            total += gain
        return total


LOAD_AWARE_MAX_GAMMA = 8  # a row's own γ cap under the load-aware policy (it picks up to it)
OBSERVED_TOKENS_PER_ROW = 16  # passes the load-aware policy learns its prices from: up to
# this many tokens a row on average (drafts and small trees, not prefill)


@dataclass
class PassTimes:
    """Seconds of the target passes an engine ran, by shape (rows, tokens): the median of
    each shape's last ``window`` passes, trusted from ``min_count`` passes on."""

    window: int = 9
    min_count: int = 3
    _recent: dict[tuple[int, int], deque[float]] = field(default_factory=dict, repr=False)
    _medians: dict[int, dict[int, float]] = field(default_factory=dict, repr=False)  # r -> n ->
    _counts: dict[int, int] = field(default_factory=dict, repr=False)  # r -> passes recorded

    def record(self, rows: int, tokens: int, seconds: float) -> None:
        recent = self._recent.setdefault((rows, tokens), deque(maxlen=self.window))
        recent.append(seconds)
        self._counts[rows] = self._counts.get(rows, 0) + 1
        if len(recent) >= self.min_count:
            self._medians.setdefault(rows, {})[tokens] = sorted(recent)[len(recent) // 2]

    def shapes(self) -> set[tuple[int, int]]:
        """Every (rows, tokens) recorded."""
        return set(self._recent)

    def medians(self, rows: int) -> dict[int, float]:
        """tokens -> median seconds of the trusted shapes of ``rows`` rows."""
        return self._medians.get(rows, {})

    def count(self, rows: int) -> int:
        """Passes of ``rows`` rows recorded."""
        return self._counts.get(rows, 0)


@dataclass
class LoadAwareGamma:
    """Per-row γ for one batched round, chosen for the load.

    Maximizes the expected emitted tokens per unit of time of the whole round
    (E_i(γ) = 1 + Σ_{g ≤ γ} P(the row's first g drafts are all kept), from its acceptance
    per position: a drafter that copies, like n-gram lookup, is often wrong at its first
    token and then right at the next ones, which one α for every position would miss),
    ``Σ E_i(γ_i) / (T(n)/T(1) + Σ c_i γ_i + Σ_{γ_i > 0} f_i)`` with ``n`` = every token of
    the pass (each row's fed tokens plus its drafts), ``T`` the measured verify-cost curve
    and ``f_i`` the fixed cost of a row's propose call (e.g. an n-gram lookup). Drafts are
    added one at a time to the row whose next draft is most likely accepted (α_i^(γ_i+1));
    the best allocation seen along that path wins. While the kernels are flat in n, every
    row speculates; as the batch fills the flat region, γ shrinks continuously, down to
    0 (plain batched decoding) when a draft no longer pays for its share of the pass.

    The pass of r rows and n tokens costs ``T(r, n) = K(n) + R(r) − K(r)`` (in decode
    steps): ``K`` (``verify_cost``) is measured on one row of n tokens, ``R``
    (``rows_cost``) on r rows of one token each. Weights stream once per pass whatever its
    shape, so ``K(n)`` prices the n tokens; what r rows add beyond one row of r tokens
    (their own caches' reads and attention, per-row work) is ``R(r) − K(r)``, taken as
    independent of how the tokens are spread. Without ``rows_cost`` a pass costs
    ``K(n)``, as if every token were one row's.

    The passes the engine runs correct the model (:meth:`observe`): curves measured at
    start, in a few seconds on a short context and back to back, are noisy (K(4) from
    0.95 to 1.26 between two starts on one machine) and can price a decoding pass's extra
    tokens well under what they cost once contexts grow and passes alternate with
    drafting and verification (the default model at B = 2: one token more cost 1.11× the
    plain pass where the start-up curves said 1.00×), or well over. Among the shapes of r
    rows seen at least ``PassTimes.min_count`` times, the one with fewest tokens, m₀, is
    priced by the model and sets the scale; a pass of n ≥ m₀ tokens then costs what the
    nearest observed shape m ≤ n measured plus the model's increment from m to n, made
    non-decreasing in n.

    Never a loss: speculation must be predicted to beat plain batched decoding by
    ``margin`` (a fraction of its rate), because its inputs are noisy estimates (a
    measured curve, running α and costs) and a wrong "small gain" is a real loss; and the
    curve is made non-decreasing in n (a noisy point where more tokens look cheaper than
    fewer must not make drafts look free).
    """

    verify_cost: VerifyCost  # K(n)/T(1): n tokens in one row
    margin: float = 0.05
    rows_cost: VerifyCost | None = None  # R(r)/T(1): r rows of one token each
    times: PassTimes = field(default_factory=PassTimes)  # the passes run (observe)
    refresh: int = 8  # a row count's prices are rebuilt after this many of its passes
    # r -> (its passes and trusted shapes when built, n -> T(r, n)/T(1))
    _prices: dict[int, tuple[int, int, Callable[[int], float]]] = field(
        default_factory=dict, repr=False
    )
    _costs: dict[int, float] = field(default_factory=dict, repr=False)  # n -> K(n)/T(1)
    _row_costs: dict[int, float] = field(default_factory=dict, repr=False)  # r -> row_cost
    _curves: tuple[_ExtendedCurve, _ExtendedCurve | None] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")
        rows = None if self.rows_cost is None else _ExtendedCurve(self.rows_cost)
        self._curves = (_ExtendedCurve(self.verify_cost), rows)

    def cost(self, n: int) -> float:
        """K(n)/T(1), non-decreasing in n (the running maximum of the curve from 1 to n),
        cached; past the last measured point of a mapping, extended along the line
        through its last two points (not flat)."""
        if n not in self._costs:
            known = max((m for m in self._costs if m < n), default=0)
            running = self._costs.get(known, 0.0)
            for m in range(known + 1, n + 1):  # filled from 1 up: every m < n is cached
                running = max(running, self._curves[0].at(m))
                self._costs[m] = running
        return self._costs[n]

    def row_cost(self, rows: int) -> float:
        """What ``rows`` rows of one token cost beyond one row of ``rows`` tokens,
        ``R(r) − K(r)`` (never negative: noise must not make rows look cheaper than
        tokens), cached; 0 without a measured ``rows_cost``."""
        if self.rows_cost is None or rows <= 1:
            return 0.0
        if rows not in self._row_costs:
            curve = cast(_ExtendedCurve, self._curves[1])
            self._row_costs[rows] = max(0.0, curve.at(rows) - self.cost(rows))
        return self._row_costs[rows]

    def model_cost(self, rows: int, tokens: int) -> float:
        """``T(r, n)/T(1)`` of the measured curves alone: ``tokens`` tokens over ``rows``."""
        return self.cost(tokens) + self.row_cost(rows)

    def pass_cost(self, rows: int, tokens: int) -> float:
        """``T(r, n)/T(1)``: a pass of ``tokens`` tokens over ``rows`` rows, the model
        corrected by the passes observed (:meth:`observe`)."""
        return self._priced(rows)(tokens)

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """A pass the engine ran: ``rows`` rows, ``tokens`` tokens (the positions computed,
        on a runtime that pads), ``seconds`` long. Passes of more than
        ``OBSERVED_TOKENS_PER_ROW`` tokens a row (prefill) are left to the model."""
        if tokens <= rows * OBSERVED_TOKENS_PER_ROW:
            self.times.record(rows, tokens, seconds)

    def _priced(self, rows: int) -> Callable[[int], float]:
        """n -> T(rows, n)/T(1) (:meth:`_prices_of`), rebuilt once a shape of ``rows`` rows
        is newly trusted or ``refresh`` more of its passes were observed (a round prices
        tens of passes: one build serves many rounds)."""
        count, shapes = self.times.count(rows), len(self.times.medians(rows))
        built = self._prices.get(rows)
        if built is None or built[1] != shapes or count - built[0] >= self.refresh:
            built = (count, shapes, self._prices_of(rows))
            self._prices[rows] = built
        return built[2]

    def _prices_of(self, rows: int) -> Callable[[int], float]:
        """n -> T(rows, n)/T(1): the model below the smallest observed shape m₀ (which it
        prices, setting the observations' scale); from m₀ on, the nearest observed shape
        m <= n as measured plus the model's increment from m to n, never below what any
        smaller n costs (the model is non-decreasing, so each stretch between observed
        shapes peaks at its end: one running maximum per observed shape)."""
        medians = self.times.medians(rows)
        if len(medians) < 2:  # no ratio observed yet
            return lambda n: self.model_cost(rows, n)
        shapes = sorted(medians)
        scale = self.model_cost(rows, shapes[0]) / medians[shapes[0]]  # T(1) units per s
        offsets = [medians[m] * scale - self.model_cost(rows, m) for m in shapes]
        floors, floor = [], 0.0  # floors[i]: the most any n < shapes[i] costs
        for i, m in enumerate(shapes):
            floors.append(floor)
            ends = shapes[i + 1] - 1 if i + 1 < len(shapes) else m
            floor = max(floor, self.model_cost(rows, ends) + offsets[i])

        def priced(n: int) -> float:
            at = bisect.bisect_right(shapes, n) - 1  # the largest observed m <= n
            if at < 0:
                return self.model_cost(rows, n)
            return max(floors[at], self.model_cost(rows, n) + offsets[at])

        return priced

    def choose(
        self,
        rows: list[RowLoad],
        extra_tokens: int = 0,
        padded: Callable[[Sequence[int]], int] | None = None,
        extra_rows: int = 0,
    ) -> list[int]:
        """Every row's γ; ``extra_tokens``: other tokens in the same pass (prefill chunks
        of ``extra_rows`` joining rows), which make the pass dearer but emit nothing.
        ``padded``: the pass computes ``padded(row lengths)`` positions (a runtime that
        pads every row to the longest); None: the total tokens."""
        tokens = float(len(rows))  # Σ E_i(0): each row emits one token without drafts
        lengths = [r.fed for r in rows]
        total = sum(lengths) + extra_tokens
        priced = self._priced(len(rows) + extra_rows)  # n -> T(r, n)/T(1) this round

        def pass_cost() -> float:
            if padded is None:
                return priced(total)
            return priced(padded([*lengths, extra_tokens] if extra_tokens else lengths))

        # the next draft of each row that can draft, most likely accepted first (ties:
        # the first row); a row's next gain is P(its first γ_i + 1 drafts are all kept),
        # α_i^(γ_i + 1) where acceptance does not depend on the position
        queue = [(-r.rate(0), i) for i, r in enumerate(rows) if r.max_gamma > 0]
        heapq.heapify(queue)
        # every gain still to come, Σ_i Σ_{g ≥ 1} P(g drafts kept) over the drafts left
        unclaimed = sum(rows[i].gains() for _, i in queue)
        never_cheaper = all(r.cost >= 0 and r.call_cost >= 0 for r in rows)
        drafting, cost = 0.0, pass_cost()  # Σ c_i γ_i (+ call costs); the round's cost
        best_rate, picks, best_picks = tokens / cost * (1 + self.margin), [], 0
        while queue:
            # a round's cost never falls as drafts are added, so no later allocation can
            # emit more than every gain left over this cost: stop when that cannot win
            if never_cheaper and (tokens + unclaimed) * (1 + 1e-9) < best_rate * cost:
                break
            negative_gain, i = heapq.heappop(queue)
            gain, row = -negative_gain, rows[i]
            tokens, unclaimed = tokens + gain, unclaimed - gain
            drafting += row.cost
            if lengths[i] == row.fed:  # the row's first draft: its propose call too
                drafting += row.call_cost
            lengths[i] += 1
            total += 1
            picks.append(i)
            drafted = lengths[i] - row.fed
            if drafted < row.max_gamma:
                heapq.heappush(queue, (-(gain * row.rate(drafted)), i))
            cost = pass_cost() + drafting
            if tokens / cost > best_rate:
                best_rate, best_picks = tokens / cost, len(picks)
        gammas = [0] * len(rows)
        for i in picks[:best_picks]:
            gammas[i] += 1
        return gammas


def _geometric(alpha: float, count: int) -> float:
    """α + α² + … + α^count."""
    if alpha >= 1.0:
        return float(count)
    return alpha * (1.0 - alpha**count) / (1.0 - alpha)


class _ExtendedCurve:
    """A verify-cost curve read at many n: the curve at n (:func:`verify_cost_at`); past
    the last measured point of a mapping, extended along the line through its last two
    points (not flat). A mapping's points are sorted once, not on every read (10 µs a
    read: a fresh load policy's first prices read it a hundred times, inside the rounds
    they price)."""

    def __init__(self, curve: VerifyCost) -> None:
        self.curve = curve
        self.keys = None if callable(curve) else sorted(int(x) for x in curve)

    def at(self, n: int) -> float:
        curve, keys = self.curve, self.keys
        if keys is None or len(keys) < 2 or n <= keys[-1]:
            return verify_cost_at(curve, n, keys)
        assert not callable(curve)
        a, b = keys[-2:]
        slope = (curve[b] - curve[a]) / (b - a)
        return curve[b] + slope * (n - b)


GAMMA_SCHEDULES = ("auto", "heuristic")
AUTO_LENGTH_CAP = 8  # "auto" γ for a drafter that chooses its own length: its cap


def make_gamma_policy(
    gamma: int | str,
    c: float = 0.3,
    verify_cost: dict[int, float] | None = None,
    drafter: object | None = None,
) -> GammaPolicy | int:
    """An int, ``"auto"`` (:class:`AdaptiveGamma` with the given cost estimates) or
    ``"heuristic"`` (:class:`HeuristicGamma`, transformers' +2/−1 schedule). With a
    measured ``verify_cost``, "auto" hands a drafter that chooses its own draft length
    (:class:`ChoosesDraftLength`) the curve, and caps it at AUTO_LENGTH_CAP instead."""
    gamma = parse_gamma(gamma)
    if gamma == "auto" and verify_cost and isinstance(drafter, ChoosesDraftLength):
        drafter.use_verify_cost(verify_cost)
        return max(1, min(AUTO_LENGTH_CAP, max(verify_cost) - 1))
    if gamma == "auto":
        return AdaptiveGamma(c=c, verify_cost=verify_cost or {1: 1.0, 2: 1.8})
    if gamma == "heuristic":
        return HeuristicGamma()
    return gamma


def parse_gamma(gamma: int | str) -> int | str:
    """Validate a γ setting, the one parser of generate, demo, check, bench and
    :class:`Speculator`: an integer >= 1 (also as text), "auto" or "heuristic"."""
    if isinstance(gamma, str) and gamma.strip() in GAMMA_SCHEDULES:
        return gamma.strip()
    if isinstance(gamma, str):
        try:
            gamma = int(gamma)
        except ValueError:
            raise ValueError(
                f"gamma must be an integer >= 1, 'auto' or 'heuristic', got {gamma!r}"
            ) from None
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma must be an integer >= 1, 'auto' or 'heuristic', got {gamma!r}")
    return gamma
