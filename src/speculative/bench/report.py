"""Summaries of a benchmark run: one row per configuration × category (and "all"), the
terminal table, the Markdown report and the JSON payload."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from speculative import theory
from speculative.bench.llamacpp import ENGINE as LLAMACPP
from speculative.bench.methods import OURS, PLAIN, TRANSFORMERS, Method
from speculative.bench.prompts import categories
from speculative.bench.runner import BenchRun, Measurement
from speculative.engine.stats import GenerationStats
from speculative.hardware import cpu_info

ALL = "all"


@dataclass
class StatsTotals:
    """Engine counters summed over prompts (their :class:`GenerationStats` added up)."""

    summed: GenerationStats = field(default_factory=GenerationStats)

    def add(self, measurement: Measurement) -> None:
        if measurement.stats is not None:
            self.summed.add(measurement.stats)

    @property
    def drafted(self) -> int:
        return self.summed.drafted_tokens

    @property
    def target_calls(self) -> int:
        return self.summed.target_calls

    @property
    def rounds(self) -> Counter[int]:
        """γ drafted -> rounds."""
        return Counter(self.summed.gammas)

    @property
    def acceptance_rate(self) -> float | None:
        return self.summed.acceptance_rate if self.drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        return self.summed.mean_accepted_length if self.target_calls else None

    @property
    def mean_gamma(self) -> float | None:
        return self.drafted / self.target_calls if self.target_calls else None

    @property
    def seconds_per_draft(self) -> float | None:
        """Drafting wall time per drafted token (None when nothing was drafted)."""
        return self.summed.draft_seconds / self.drafted if self.drafted else None

    @property
    def per_position_acceptance(self) -> list[float]:
        return self.summed.per_position_acceptance


@dataclass
class ResultRow:
    """One configuration on one category (or "all")."""

    config: str
    engine: str
    runtime: str
    method: str
    gamma: str
    category: str
    prompts: int
    new_tokens: int
    seconds: float
    tokens_per_second: float
    decode_tokens_per_second: float | None = None  # after the prompt's prefill (ours)
    speedup_vs_plain: float | None = None
    decode_speedup_vs_plain: float | None = None
    speedup_vs_transformers: float | None = None
    speedup_vs_transformers_plain: float | None = None
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    mean_gamma: float | None = None
    per_position_acceptance: list[float] = field(default_factory=list)
    draft_cost: float | None = None  # c as calibrated: one draft after a target step
    # c in this run: its drafting time per drafted token ÷ plain decoding's time per token
    run_draft_cost: float | None = None
    seconds_per_draft: float | None = None
    predicted_speedup: float | None = None
    predicted_speedup_generalized: float | None = None
    realized_over_predicted: float | None = None
    realized_over_predicted_generalized: float | None = None
    outputs_identical: bool = True
    mismatched_prompts: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _throughput(items: Sequence[Measurement]) -> tuple[int, float, float]:
    tokens = sum(len(x.tokens) for x in items)
    seconds = sum(x.median_seconds for x in items)
    return tokens, seconds, (tokens / seconds if seconds > 0 else 0.0)


def _predictions(
    totals: StatsTotals, c: float | None, curve: dict[int, float]
) -> tuple[float | None, float | None]:
    """The seed formula's speedup from measured α, c and the mean γ; the generalized one
    from c, the measured T(k) and each draft position's measured acceptance, over the γ
    each round drafted (:func:`~speculative.theory.mixed_speedup`: a run that mixes γ is
    not a run at its mean γ, and drafts are not kept independently of each other: after a
    kept n-gram draft the next is kept more often than the mean α says). Realized ÷ this
    prediction then checks the cost model alone."""
    alpha, mean_gamma = totals.acceptance_rate, totals.mean_gamma
    if alpha is None or mean_gamma is None or c is None:
        return None, None
    gamma = max(1, round(mean_gamma))
    # a run that drafted recorded its rounds' γ and each position's acceptance
    positions = totals.per_position_acceptance
    generalized = theory.mixed_speedup(positions, totals.rounds, c, curve)
    return theory.speedup(alpha, gamma, c), generalized


def _decode_throughput(items: Sequence[Measurement]) -> float | None:
    """Tokens per second of decoding alone (prefill excluded), None when not measured."""
    decode = [x.median_decode_seconds for x in items]
    if not decode or any(d is None for d in decode):
        return None
    seconds = sum(d for d in decode if d is not None)
    return sum(len(x.tokens) for x in items) / seconds if seconds > 0 else None


def _base_row(method: Method, category: str, items: Sequence[Measurement]) -> ResultRow:
    tokens, seconds, tps = _throughput(items)
    return ResultRow(
        decode_tokens_per_second=_decode_throughput(items),
        config=method.name,
        engine=method.engine,
        runtime=method.runtime,
        method=method.family,
        gamma=method.gamma,
        category=category,
        prompts=len(items),
        new_tokens=tokens,
        seconds=seconds,
        tokens_per_second=tps,
    )


def summarize(run: BenchRun) -> list[ResultRow]:
    """Rows for every configuration × (each category, then "all")."""
    mismatched = {(m.method, m.prompt_index) for m in run.mismatches}
    rows: list[ResultRow] = []
    for category in [*categories(run.prompts), ALL]:
        items = [x for x in run.measurements if category in (ALL, x.category)]
        by_method = {m.name: [x for x in items if x.method == m.name] for m in run.methods}
        category_rows = []
        for method in run.methods:
            row = _base_row(method, category, by_method[method.name])
            _add_engine_stats(row, method, by_method[method.name], run)
            bad = sum((method.name, x.prompt_index) in mismatched for x in by_method[method.name])
            row.mismatched_prompts, row.outputs_identical = bad, bad == 0
            category_rows.append(row)
        _add_speedups(category_rows)
        rows.extend(category_rows)
    return rows


def _add_engine_stats(
    row: ResultRow, method: Method, items: Sequence[Measurement], run: BenchRun
) -> None:
    if method.engine != OURS:
        return
    totals = StatsTotals()
    for x in items:
        totals.add(x)
    costs = run.costs[method.runtime]
    row.acceptance_rate = totals.acceptance_rate
    row.mean_accepted_length = totals.mean_accepted_length
    row.mean_gamma = totals.mean_gamma
    row.per_position_acceptance = totals.per_position_acceptance
    row.seconds_per_draft = totals.seconds_per_draft
    if method.family != PLAIN:
        row.draft_cost = costs.draft_cost.get(method.family)
    if method.family != PLAIN and not method.gamma.startswith("tree-"):  # chain formulas
        row.predicted_speedup, row.predicted_speedup_generalized = _predictions(
            totals, row.draft_cost, costs.target.verify_cost
        )


def _add_speedups(rows: Sequence[ResultRow]) -> None:
    """Speedups vs our plain decoding (same runtime) and vs transformers' same method."""
    plain = {r.runtime: r for r in rows if r.engine == OURS and r.method == PLAIN}
    peers = {r.method: r for r in rows if r.engine == TRANSFORMERS}
    hf_plain = peers.get(PLAIN)
    for row in rows:
        reference = plain.get(row.runtime)
        row.speedup_vs_plain = _ratio(
            row.tokens_per_second, reference and reference.tokens_per_second
        )
        row.decode_speedup_vs_plain = _ratio(
            row.decode_tokens_per_second, reference and reference.decode_tokens_per_second
        )
        row.speedup_vs_transformers_plain = _ratio(
            row.tokens_per_second, hf_plain and hf_plain.tokens_per_second
        )
        if row.engine == OURS and row.method in peers:
            row.speedup_vs_transformers = _ratio(
                row.tokens_per_second, peers[row.method].tokens_per_second
            )
        if row.seconds_per_draft is not None and reference is not None:
            plain_step = _ratio(1.0, reference.decode_tokens_per_second)
            row.run_draft_cost = _ratio(row.seconds_per_draft, plain_step)
        row.realized_over_predicted = _ratio(row.speedup_vs_plain, row.predicted_speedup)
        row.realized_over_predicted_generalized = _ratio(
            row.speedup_vs_plain, row.predicted_speedup_generalized
        )


