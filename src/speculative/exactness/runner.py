"""Draw continuations both ways (the target's own sampling and speculative sampling) and
compare them: the engine of ``speculative check``.

For each fixed prompt, N continuations of L tokens are drawn three ways, each continuation
with its own seeded generator (independent seeds across ways):

* ``reference``: the target's own sampling (plain decoding, no drafter);
* ``speculative``: the drafter, γ and mode under test;
* ``control``: the same engine with a deliberately broken rule (:mod:`.controls`).

Modes: ``chain`` and ``tree-static`` / ``tree-dynamic`` run the single-sequence
:class:`~speculative.engine.SpeculativeEngine`; ``batch`` runs the batched
:class:`~speculative.engine.BatchEngine` (one row per continuation, each with its own
generator and drafter instance), which needs a target with per-row cache slots (native or
transformers).

When the target's law of the first L tokens can be enumerated (a small vocabulary: the
tiny fixture; :mod:`.exact`), no reference sample is drawn: the speculative sample and the
control are tested against that exact law (goodness of fit, one-sample TV margin), which
needs about a quarter of the continuations of two samples for the same TV bound.

Compared per prompt (sampling): the joint distribution of the first k tokens (k = 1..3),
the marginal of each later position, and position 2 given the most frequent first tokens,
each binned (:func:`~.stats.bin_counts`) and tested (chi-square, Holm-corrected over the
run). The TV bound is claimed for the joints of the first k tokens, simultaneously
(Bonferroni over them) at confidence 1 − δ. Greedy: token-for-token identity.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from operator import itemgetter
from typing import Any, cast

import torch

from speculative.exactness import stats
from speculative.exactness.controls import CONTROL_NAME, accept_all, accept_all_tree
from speculative.exactness.exact import END, Law, enumerable, marginal, target_law

MODES = ("chain", "tree-static", "tree-dynamic", "batch")
WAYS = ("reference", "speculative", "control")
REFERENCES = ("auto", "exact", "sampled")

Tick = Callable[[int], None]


@dataclass(frozen=True)
class CheckConfig:
    """One check: what to run and how hard to look."""

    drafter: str = "ngram"
    gamma: int | str = 4
    mode: str = "chain"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    samples: int = 500  # N per prompt per way
    length: int | None = None  # L tokens per continuation (sampling); None: γ + 1, >= 3
    greedy_length: int = 32  # tokens per prompt compared at temperature 0
    alpha: float = 0.001  # family-wise level of the tests; TV bound at 1 − alpha
    max_bins: int = 8
    method: str = "chi2"  # or "g"
    pilot: int = 200  # continuations per prompt drawn first to size the control's power
    power: float = 0.99
    max_batch: int = 32
    seed: int = 0
    # chain and tree modes: draw the N speculative continuations with the batched engine
    # and `coupling` of them (evenly spread) one sequence at a time too (0: draw all N one
    # at a time); see SpeculativeDraws
    coupling: int = 0
    # stop early at a TV bound this low: look at the first ⌈2N/3⌉ continuations per prompt
    # and draw the rest only if the bound there is above it (both looks at level α/2, so
    # the claims hold whichever look stops); None: one look at N
    tv_goal: float | None = None
    # "auto": the target's exact law where it can be enumerated (small vocabularies), else
    # a sample of the target's own sampling; "exact" or "sampled" to insist
    reference: str = "auto"
    # the rules under test (None: the engine's exact ones); a broken one here is how the
    # check itself is tested
    verifier: Any = None
    tree_verifier: Any = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.samples < 1 or (self.length or 1) < 1 or self.greedy_length < 1:
            raise ValueError("samples and lengths must be >= 1")
        if self.coupling < 0:
            raise ValueError(f"coupling must be >= 0, got {self.coupling}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if self.tv_goal is not None and not 0 < self.tv_goal < 1:
            raise ValueError(f"tv_goal must be in (0, 1), got {self.tv_goal}")
        if self.reference not in REFERENCES:
            raise ValueError(
                f"reference must be one of {', '.join(REFERENCES)}, got {self.reference!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def looks(self) -> tuple[int, ...]:
        """N per prompt at each look at the speculative sample: (⌈2N/3⌉, N) with a TV
        goal (the check stops at the first look that meets it), else (N,)."""
        first = math.ceil(2 * self.samples / 3)
        if self.tv_goal is None or self.greedy or first >= self.samples:
            return (self.samples,)
        return first, self.samples

    @property
    def tree_mode(self) -> str:
        """The mode's token trees: "static", "dynamic" or "off" (chains)."""
        return self.mode.removeprefix("tree-") if self.mode.startswith("tree") else "off"

    @property
    def horizon(self) -> int:
        """L: as given, else γ + 1 (at least 3) so that a bonus token after a fully
        accepted chain lies inside the compared positions (5 for γ auto/heuristic)."""
        if self.length is not None:
            return self.length
        return max(3, self.gamma + 1) if isinstance(self.gamma, int) else 5

    def sampling(self) -> Any:
        from speculative.sampling import SamplingParams

        return SamplingParams(self.temperature, self.top_k, self.top_p)

    def sampling_label(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"T={self.temperature:g}"]
        if self.top_k:
            parts.append(f"top-k={self.top_k}")
        if self.top_p < 1:
            parts.append(f"top-p={self.top_p:g}")
        return " ".join(parts)


