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

Compared per prompt (sampling): the joint distribution of the first k tokens (k = 1..3),
the marginal of each later position, and position 2 given the most frequent first tokens,
each binned (:func:`~.stats.bin_counts`) and tested (chi-square, Holm-corrected over the
run). The TV bound is claimed for the joints of the first k tokens, simultaneously
(Bonferroni over them) at confidence 1 − δ. Greedy: token-for-token identity.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from speculative.exactness import stats
from speculative.exactness.controls import CONTROL_NAME, accept_all, accept_all_tree

END = "<end>"  # a continuation stopped (EOS) before this position
MODES = ("chain", "tree-static", "tree-dynamic", "batch")
WAYS = ("reference", "speculative", "control")

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
    # the rules under test (None: the engine's exact ones); a broken one here is how the
    # check itself is tested
    verifier: Any = None
    tree_verifier: Any = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.samples < 1 or (self.length or 1) < 1 or self.greedy_length < 1:
            raise ValueError("samples and lengths must be >= 1")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

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
    from speculative.pipeline import make_gamma_policy

    return make_gamma_policy(gamma)


def draw(
    target: Any,
    config: CheckConfig,
    way: str,
    prompts: Sequence[Sequence[int]],
    indices: range,
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


def _stop(target: Any, length: int) -> Any:
    from speculative.engine import StopCriteria

    return StopCriteria(max_new_tokens=length, eos_token_ids=target.eos_token_ids)


def _draw_single(target, config, way, prompts, indices, length, tick, drafted):
    from speculative.engine import SpeculativeEngine
    from speculative.pipeline import build_drafter, make_tree_round

    drafter = None if way == "reference" else build_drafter(config.drafter, target)
    if way != "reference" and drafter is None:
        raise ValueError("the check needs a drafter (--draft none has nothing to check)")
    tree_mode = config.mode.removeprefix("tree-") if config.mode.startswith("tree") else "off"
    tree = make_tree_round(tree_mode, drafter)
    chain_verifier = config.verifier if way == "speculative" else None
    if way == "control":
        chain_verifier = accept_all
    tree_verifier = accept_all_tree if way == "control" else config.tree_verifier
    if tree is not None and tree_verifier is not None:
        tree.verifier = tree_verifier
    engine = SpeculativeEngine(
        target.lm, drafter, _gamma(config.gamma), tree, verifier=chain_verifier
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
    from speculative.engine import BatchEngine, BatchRequest
    from speculative.models.base import SupportsBatchRows
    from speculative.pipeline import build_drafter

    if not isinstance(target.lm, SupportsBatchRows):
        raise ValueError(
            f"batch mode needs per-row cache slots, which the {target.runtime} runtime lacks "
            "(use the native runtime)"
        )
    verifier = accept_all if way == "control" else None
    if way == "speculative":
        verifier = config.verifier
    engine = BatchEngine(target.lm, config.max_batch, verifier=verifier)
    spec = "none" if way == "reference" else config.drafter
    pool = [build_drafter(spec, target) for _ in range(config.max_batch)]
    params, stop = config.sampling(), _stop(target, length)
    queue = [(p, i) for p in range(len(prompts)) for i in indices]
    queue.reverse()
    owners: dict[int, tuple[tuple[int, int], Any]] = {}
    results: dict[tuple[int, int], tuple[int, ...]] = {}
    while queue or engine.rows:
        while queue and len(engine.rows) < config.max_batch:
            p, i = key = queue.pop()
            drafter = pool.pop()
            generator = torch.Generator().manual_seed(_seed(config, way, p, i))
            request = BatchRequest(
                prompts[p], params, stop, generator, drafter, _gamma(config.gamma)
            )
            owners[engine.add(request)] = (key, drafter)
        engine.step()
        for row_id in [r for r in owners if r in engine.finished]:
            key, drafter = owners.pop(row_id)
            pool.append(drafter)
            result = engine.finished.pop(row_id)
            drafted[way] += result.stats.drafted_tokens
            results[key] = tuple(result.token_ids)
            tick(1)
    return [[results[(p, i)] for i in indices] for p in range(len(prompts))]


# ---- comparing -------------------------------------------------------------------------


@dataclass
class Comparison:
    """One binned two-sample comparison."""

    prompt: int
    name: str  # "x1..x2" (joint of the first 2 tokens), "x3" (marginal), "x2 | x1=17"
    position: int  # the deepest position it looks at (1-based)
    joint: bool  # a joint of the first tokens: carries the TV claim
    table: stats.Table
    test: stats.TestResult
    tv_hat: float
    tv_bound: float = 1.0
    p_adjusted: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "statistic": self.name,
            "position": self.position,
            "bins": self.table.bins,
            "n": [self.table.n_a, self.table.n_b],
            "chi2": self.test.statistic,
            "df": self.test.df,
            "p_value": self.test.p_value,
            "p_adjusted": self.p_adjusted,
            "tv_hat": self.tv_hat,
            "tv_bound": self.tv_bound if self.joint else None,
        }


def _token(row: tuple[int, ...], j: int) -> int | str:
    return row[j] if j < len(row) else END


def comparisons(
    ref: list[list[tuple[int, ...]]],
    other: list[list[tuple[int, ...]]],
    length: int,
    config: CheckConfig,
    conditional_top: int = 2,
    min_conditional: int = 100,
) -> list[Comparison]:
    """Every comparison of one run, Holm-adjusted, with the joint TV bounds."""
    found: list[Comparison] = []

    def add(prompt, name, position, joint, a: Counter, b: Counter) -> None:
        table = stats.bin_counts(a, b, config.max_bins)
        test = stats.homogeneity_test(table, config.method)
        found.append(
            Comparison(prompt, name, position, joint, table, test, stats.tv_distance(table))
        )

    for p, (rows_a, rows_b) in enumerate(zip(ref, other, strict=True)):
        for k in range(1, min(length, 3) + 1):
            a = Counter(tuple(_token(r, j) for j in range(k)) for r in rows_a)
            b = Counter(tuple(_token(r, j) for j in range(k)) for r in rows_b)
            add(p, "x1" if k == 1 else f"x1..x{k}", k, True, a, b)
        for j in range(1, length):
            a = Counter(_token(r, j) for r in rows_a)
            b = Counter(_token(r, j) for r in rows_b)
            add(p, f"x{j + 1}", j + 1, False, a, b)
        if length >= 2:
            first = Counter(_token(r, 0) for r in rows_a) + Counter(_token(r, 0) for r in rows_b)
            for token, _ in first.most_common(conditional_top):
                a = Counter(_token(r, 1) for r in rows_a if _token(r, 0) == token)
                b = Counter(_token(r, 1) for r in rows_b if _token(r, 0) == token)
                if token != END and min(a.total(), b.total()) >= min_conditional:
                    add(p, f"x2 | x1={token}", 2, False, a, b)
    adjusted = stats.holm([c.test.p_value for c in found])
    joints = sum(c.joint for c in found)
    for c, p_adj in zip(found, adjusted, strict=True):
        c.p_adjusted = p_adj
        if c.joint:
            c.tv_bound = stats.tv_upper_bound(c.table, config.alpha / joints)
    return found


def pilot_requirement(found: list[Comparison], pilot: int, config: CheckConfig) -> int | None:
    """N per prompt at which the control is detected (power ``config.power``) judging by
    its effect in a pilot of ``pilot`` per prompt; None when the pilot shows no effect."""
    alpha = config.alpha / max(1, len(found))  # Holm's strictest step
    needs = [
        stats.samples_to_detect((c.test.statistic - c.test.df) / pilot, c.test.df, alpha,
                                config.power)
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

    @property
    def verdict(self) -> str:
        if not self.exact:
            return f"NOT EXACT ({self.failing})"
        if self.config.greedy:
            return "exact (greedy: token-for-token identical on every prompt)"
        confidence = 100 * (1 - self.config.alpha)
        return f"exact (TV ≤ {self.tv_bound:.3f} at {confidence:g}%)"

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
            "samples_per_prompt": c.samples,
            "prompts": self.prompts,
            "length": c.greedy_length if c.greedy else c.horizon,
            "alpha": c.alpha,
            "tv_bound": self.tv_bound,
            "failing": self.failing,
            "min_p_adjusted": self.min_p(self.comparisons),
            "control_min_p_adjusted": self.min_p(self.control),
            "required_samples": self.required_samples,
            "seconds": self.seconds,
            "comparisons": [x.to_dict() for x in self.comparisons],
            "control_comparisons": [x.to_dict() for x in self.control],
            "greedy_identical": self.greedy_identical,
            "control_identical": self.control_identical,
        }


def total_draws(config: CheckConfig, prompts: int) -> int:
    """Continuations a check draws (for a progress bar)."""
    return 3 * prompts * (1 if config.greedy else config.samples)


def run_check(
    target: Any,
    config: CheckConfig,
    prompts: Sequence[Sequence[int]],
    tick: Tick = lambda n: None,
) -> CheckReport:
    """Run one check on a loaded target (a :class:`~speculative.pipeline.LoadedModel`).
    Raises :class:`ControlTooWeak` when N cannot detect the negative control."""
    started = time.perf_counter()
    if config.greedy:
        report = _greedy_check(target, config, prompts, tick)
    else:
        report = _sampling_check(target, config, prompts, tick)
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
        failing=failing, greedy_identical=identical, control_identical=control,
    )  # fmt: skip