# --------------------------------------------------------------------------- payload


def payload(run: BenchRun, rows: Sequence[ResultRow]) -> dict[str, Any]:
    """The JSON object of a run (``results`` holds one entry per configuration × category)."""
    settings = run.settings
    return {
        "model": run.model,
        "runtimes": list(settings.runtimes),
        "precision": settings.precision,
        "max_new_tokens": settings.max_new_tokens,
        "repeats": settings.repeats,
        "greedy": run.settings.temperature == 0,
        "temperature": run.settings.temperature,
        "top_p": run.settings.top_p,
        "prompts": len(run.prompts),
        "prompt_tokens_mean": sum(run.prompt_tokens) / len(run.prompt_tokens),
        "categories": categories(run.prompts),
        "configs": [
            {
                "config": m.name,
                "engine": m.engine,
                "runtime": m.runtime,
                "method": m.family,
                "gamma": m.gamma,
            }
            for m in run.methods
        ],
        "costs": {runtime: c.to_dict() for runtime, c in run.costs.items()},
        "results": [r.to_dict() for r in rows],
        "mismatches": [asdict(m) for m in run.mismatches],
        "outputs_identical": not run.mismatches,
        "llamacpp_same_text": run.peer_agreement,
        "highlights": highlights(rows),
        "cpu": cpu_info().as_dict(),
    }