# ---- drawing ---------------------------------------------------------------------------


def _seed(config: CheckConfig, way: str, prompt: int, index: int) -> int:
    """Independent generator seeds: disjoint ranges per way and prompt."""
    return ((config.seed * 3 + WAYS.index(way)) * 64 + prompt) * 10_000_000 + index


def _gamma(gamma: int | str) -> Any:
    from speculative.engine.gamma import make_gamma_policy

    return make_gamma_policy(gamma)


def draw(
    target: Any,
    config: CheckConfig,
    way: str,
    prompts: Sequence[Sequence[int]],
    indices: Sequence[int],
    length: int,
    tick: Tick = lambda n: None,
    drafted: Counter | None = None,
) -> list[list[tuple[int, ...]]]:
    """Continuations ``indices`` of each prompt, drawn ``way``; [prompt][i] -> tokens.
    ``drafted[way]`` (when given) counts the drafted tokens."""
    drafted = Counter() if drafted is None else drafted
    if config.mode == "batch":
        return _draw_batch(target, config, way, prompts, indices, length, tick, drafted)
    return _draw_single(target, config, way, prompts, indices, length, tick, drafted)


@dataclass(frozen=True)
class Coupling:
    """How a chain or tree sample was drawn (:class:`SpeculativeDraws`): ``redrawn``
    continuations of each prompt drawn both by the batched engine and one sequence at a
    time, with the same seeds; ``differs`` is the first (prompt, continuation index) whose
    two draws differ (then the whole sample was drawn one sequence at a time)."""

    redrawn: int
    differs: tuple[int, int] | None = None

    def bound(self, delta: float) -> float:
        """Upper bound at confidence 1 − δ on P(the two draws differ), from ``redrawn``
        identical pairs (Clopper–Pearson for zero differences: 1 − δ^(1/m)). For any
        coupling TV(P, Q) ≤ P(X ≠ Y), so it bounds the TV between the law of the
        one-at-a-time engine and that of the batched one."""
        return 1.0 - delta ** (1.0 / self.redrawn)


Rows = list[list[tuple[int, ...]]]  # [prompt][continuation] -> its tokens


class SharedDraws:
    """Batched speculative samples drawn in this process, kept for the checks that draw
    the very same ones. A chain check's batched twin of all N continuations is, seed for
    seed, the batch-mode check's sample: the same drafter, γ, sampling settings, seeds and
    batched engine (chains, one row per continuation). A matrix task that holds both cells
    of a drafter (:mod:`.matrix`) draws it once. Apart, the chain cell draws M alone, M as
    its batched twin and N − M more batched, and the batch cell N: 2N + M in all. Shared,
    the chain cell draws its M alone and all N batched, and the batch cell none: N + M.
    A sample is kept as continuations 0..n−1 of each prompt; a check that wants more
    (a later look, :attr:`CheckConfig.tv_goal`) draws only those after them, and one that
    wants fewer gets the first n."""

    def __init__(self) -> None:
        self._samples: dict[Hashable, tuple[Rows, int]] = {}
        self.reused = 0  # requests served, wholly or in part, from the store

    def batched(
        self,
        target: Any,
        config: CheckConfig,
        prompts: Sequence[Sequence[int]],
        wanted: range,
        length: int,
        tick: Tick = lambda n: None,
    ) -> tuple[Rows, int]:
        """Continuations ``wanted`` (a range from 0 or later) of each prompt drawn
        speculatively by the batched engine with chains (those not kept yet drawn now,
        from the first one not kept), and how many tokens were drafted for the
        continuations kept (all of them: a count that says whether any were)."""
        key = _batched_key(target, config, prompts, length)
        rows, count = self._samples.get(key, ([[] for _ in prompts], 0))
        have = len(rows[0])
        if have > wanted.start:
            self.reused += 1
            tick((min(have, wanted.stop) - wanted.start) * len(prompts))
        if have < wanted.start:
            raise ValueError(f"the store keeps continuations 0..{have - 1}; ask from those on")
        if have < wanted.stop:
            drafted: Counter = Counter()
            way, as_batch = "speculative", replace(config, mode="batch")
            more = _draw_batch(target, as_batch, way, prompts, range(have, wanted.stop), length,
                               tick, drafted)  # fmt: skip
            rows = [kept + new for kept, new in zip(rows, more, strict=True)]
            count += drafted[way]
            self._samples[key] = rows, count
        return [list(r[wanted.start : wanted.stop]) for r in rows], count


def _batched_key(
    target: Any, config: CheckConfig, prompts: Sequence[Sequence[int]], length: int
) -> Hashable:
    """What decides a batched chain sample: the target, every setting of the check but its
    mode and sizes, the prompts and L."""
    settings = replace(config, mode="batch", samples=1, coupling=0, pilot=0, length=length,
                       tv_goal=None)  # fmt: skip
    model = (target.name, target.runtime, target.precision)
    return model, settings, tuple(tuple(p) for p in prompts)