def _sampling_check(target, config, prompts, tick) -> CheckReport:
    n, length = config.samples, config.horizon
    pilot = min(config.pilot, n)
    drafted: Counter = Counter()
    ref = draw(target, config, "reference", prompts, range(pilot), length, tick)
    ctl = draw(target, config, "control", prompts, range(pilot), length, tick, drafted)
    require_drafts(drafted, config, "control")
    required = pilot_requirement(comparisons(ref, ctl, length, config), pilot, config)
    if pilot < n and (required is None or required > n):
        need = "is not visible in the pilot" if required is None else f"needs N ≥ {required}"
        raise ControlTooWeak(
            f"N = {n} per prompt is too small to detect the negative control ({CONTROL_NAME}): "
            f"a pilot of {pilot} per prompt shows it {need}; raise --samples (or use a "
            "drafter that disagrees with the target more often)"
        )
    spec = draw(target, config, "speculative", prompts, range(n), length, tick, drafted)
    require_drafts(drafted, config)
    rest = range(pilot, n)
    if rest:
        for rows, more in (
            (ref, draw(target, config, "reference", prompts, rest, length, tick)),
            (ctl, draw(target, config, "control", prompts, rest, length, tick)),
        ):
            for a, b in zip(rows, more, strict=True):
                a.extend(b)
    found = comparisons(ref, spec, length, config)
    control = comparisons(ref, ctl, length, config)
    failed = [c for c in found if c.p_adjusted < config.alpha]
    worst = min(failed, key=lambda c: (c.p_adjusted, c.position), default=None)
    failing = None
    if worst is not None:
        failing = (
            f"position {worst.position} ({worst.name}) on prompt {worst.prompt}: "
            f"p = {worst.p_adjusted:.2g} after Holm"
        )
    return _report(
        target, config, prompts, exact=worst is None,
        control_detected=any(c.p_adjusted < config.alpha for c in control),
        tv_bound=max(c.tv_bound for c in found if c.joint), failing=failing,
        comparisons=found, control=control, required_samples=required,
    )  # fmt: skip