def best_per_category(rows: Sequence[ResultRow]) -> dict[str, dict[str, Any]]:
    """Our fastest configuration in each category (speedup vs plain)."""
    best: dict[str, ResultRow] = {}
    for row in rows:
        if row.engine != OURS or row.method == PLAIN or row.speedup_vs_plain is None:
            continue
        if row.category not in best or row.speedup_vs_plain > best[row.category].speedup_vs_plain:
            best[row.category] = row
    return {
        cat: {"config": r.config, "speedup_vs_plain": r.speedup_vs_plain} for cat, r in best.items()
    }


def auto_vs_fixed(rows: Sequence[ResultRow]) -> list[dict[str, Any]]:
    """Adaptive γ and the heuristic vs the best fixed γ of the same drafter (category all)."""
    overall = [r for r in rows if r.category == ALL and r.engine == OURS and r.method != PLAIN]
    comparisons = []
    for runtime, family in dict.fromkeys((r.runtime, r.method) for r in overall):
        same = [
            r
            for r in overall
            if (r.runtime, r.method) == (runtime, family) and r.speedup_vs_plain is not None
        ]
        fixed = [r for r in same if r.gamma.isdigit()]
        if not fixed:
            continue
        best = max(fixed, key=lambda r: r.speedup_vs_plain or 0.0)
        for schedule in (r for r in same if not r.gamma.isdigit()):
            comparisons.append(
                {
                    "runtime": runtime,
                    "method": family,
                    "schedule": schedule.gamma,
                    "speedup": schedule.speedup_vs_plain,
                    "best_fixed_gamma": best.gamma,
                    "best_fixed_speedup": best.speedup_vs_plain,
                    "ratio": _ratio(schedule.speedup_vs_plain, best.speedup_vs_plain),
                }
            )
    return comparisons


def highlights(rows: Sequence[ResultRow]) -> dict[str, Any]:
    overall = [r for r in rows if r.category == ALL]
    return {
        "best_per_category": best_per_category(rows),
        "ours_vs_transformers": {
            r.config: r.speedup_vs_transformers
            for r in overall
            if r.speedup_vs_transformers is not None
        },
        "realized_over_predicted": {
            r.config: [r.realized_over_predicted, r.realized_over_predicted_generalized]
            for r in overall
            if r.realized_over_predicted is not None
        },
        "auto_vs_fixed": auto_vs_fixed(rows),
    }