class SpeculativeDraws:
    """A check's speculative continuations of each prompt, drawn look by look
    (:meth:`grow`), and how they were drawn.

    With ``config.coupling`` = m > 0 in a chain or tree mode (and a target with per-row
    cache slots), the first look's m continuations, spread evenly over its N, are drawn
    twice with the same seeds: by the mode's own one-sequence engine and by the batched
    engine (rows of the mode's chains or trees). When every pair is token for token
    identical, the others are drawn by the batched engine only: the two engines are
    coupled through the seeds, and :meth:`Coupling.bound` bounds the TV between their
    laws (the m spread over the N, so that the bound holds for the whole sample even if a
    drafter changed over the run). At a pair that differs (a drafter that learns across
    generations: ``auto``'s choices, a dynamic tree's calibration) the others are drawn
    one sequence at a time as well. A later look draws the continuations after the first
    look's the way the first look drew its others.

    ``shared`` keeps full batched chain samples for other checks of this process (see
    :class:`SharedDraws`): a batch-mode sample comes from it, and a coupled chain sample
    takes its batched part from it when the m pairs match the stored rows (else it draws
    its own batched twin)."""

    def __init__(
        self,
        target: Any,
        config: CheckConfig,
        prompts: Sequence[Sequence[int]],
        length: int,
        tick: Tick = lambda n: None,
        drafted: Counter | None = None,
        shared: SharedDraws | None = None,
    ) -> None:
        self.target, self.config, self.prompts, self.length = target, config, prompts, length
        self.tick, self.shared = tick, shared
        self.drafted = Counter() if drafted is None else drafted
        self.rows: Rows = [[] for _ in prompts]
        self.coupling: Coupling | None = None
        self._how: str | None = None  # how continuations after the first look are drawn

    @property
    def n(self) -> int:
        """Continuations drawn per prompt so far."""
        return len(self.rows[0]) if self.rows else 0

    def grow(self, n: int) -> Rows:
        """Draw continuations up to n per prompt; returns all of them."""
        if self._how is None:
            self.rows = self._first(n)
        elif n > self.n:
            more = self._more(range(self.n, n))
            self.rows = [kept + new for kept, new in zip(self.rows, more, strict=True)]
        return self.rows

    def _way(self, how: str, indices: Sequence[int], counts: Counter | None = None) -> Rows:
        """Continuations ``indices`` drawn one way: "shared" (the store's), "batched",
        "alone" (the one-sequence engine) or "plain" (the mode's own engine)."""
        args = self.target, self.config, "speculative", self.prompts
        counts = self.drafted if counts is None else counts
        if how == "shared":
            assert self.shared is not None and isinstance(indices, range)
            rows, count = self.shared.batched(self.target, self.config, self.prompts, indices,
                                              self.length, self.tick)  # fmt: skip
            counts["speculative"] = max(counts["speculative"], count)  # the store's rows'
            return rows
        draw_way = {"batched": _draw_batch, "alone": _draw_single, "plain": draw}[how]
        return draw_way(*args, indices, self.length, self.tick, counts)

    def _more(self, indices: range) -> Rows:
        return self._way(cast(str, self._how), indices)

    def _first(self, n: int) -> Rows:
        from speculative.models.base import SupportsBatchRows

        config, m = self.config, min(self.config.coupling, n)
        if config.mode == "batch" and self.shared is not None:
            self._how = "shared"
            return self._way("shared", range(n))
        if m == 0 or config.mode == "batch" or not isinstance(self.target.lm, SupportsBatchRows):
            self._how = "plain"
            return self._way("plain", range(n))
        chosen = spread(n, m)
        others = sorted(set(range(n)) - set(chosen))
        counts = {"alone": Counter(), "batched": Counter()}
        alone = self._way("alone", chosen, counts["alone"])
        if self.shared is not None and config.tree_mode == "off":
            full = self._way("shared", range(n), counts["batched"])
            if _first_difference(_picked(full, chosen), alone) is None:
                self._how, self.coupling = "shared", Coupling(m)
                self.drafted["speculative"] += counts["batched"]["speculative"]
                return full
        twin = self._way("batched", chosen, counts["batched"])
        differs = _first_difference(twin, alone)
        if differs is None:
            self._how, kept = "batched", twin
        else:
            self._how, kept = "alone", alone
            differs = differs[0], chosen[differs[1]]
        self.drafted["speculative"] += counts[self._how]["speculative"]
        more = self._way(self._how, others)
        self.coupling = Coupling(m, differs)
        return [_in_order(chosen, a, others, b) for a, b in zip(kept, more, strict=True)]


def spread(n: int, m: int) -> list[int]:
    """m of the indices 0..n−1, evenly spaced (0 first)."""
    return [j * n // m for j in range(m)]


def _in_order(first: list[int], a: list[tuple], second: list[int], b: list[tuple]) -> list[tuple]:
    """Rows drawn for two disjoint index lists, back in index order."""
    merged = dict(zip(first, a, strict=True)) | dict(zip(second, b, strict=True))
    return [merged[i] for i in sorted(merged)]


def _picked(rows: Rows, indices: Sequence[int]) -> Rows:
    """The continuations ``indices`` of each prompt's rows."""
    return [[prompt_rows[i] for i in indices] for prompt_rows in rows]


def _first_difference(a: list[list[tuple]], b: list[list[tuple]]) -> tuple[int, int] | None:
    """The first (prompt, index) at which two draws of the same continuations differ."""
    for p, (rows_a, rows_b) in enumerate(zip(a, b, strict=True)):
        for i, (row_a, row_b) in enumerate(zip(rows_a, rows_b, strict=True)):
            if row_a != row_b:
                return p, i
    return None


def _stop(target: Any, length: int) -> Any:
    from speculative.engine import StopCriteria

    return StopCriteria(max_new_tokens=length, eos_token_ids=target.eos_token_ids)


def _rules(config: CheckConfig, way: str) -> tuple[Any, Any]:
    """The (chain, tree) verifiers a way runs: the control's broken ones, the rules under
    test for the speculative sample (None: the engine's exact ones)."""
    if way == "control":
        return accept_all, accept_all_tree
    if way == "speculative":
        return config.verifier, config.tree_verifier
    return None, None


def _drafter_and_tree(config: CheckConfig, way: str, target: Any) -> tuple[Any, Any]:
    """A fresh drafter for ``way`` (None for the reference) and its tree strategy (None
    for chains), the tree verified by the way's rule."""
    from speculative.drafters.registry import build_drafter
    from speculative.engine.tree import make_tree_round

    drafter = None if way == "reference" else build_drafter(config.drafter, target)
    if way != "reference" and drafter is None:
        raise ValueError("the check needs a drafter (--draft none has nothing to check)")
    tree = make_tree_round(config.tree_mode, drafter)
    tree_verifier = _rules(config, way)[1]
    if tree is not None and tree_verifier is not None:
        tree.verifier = tree_verifier
    return drafter, tree


def _draw_single(target, config, way, prompts, indices, length, tick, drafted):
    from speculative.engine import SpeculativeEngine

    drafter, tree = _drafter_and_tree(config, way, target)
    engine = SpeculativeEngine(
        target.lm, drafter, _gamma(config.gamma), tree, verifier=_rules(config, way)[0]
    )
    params, stop = config.sampling(), _stop(target, length)
    out: list[list[tuple[int, ...]]] = []
    for p, prompt in enumerate(prompts):
        rows = []
        for i in indices:
            generator = torch.Generator().manual_seed(_seed(config, way, p, i))
            result = engine.generate(prompt, params, stop, generator)
            drafted[way] += result.stats.drafted_tokens
            rows.append(tuple(result.token_ids))
            tick(1)
        out.append(rows)
    return out


def _draw_batch(target, config, way, prompts, indices, length, tick, drafted):
    """The batched engine, one row per continuation (``config.max_batch`` at a time),
    each with its own generator and drafter, drafting the mode's chains or trees."""
    from speculative.engine import BatchEngine, BatchRequest
    from speculative.models.base import SupportsBatchRows

    if not isinstance(target.lm, SupportsBatchRows):
        raise ValueError(
            f"batch mode needs per-row cache slots, which the {target.runtime} runtime lacks "
            "(use the native runtime)"
        )
    engine = BatchEngine(target.lm, config.max_batch, verifier=_rules(config, way)[0])
    pool = [_drafter_and_tree(config, way, target) for _ in range(config.max_batch)]
    params, stop = config.sampling(), _stop(target, length)
    queue = [(p, i) for p in range(len(prompts)) for i in indices]
    queue.reverse()
    owners: dict[int, tuple[tuple[int, int], Any]] = {}
    results: dict[tuple[int, int], tuple[int, ...]] = {}
    while queue or engine.rows:
        while queue and len(engine.rows) < config.max_batch:
            p, i = key = queue.pop()
            drafter, tree = pooled = pool.pop()
            generator = torch.Generator().manual_seed(_seed(config, way, p, i))
            request = BatchRequest(
                prompts[p], params, stop, generator, drafter, _gamma(config.gamma), tree=tree
            )
            owners[engine.add(request)] = (key, pooled)
        engine.step()
        for row_id in [r for r in owners if r in engine.finished]:
            key, pooled = owners.pop(row_id)
            pool.append(pooled)
            result = engine.finished.pop(row_id)
            drafted[way] += result.stats.drafted_tokens
            results[key] = tuple(result.token_ids)
            tick(1)
    return [[results[(p, i)] for i in indices] for p in range(len(prompts))]


# ---- comparing -------------------------------------------------------------------------


@dataclass
class Comparison:
    """One binned comparison: two samples (``stats.Table``) or a sample against the exact
    law (``stats.FitTable``)."""

    prompt: int
    name: str  # "x1..x2" (joint of the first 2 tokens), "x3" (marginal), "x2 | x1=17"
    position: int  # the deepest position it looks at (1-based)
    joint: bool  # a joint of the first tokens: carries the TV claim
    table: stats.Table | stats.FitTable
    test: stats.TestResult
    tv_hat: float
    tv_bound: float = 1.0
    p_adjusted: float = 1.0

    @property
    def exact_reference(self) -> bool:
        return isinstance(self.table, stats.FitTable)

    def sizes(self) -> list[int | str]:
        """[reference N, sample N]; "exact" for a reference that is the law itself."""
        t = self.table
        return ["exact", t.n] if isinstance(t, stats.FitTable) else [t.n_a, t.n_b]

    def tv_upper_bound(self, delta: float) -> float:
        """The binned TV bound at confidence 1 − δ: one sample's against the law, or two
        samples'."""
        t = self.table
        if isinstance(t, stats.FitTable):
            return stats.fit_tv_upper_bound(t, delta)
        return stats.tv_upper_bound(t, delta)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "statistic": self.name,
            "position": self.position,
            "bins": self.table.bins,
            "n": self.sizes(),
            "chi2": self.test.statistic,
            "df": self.test.df,
            "p_value": self.test.p_value,
            "p_adjusted": self.p_adjusted,
            "tv_hat": self.tv_hat,
            "tv_bound": self.tv_bound if self.joint else None,
        }