# --------------------------------------------------------------------------- text tables


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:{spec}}{suffix}"


OVERALL_COLUMNS = (
    "config", "tok/s", "×plain", "decode tok/s", "decode ×plain", "×hf-same", "α", "τ",
    "mean γ", "c", "c run",
    "pred", "pred T(k)", "real/pred", "real/pred T(k)", "identical",
)  # fmt: skip


def overall_cells(row: ResultRow) -> list[str]:
    return [
        row.config,
        fmt(row.tokens_per_second, ".1f"),
        fmt(row.speedup_vs_plain, ".2f", "x"),
        fmt(row.decode_tokens_per_second, ".1f"),
        fmt(row.decode_speedup_vs_plain, ".2f", "x"),
        fmt(row.speedup_vs_transformers, ".2f", "x"),
        fmt(row.acceptance_rate),
        fmt(row.mean_accepted_length),
        fmt(row.mean_gamma, ".1f"),
        fmt(row.draft_cost, ".3f"),
        fmt(row.run_draft_cost, ".3f"),
        fmt(row.predicted_speedup, ".2f", "x"),
        fmt(row.predicted_speedup_generalized, ".2f", "x"),
        fmt(row.realized_over_predicted),
        fmt(row.realized_over_predicted_generalized),
        identity_cell(row),
    ]


def identity_cell(row: ResultRow) -> str:
    """Whether a row's greedy text equals our plain decoding's; another program's rows
    (llama.cpp) are counted apart, in the notes."""
    if row.engine == LLAMACPP:
        return "see notes"
    return "yes" if row.outputs_identical else f"NO ({row.mismatched_prompts})"


def category_matrix(rows: Sequence[ResultRow]) -> tuple[list[str], list[list[str]]]:
    """Speedup vs plain: one line per configuration, one column per category."""
    cats = list(dict.fromkeys(r.category for r in rows))
    configs = list(dict.fromkeys(r.config for r in rows))
    lookup = {(r.config, r.category): r for r in rows}
    body = [
        [config, *(fmt(lookup[config, c].speedup_vs_plain, ".2f", "x") for c in cats)]
        for config in configs
    ]
    return ["config", *cats], body