def padded(rows: Sequence[tuple[int, ...]], length: int) -> list[tuple[int | str, ...]]:
    """Continuations as the law writes them: exactly ``length`` entries, :data:`END` after
    a continuation that stopped early."""
    return [r[:length] if len(r) >= length else r + (END,) * (length - len(r)) for r in rows]


@dataclass(frozen=True)
class Statistic:
    """One compared quantity of a prompt's continuations (padded to L: :func:`padded`):
    ``key(row)`` over the rows for which ``given(row)`` holds (all of them when None)."""

    name: str
    position: int
    joint: bool
    key: Callable[[tuple], Hashable]
    given: Callable[[tuple], bool] | None = None

    def counts(self, rows: Sequence[tuple]) -> Counter:
        kept = rows if self.given is None else filter(self.given, rows)
        return Counter(map(self.key, kept))

    def law(self, law: Law) -> dict[Hashable, float]:
        """This statistic's exact law (conditioned on ``given``, renormalized)."""
        if self.given is None:
            return marginal(law, self.key)
        kept = {seq: p for seq, p in law.items() if self.given(seq)}
        mass = sum(kept.values())
        return {k: p / mass for k, p in marginal(kept, self.key).items()}


def statistics(length: int, first_tokens: Sequence[int | str]) -> list[Statistic]:
    """The joints of the first k tokens (k = 1..3), the marginal of each later position,
    and position 2 given each of ``first_tokens``."""
    found = [
        Statistic("x1" if k == 1 else f"x1..x{k}", k, True, lambda r, k=k: r[:k])
        for k in range(1, min(length, 3) + 1)
    ]
    found += [Statistic(f"x{j + 1}", j + 1, False, itemgetter(j)) for j in range(1, length)]
    if length >= 2:
        found += [
            Statistic(f"x2 | x1={t}", 2, False, itemgetter(1), lambda r, t=t: r[0] == t)
            for t in first_tokens
            if t != END
        ]
    return found


def comparisons(
    ref: Sequence[Sequence[tuple[int, ...]]] | Sequence[Law],
    other: list[list[tuple[int, ...]]],
    length: int,
    config: CheckConfig,
    conditional_top: int = 2,
    min_conditional: int = 100,
    tv_alpha: float | None = None,
    looks: int = 1,
) -> list[Comparison]:
    """Every comparison of one run, Holm-adjusted, with the joint TV bounds (at confidence
    1 − ``tv_alpha``, default ``config.alpha``, simultaneously). ``ref`` per prompt: a
    sample (list of continuations) or the exact law (a :data:`Law` dict). ``looks``: the
    looks planned at the sample (:attr:`CheckConfig.looks`); each gets α / looks of the
    tests' level (Bonferroni: the p-values are multiplied by it) and of the bounds'."""
    found: list[Comparison] = []
    first_token = itemgetter(0)
    for p, (reference, drawn) in enumerate(zip(ref, other, strict=True)):
        exact = isinstance(reference, dict)
        rows = padded(drawn, length)
        if exact:
            first = marginal(reference, first_token)
            top = sorted(first, key=lambda t: -first[t])[:conditional_top]
        else:
            reference = padded(reference, length)
            pooled = Counter(map(first_token, [*reference, *rows]))
            top = [t for t, _ in pooled.most_common(conditional_top)]
        for statistic in statistics(length, top):
            counts = statistic.counts(rows)
            if exact:
                if statistic.given and counts.total() < min_conditional:
                    continue
                table = stats.bin_against_law(counts, statistic.law(reference), config.max_bins)
                test = stats.goodness_of_fit(table, config.method)
                tv_hat = stats.fit_tv_distance(table)
            else:
                ref_counts = statistic.counts(reference)
                if statistic.given and min(counts.total(), ref_counts.total()) < min_conditional:
                    continue
                table = stats.bin_counts(ref_counts, counts, config.max_bins)
                test = stats.homogeneity_test(table, config.method)
                tv_hat = stats.tv_distance(table)
            found.append(Comparison(p, statistic.name, statistic.position, statistic.joint,
                                    table, test, tv_hat))  # fmt: skip
    adjusted = stats.holm([c.test.p_value for c in found])
    joints = sum(c.joint for c in found)
    alpha = (config.alpha if tv_alpha is None else tv_alpha) / looks
    for c, p_adj in zip(found, adjusted, strict=True):
        c.p_adjusted = min(1.0, p_adj * looks)
        if c.joint:
            c.tv_bound = c.tv_upper_bound(alpha / joints)
    return found


def pilot_requirement(found: list[Comparison], pilot: int, config: CheckConfig) -> int | None:
    """N per prompt at which the control is detected (power ``config.power``) judging by
    its effect in a pilot of ``pilot`` per prompt; None when the pilot shows no effect."""
    alpha = config.alpha / max(1, len(found))  # Holm's strictest step
    needs = [
        pilot if math.isinf(c.test.statistic)  # an outcome the law calls impossible
        else stats.samples_to_detect((c.test.statistic - c.test.df) / pilot, c.test.df,
                                     alpha, config.power)
        for c in found
        if c.test.df >= 1 and c.test.statistic > c.test.df
    ]  # fmt: skip
    return min(needs) if needs else None


# ---- the check -------------------------------------------------------------------------


class ControlTooWeak(ValueError):
    """N is too small for the negative control to be detected: a pass would mean nothing."""


@dataclass
class CheckReport:
    config: CheckConfig
    target: str
    runtime: str
    precision: str
    prompts: int
    exact: bool
    control_detected: bool
    seconds: float
    tv_bound: float | None = None  # sampling: max over the joint statistics
    failing: str | None = None  # where NOT EXACT was found
    comparisons: list[Comparison] = field(default_factory=list)
    control: list[Comparison] = field(default_factory=list)
    greedy_identical: list[bool] = field(default_factory=list)
    control_identical: list[bool] = field(default_factory=list)
    required_samples: int | None = None  # pilot's estimate of the N the control needs
    reference: str = "sampled"  # "exact law" when the continuations met the target's law
    control_samples: int = 0  # control continuations per prompt it was tested on
    coupling: Coupling | None = None  # how a chain or tree sample was drawn (batched twin)
    samples: int = 0  # speculative continuations per prompt tested (the look it stopped at)

    @property
    def verdict(self) -> str:
        if not self.exact:
            return f"NOT EXACT ({self.failing})"
        if self.config.greedy:
            return "exact (greedy: token-for-token identical on every prompt)"
        confidence = 100 * (1 - self.config.alpha)
        return f"exact (TV ≤ {self.tv_bound:.3f} at {confidence:g}%)"

    def _coupling_dict(self) -> dict[str, Any] | None:
        if self.coupling is None:
            return None
        c = self.coupling
        return {"redrawn": c.redrawn, "differs": c.differs, "bound": self.coupling_bound}

    @property
    def look(self) -> str | None:
        """Which look at the sample the check stopped at (:attr:`CheckConfig.looks`),
        as "look 1 of 2"; None where it planned one."""
        looks = self.config.looks
        if len(looks) == 1:
            return None
        return f"look {looks.index(self.samples) + 1} of {len(looks)}"

    @property
    def coupling_bound(self) -> float | None:
        """The coupling term of the TV bound (None: the sample is the mode's own draw)."""
        return coupling_term(self.coupling, self.config.alpha)

    def min_p(self, which: list[Comparison]) -> float | None:
        return min((c.p_adjusted for c in which), default=None)

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "verdict": self.verdict,
            "exact": self.exact,
            "control_detected": self.control_detected,
            "control": CONTROL_NAME,
            "target": self.target,
            "runtime": self.runtime,
            "precision": self.precision,
            "drafter": c.drafter,
            "gamma": c.gamma,
            "mode": c.mode,
            "sampling": c.sampling_label(),
            "samples_per_prompt": self.samples,
            "looks": list(c.looks),
            "tv_goal": c.tv_goal,
            "prompts": self.prompts,
            "length": c.greedy_length if c.greedy else c.horizon,
            "alpha": c.alpha,
            "tv_bound": self.tv_bound,
            "failing": self.failing,
            "min_p_adjusted": self.min_p(self.comparisons),
            "control_min_p_adjusted": self.min_p(self.control),
            "required_samples": self.required_samples,
            "reference": self.reference,
            "control_samples": self.control_samples,
            "coupling": self._coupling_dict(),
            "seconds": self.seconds,
            "comparisons": [x.to_dict() for x in self.comparisons],
            "control_comparisons": [x.to_dict() for x in self.control],
            "greedy_identical": self.greedy_identical,
            "control_identical": self.control_identical,
        }


def total_draws(config: CheckConfig, prompts: int, exact: bool = False) -> int:
    """Continuations a check draws (for a progress bar): against the exact law, the
    speculative sample and the control's pilot (more only if the pilot misses it); a
    coupled sample's m redrawn ones twice."""
    if config.greedy:
        return 3 * prompts
    redrawn = 0 if config.mode == "batch" else min(config.coupling, config.samples)
    if exact:
        return prompts * (config.samples + min(config.pilot, config.samples) + redrawn)
    return prompts * (3 * config.samples + redrawn)