def text_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(line[i]) for line in body)) for i, h in enumerate(header)]
    lines = [
        "  ".join(
            h.rjust(w) if i else h.ljust(w)
            for i, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for line in body:
        lines.append(
            "  ".join(
                v.rjust(w) if i else v.ljust(w)
                for i, (v, w) in enumerate(zip(line, widths, strict=True))
            )
        )
    return "\n".join(lines)


def markdown_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines.extend("| " + " | ".join(line) + " |" for line in body)
    return "\n".join(lines)


def decoding_label(run: BenchRun) -> str:
    """ "greedy", or the sampling settings (outputs then differ by chance: not compared)."""
    settings = run.settings
    if settings.temperature == 0:
        return "greedy"
    return (
        f"sampling at temperature {settings.temperature:g}, top-p {settings.top_p:g} "
        "(outputs not compared)"
    )


def terminal_report(run: BenchRun, rows: Sequence[ResultRow]) -> str:
    overall = [overall_cells(r) for r in rows if r.category == ALL]
    header, body = category_matrix(rows)
    parts = [
        f"model {run.model} · {len(run.prompts)} prompts · {run.settings.max_new_tokens} new "
        f"tokens max · median of {run.settings.repeats} · {decoding_label(run)}",
        "",
        text_table(OVERALL_COLUMNS, overall),
        "",
        "speedup vs plain decoding by category:",
        text_table(header, body),
        "",
        costs_line(run),
    ]
    parts.extend(m.describe() for m in run.mismatches)
    return "\n".join(parts)


def costs_line(run: BenchRun) -> str:
    lines = []
    for runtime, costs in run.costs.items():
        curve = " ".join(f"{k}:{v:.2f}" for k, v in costs.target.verify_cost.items())
        drafts = " ".join(f"{name}={c:.3f}" for name, c in costs.draft_cost.items())
        lines.append(
            f"{runtime}: target step {costs.target.step_ms:.1f} ms · T(k)/T(1) {curve} · c {drafts}"
        )
    return "\n".join(lines)


def markdown_report(run: BenchRun, rows: Sequence[ResultRow], plots: Sequence[str]) -> str:
    overall = [overall_cells(r) for r in rows if r.category == ALL]
    header, body = category_matrix(rows)
    facts = highlights(rows)
    best = facts["best_per_category"]
    best_lines = [
        f"- **{cat}**: {v['config']} ({fmt(v['speedup_vs_plain'], '.2f', 'x')})"
        for cat, v in best.items()
    ]
    auto_lines = [
        f"- {a['runtime']}/{a['method']} γ={a['schedule']}: {fmt(a['speedup'], '.2f', 'x')} "
        f"vs best fixed γ={a['best_fixed_gamma']} {fmt(a['best_fixed_speedup'], '.2f', 'x')} "
        f"(ratio {fmt(a['ratio'])})"
        for a in facts["auto_vs_fixed"]
    ]
    mismatch_lines = [f"- ⚠️ {m.describe()}" for m in run.mismatches] or [
        "- every configuration's greedy output matched plain decoding token for token"
    ]
    mismatch_lines += [
        f"- {name} (same model file, another program): the same text as ours on "
        f"{v['same']}/{v['prompts']} prompts (its int4 arithmetic rounds differently)"
        for name, v in run.peer_agreement.items()
    ]
    sections = [
        "# `speculative bench` report",
        "",
        f"Model **{run.model}**, runtimes {', '.join(run.settings.runtimes)}, "
        f"{len(run.prompts)} prompts ({', '.join(categories(run.prompts))}), "
        f"up to {run.settings.max_new_tokens} new tokens, {decoding_label(run)}, median of "
        f"{run.settings.repeats} run(s) after a warm-up; configurations interleaved prompt by "
        "prompt. `×plain`: tokens/s ÷ our plain decoding; `×hf-same`: ÷ transformers' "
        "`generate()` with the same method (plain, `assistant_model`, "
        "`prompt_lookup_num_tokens`). `c` is the drafter's cost calibrated before the "
        "run (one draft of one token right after a target step, ÷ that step), `c run` its "
        "drafting time in the run per drafted token ÷ plain decoding's time per token (a "
        "propose call's fixed part spread over its drafts). `pred` is the seed formula "
        "from measured α and c at "
        "the mean γ, `pred T(k)` the generalized one with the measured verify-cost curve "
        "and each draft position's measured acceptance, over the γ each round drafted "
        "(realized ÷ it checks the cost model).",
        "",
        f"CPU: {cpu_info().summary()}.",
        "",
        "## Overall",
        "",
        markdown_table(OVERALL_COLUMNS, overall),
        "",
        "## Speedup vs plain decoding by category",
        "",
        markdown_table(header, body),
        "",
        "## Best configuration per category",
        "",
        *best_lines,
        "",
        "## Adaptive γ and the heuristic vs the best fixed γ",
        "",
        *(auto_lines or ["- (no fixed γ to compare with)"]),
        "",
        "## Measured costs",
        "",
        "```",
        costs_line(run),
        "```",
        "",
        "## Output identity (greedy)",
        "",
        *mismatch_lines,
        "",
    ]
    if plots:
        sections.extend(["## Plots", ""])
        sections.extend(f"![{name}]({name})" for name in plots)
        sections.append("")
    return "\n".join(sections)