def uses_exact_law(target: Any, config: CheckConfig) -> bool:
    """Whether a sampling check compares against the target's exact law (``reference``
    "exact", or "auto" and the law is small enough to enumerate) rather than drawing a
    reference sample. Raises ValueError for "exact" on a law too large to enumerate."""
    if config.greedy or config.reference == "sampled":
        return False
    length, params, vocab = config.horizon, config.sampling(), target.lm.vocab_size
    if enumerable(vocab, length, params):
        return True
    if config.reference == "exact":
        raise ValueError(
            f"the exact law of {length} tokens over a {vocab}-token vocabulary is too "
            "large to enumerate; use --reference sampled (or fewer tokens: --length)"
        )
    return False


def exact_laws(
    target: Any, config: CheckConfig, prompts: Sequence[Sequence[int]]
) -> list[Law] | None:
    """The target's exact law of the first L tokens for each prompt when the check
    compares against it (:func:`uses_exact_law`); None to draw a reference sample."""
    if not uses_exact_law(target, config):
        return None
    length, params, eos = config.horizon, config.sampling(), target.eos_token_ids
    return [target_law(target.lm, prompt, params, length, eos) for prompt in prompts]


def run_check(
    target: Any,
    config: CheckConfig,
    prompts: Sequence[Sequence[int]],
    tick: Tick = lambda n: None,
    shared: SharedDraws | None = None,
) -> CheckReport:
    """Run one check on a loaded target (a :class:`~speculative.targets.LoadedModel`).
    Raises :class:`ControlTooWeak` when N cannot detect the negative control. ``shared``:
    batched samples this check may take from, and leaves for, the process's other checks
    (:class:`SharedDraws`). The report is the same with or without it wherever a batched
    row does not depend on its neighbours (the native runtime, bitwise); on the
    transformers runtime a padded pass can round a row differently."""
    started = time.perf_counter()
    if config.greedy:
        report = _greedy_check(target, config, prompts, tick)
    else:
        report = _sampling_check(target, config, prompts, tick, shared)
    report.seconds = time.perf_counter() - started
    return report


def require_drafts(drafted: Counter, config: CheckConfig, way: str = "speculative") -> None:
    """A check in which the drafter never proposed a token tested nothing: refuse it."""
    if drafted[way] == 0:
        raise ValueError(
            f"the '{config.drafter}' drafter proposed no token in {config.mode} mode on these "
            "prompts, so nothing speculative was checked (heads need a target that gives "
            "its features)"
        )


def _report(target, config, prompts, **kw) -> CheckReport:
    return CheckReport(
        config=config, target=target.name, runtime=target.runtime,
        precision=target.precision, prompts=len(prompts), seconds=0.0, **kw,
    )  # fmt: skip


def _greedy_check(target, config, prompts, tick) -> CheckReport:
    once, drafted = range(1), Counter()
    runs = {
        way: [rows[0] for rows in draw(target, config, way, prompts, once,
                                       config.greedy_length, tick, drafted)]
        for way in WAYS
    }  # fmt: skip
    require_drafts(drafted, config)
    identical = [a == b for a, b in zip(runs["reference"], runs["speculative"], strict=True)]
    control = [a == b for a, b in zip(runs["reference"], runs["control"], strict=True)]
    failing = None
    if not all(identical):
        p = identical.index(False)
        a, b = runs["reference"][p], runs["speculative"][p]
        position = next(
            (j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b))
        )
        failing = f"prompt {p}, position {position + 1}: {a[position:position + 1]} vs " \
                  f"{b[position:position + 1]}"  # fmt: skip
    return _report(
        target, config, prompts, exact=all(identical), control_detected=not all(control),
        failing=failing, greedy_identical=identical, control_identical=control, samples=1,
    )  # fmt: skip


def _sampling_check(target, config, prompts, tick, shared=None) -> CheckReport:
    laws = exact_laws(target, config, prompts)
    if laws is not None:
        return _fit_check(target, config, prompts, laws, tick, shared)
    n, length = config.samples, config.horizon
    pilot = min(config.pilot, n)
    drafted: Counter = Counter()
    ref = draw(target, config, "reference", prompts, range(pilot), length, tick)
    ctl = draw(target, config, "control", prompts, range(pilot), length, tick, drafted)
    require_drafts(drafted, config, "control")
    required = pilot_requirement(comparisons(ref, ctl, length, config), pilot, config)
    if pilot < n and (required is None or required > n):
        raise _too_weak(n, pilot, required)
    draws = SpeculativeDraws(target, config, prompts, length, tick, drafted, shared)

    def compare(spec: Rows, n_look: int) -> list[Comparison]:
        require_drafts(drafted, config)
        for rows, way in ((ref, "reference"), (ctl, "control")):
            more = draw(target, config, way, prompts, range(len(rows[0]), n_look), length, tick)
            for a, b in zip(rows, more, strict=True):
                a.extend(b)
        alpha = _sample_alpha(config, draws.coupling)
        return comparisons(ref, spec, length, config, tv_alpha=alpha, looks=len(config.looks))

    found = _look_by_look(config, draws, compare)
    control = comparisons(ref, ctl, length, config)
    failing = _failing(found, config.alpha)
    return _report(
        target, config, prompts, exact=failing is None,
        control_detected=any(c.p_adjusted < config.alpha for c in control),
        tv_bound=_tv_bound(found, config, draws.coupling), failing=failing,
        comparisons=found, control=control, required_samples=required,
        control_samples=len(ctl[0]), coupling=draws.coupling, samples=draws.n,
    )  # fmt: skip


def _look_by_look(
    config: CheckConfig, draws: SpeculativeDraws, compare: Callable[[Rows, int], list[Comparison]]
) -> list[Comparison]:
    """The comparisons at each look (:attr:`CheckConfig.looks`) in turn, the sample grown
    to its N, until one fails, meets the TV goal, or is the last; returns that look's."""
    looks = config.looks
    for n in looks:
        found = compare(draws.grow(n), n)
        if n == looks[-1] or _failing(found, config.alpha) is not None:
            return found
        if _tv_bound(found, config, draws.coupling) <= cast(float, config.tv_goal):
            return found
    raise AssertionError("unreachable: the last look returns")


def coupling_term(coupling: Coupling | None, alpha: float) -> float | None:
    """What a batched twin adds to a TV bound at 1 − α: P(twin ≠ mode) at 1 − α/2 (the
    sample's own bound takes the other α/2); None when the sample is the mode's own draw."""
    if coupling is None or coupling.differs is not None:
        return None
    return coupling.bound(alpha / 2)


def _sample_alpha(config: CheckConfig, coupling: Coupling | None) -> float:
    """The TV bound's level for the sample itself: all of α, or half when the other half
    goes to the coupling of a batched twin."""
    coupled = coupling_term(coupling, config.alpha) is not None
    return config.alpha / 2 if coupled else config.alpha


def _tv_bound(found: list[Comparison], config: CheckConfig, coupling: Coupling | None) -> float:
    """The cell's TV bound at 1 − α: the largest joint's, plus the coupling term when the
    sample is the batched twin's (both hold together with probability ≥ 1 − α)."""
    bound = max(c.tv_bound for c in found if c.joint)
    return bound + (coupling_term(coupling, config.alpha) or 0.0)


def _too_weak(n: int, pilot: int, required: int | None) -> ControlTooWeak:
    need = "is not visible in the pilot" if required is None else f"needs N ≥ {required}"
    return ControlTooWeak(
        f"N = {n} per prompt is too small to detect the negative control ({CONTROL_NAME}): "
        f"a pilot of {pilot} per prompt shows it {need}; raise --samples (or use a "
        "drafter that disagrees with the target more often)"
    )


def _failing(found: list[Comparison], alpha: float) -> str | None:
    failed = [c for c in found if c.p_adjusted < alpha]
    worst = min(failed, key=lambda c: (c.p_adjusted, c.position), default=None)
    if worst is None:
        return None
    return (
        f"position {worst.position} ({worst.name}) on prompt {worst.prompt}: "
        f"p = {worst.p_adjusted:.2g} after Holm"
    )


def _fit_check(target, config, prompts, laws: list[Law], tick, shared=None) -> CheckReport:
    """The sampling check against the target's exact law: the speculative sample and the
    control are each tested against the law itself (no reference sample is drawn). The
    control is tested on its pilot, and drawn up to N only if the pilot misses it."""
    n, length = config.samples, config.horizon
    pilot = min(config.pilot, n)
    drafted: Counter = Counter()
    ctl = draw(target, config, "control", prompts, range(pilot), length, tick, drafted)
    require_drafts(drafted, config, "control")
    control = comparisons(laws, ctl, length, config)
    required = pilot_requirement(control, pilot, config)
    detected = any(c.p_adjusted < config.alpha for c in control)
    if not detected and pilot < n:
        if required is None or required > n:
            raise _too_weak(n, pilot, required)
        for rows, more in zip(ctl, draw(target, config, "control", prompts, range(pilot, n),
                                        length, tick), strict=True):  # fmt: skip
            rows.extend(more)
        control = comparisons(laws, ctl, length, config)
        detected = any(c.p_adjusted < config.alpha for c in control)
    draws = SpeculativeDraws(target, config, prompts, length, tick, drafted, shared)

    def compare(spec: Rows, n_look: int) -> list[Comparison]:
        require_drafts(drafted, config)
        alpha = _sample_alpha(config, draws.coupling)
        return comparisons(laws, spec, length, config, tv_alpha=alpha, looks=len(config.looks))

    found = _look_by_look(config, draws, compare)
    failing = _failing(found, config.alpha)
    return _report(
        target, config, prompts, exact=failing is None, control_detected=detected,
        tv_bound=_tv_bound(found, config, draws.coupling), failing=failing,
        comparisons=found, control=control, required_samples=required,
        reference="exact law", control_samples=len(ctl[0]), coupling=draws.coupling,
        samples=draws.n,
    )  # fmt: skip
