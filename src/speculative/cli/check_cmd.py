"""`speculative check`: is speculative sampling with this target and drafter distributed
as the target's own sampling? A statistic, a negative control and a verdict."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

from speculative.cli.common import (
    CliError,
    Formatter,
    add_json_flag,
    emit_json,
    every_core,
    non_negative_float,
    positive_int,
    probability,
)
from speculative.drafters.tree import TREE_MODES
from speculative.exactness.controls import CONTROL_NAME

EXIT_NOT_EXACT = 1

DESCRIPTION = """\
Check that speculative decoding with a target, a drafter and a mode is exact: that its
output is distributed as the target's own samples.

Method. From a few fixed prompts it draws N continuations of L tokens three ways, each
with its own seeded generator: the target's own sampling (plain decoding, no drafter),
speculative sampling with --draft / --gamma / the mode, and a NEGATIVE CONTROL: the same
engine with a deliberately broken rule (every drafted token accepted, the bonus token
drawn from the wrong row of target distributions: visible with poor and near-perfect
drafters alike, since L defaults to γ + 1). For each prompt it compares the joint
distribution of the first 1, 2 and 3 tokens, the marginal of each later position, and
position 2 given the most frequent first tokens: rare outcomes binned into "other", a
chi-square (or G) test each, Holm-corrected over the run. For the joints it
gives a 99.9% upper confidence bound on the total-variation distance of the binned
distributions at that N: TV̂ + sqrt(ln(M/δ) / N) (M joints, δ = 0.001, N per way: TV̂ is
biased upwards, never downwards, and one draw moves it by at most 1/N, so McDiarmid's
inequality bounds how far it can fall below its mean). Greedy (--temperature 0): token-for-token
identity with plain decoding on every prompt.

Exact law. Where the target's law of the first L tokens can be enumerated (a small
vocabulary, such as --target tiny: at most 20,000 forwards), no reference sample is drawn
(--reference auto; exact or sampled insist): the speculative sample is tested against the
law itself (chi-square or G goodness of fit), and the TV bound is the one-sample
TV̂ + sqrt(ln(M/δ) / (2N)), which needs about a quarter of the continuations
of the two-sample check for the same bound.

Power. A pilot of 200 continuations per prompt measures the control's effect first; if N
cannot detect it, the check stops with an error instead of passing on too few samples.
The control must be detected at the end, or the check fails (exit 2): a pass that could
not have failed means nothing.

Verdict: "exact (TV ≤ ε at 99.9%)" (exit 0) or "NOT EXACT" with the failing position
(exit 1). Modes: chains (default), --tree static|dynamic, --batch (the batched engine: one
row per continuation; native or transformers runtime). --matrix runs the grid drafters × modes ×
sampling settings on a tiny in-process test model, then on the default model at a
smaller N, and writes docs/exactness.md-style markdown (--out); its cells run in one
worker process per core (--jobs).

Coupling (--coupling M). For a large N, a chain or tree sample can be drawn by the
batched engine, whose rows share target passes: M of the N continuations are drawn both
ways with the same seeds and must be token for token identical. Since TV(P, Q) ≤ P(X ≠ Y)
for any coupling of X ~ P and Y ~ Q, M identical pairs bound the TV between the two
engines by 1 − (δ/2)^(1/M) at confidence 1 − δ/2, and that term is added to the sample's
own bound (taken at δ/2). A drafter whose drafts differ between the engines is drawn one
sequence at a time instead.

Looks (--tv-goal EPS). The check looks at the sample twice, at its first 2N/3
continuations and at all N, each look's tests and bound at level δ/2 (Bonferroni over the
looks), and stops at the first look whose bound is at most EPS: the verdict and the bound
hold at 99.9% whichever look stopped, and an early stop draws a third fewer
continuations. A failing test stops it at once.
"""

DEFAULT_PROMPTS = (
    "Write one sentence about the sea.",
    "Name a fruit and say what colour it is.",
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from speculative.drafters.registry import drafter_help

    parser = subparsers.add_parser(
        "check",
        help="statistical exactness check of a target × drafter × mode (with a control)",
        description=DESCRIPTION + "\nDrafters (--draft):\n" + drafter_help(),
        formatter_class=Formatter,
    )
    parser.add_argument(
        "--target",
        default="default",
        help="target model: 'default', a folder, a .gguf, a hub id, or 'tiny' (a test "
        "fixture: a seeded random 20-word Llama with random heads, built in the cache)",
    )
    parser.add_argument("--draft", default="ngram", help="drafter (see above)")
    parser.add_argument("--gamma", default="4", help="drafted tokens per round, or 'auto'")
    parser.add_argument(
        "--runtime", choices=["auto", "hf", "native"], default="auto", help="model runtime"
    )
    parser.add_argument("--precision", default="auto", help="target precision (see generate)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--tree", choices=TREE_MODES, default="off", help="draft token trees")
    mode.add_argument(
        "--batch",
        action="store_true",
        help="use the batched engine (one row per continuation, 32 at a time; native or "
        "transformers runtime). On the native runtime, rows start from the prompt positions "
        "other rows' slots hold (prefix sharing), which makes it the faster mode at the "
        "default model's int4; transformers rows prefill the prompt each",
    )
    parser.add_argument(
        "--temperature", type=non_negative_float, default=1.0, help="0: greedy identity check"
    )
    parser.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: off)")
    parser.add_argument("--top-p", type=probability, default=1.0, help="nucleus mass (1: off)")
    parser.add_argument(
        "--samples",
        type=positive_int,
        default=500,
        help="N continuations per prompt per way (more: a tighter TV bound, longer run)",
    )
    parser.add_argument(
        "--length",
        type=positive_int,
        default=None,
        help="L tokens per continuation (sampling; default γ + 1, at least 3, so that the "
        "control's bonus token is compared)",
    )
    parser.add_argument(
        "--prompt", action="append", default=None, metavar="TEXT",
        help="a prompt (repeat for several; default: two built-in prompts)",
    )  # fmt: skip
    parser.add_argument(
        "--reference",
        choices=["auto", "exact", "sampled"],
        default="auto",
        help="what the speculative sample is compared with: the target's exact law "
        "(enumerated; small vocabularies only), a sample of its own sampling, or auto "
        "(the exact law where it can be enumerated)",
    )
    parser.add_argument(
        "--coupling",
        type=int,
        default=None,
        metavar="M",
        help="chain and tree modes: draw M of the N continuations (evenly spread) both one "
        "sequence at a time and batched, with the same seeds; if every pair is identical, "
        "draw the rest batched (much faster at large N) and add the coupling term, about "
        "ln(2/δ)/M, to the TV bound; if a pair differs, draw everything one at a time "
        "(default: N/10 from N = 10,000 on, else 0)",
    )
    parser.add_argument(
        "--tv-goal",
        type=probability,
        default=None,
        metavar="EPS",
        help="stop early once the TV bound is at most EPS: look at the first 2N/3 "
        "continuations per prompt and draw the rest only if the bound there is above EPS "
        "(each look at level δ/2, so the verdict and bound hold whichever stops; --matrix: "
        "the tiny model's cells) (default: one look at N)",
    )
    parser.add_argument("--test", choices=["chi2", "g"], default="chi2", help="the test")
    parser.add_argument("--seed", type=int, default=0, help="base of the generators' seeds")
    parser.add_argument(
        "--matrix", action="store_true", help="run the drafters × modes × sampling grid"
    )
    parser.add_argument(
        "--matrix-samples",
        type=positive_int,
        default=1000,
        help="--matrix: N per prompt on the tiny model",
    )
    parser.add_argument(
        "--default-samples",
        type=int,
        default=300,
        help="--matrix: N per prompt on the default model (0 skips it)",
    )
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=None,
        help="--matrix: cells run in this many worker processes, one thread each (default: "
        "one per core); the results do not depend on it",
    )
    parser.add_argument("--out", type=Path, default=None, help="write check.json and check.md here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json_flag(parser)
    parser.set_defaults(run=run)


# ---- loading ---------------------------------------------------------------------------


def tiny_folder() -> Path:
    from speculative.exactness.tiny import tiny_target_folder
    from speculative.models.loading import cache_root

    return tiny_target_folder(cache_root() / "fixtures")


def load_check_target(name: str, runtime: str, precision: str) -> tuple[Any, list[list[int]]]:
    """The loaded target and its prompts as token ids (tiny: the fixture's own)."""
    from speculative.targets import load_target

    if name == "tiny":
        import torch

        from speculative.exactness.tiny import TINY_PROMPTS

        torch.set_num_threads(1)  # tiny tensors: threads only add synchronization
        runtime = "native" if runtime == "auto" else runtime
        precision = "fp32" if precision == "auto" else precision
        return load_target(str(tiny_folder()), runtime, precision), [list(p) for p in TINY_PROMPTS]
    return load_target(name, runtime, precision), []


def encode_prompts(target: Any, texts: list[str]) -> list[list[int]]:
    from speculative.targets import encode_prompt

    return [encode_prompt(target.tokenizer, text) for text in texts]


def config_from_args(args: argparse.Namespace) -> Any:
    from speculative.engine.gamma import parse_gamma
    from speculative.exactness import CheckConfig

    mode = "batch" if args.batch else ("chain" if args.tree == "off" else f"tree-{args.tree}")
    return CheckConfig(
        drafter=args.draft,
        gamma=parse_gamma(args.gamma),
        mode=mode,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        samples=args.samples,
        length=args.length,
        method=args.test,
        seed=args.seed,
        reference=args.reference,
        coupling=default_coupling(args.samples) if args.coupling is None else args.coupling,
        tv_goal=args.tv_goal,
    )


# ---- running ---------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if args.matrix:
        return run_matrix_command(args)
    from speculative.sampling import SamplingParams

    SamplingParams(args.temperature, args.top_k, args.top_p)  # validate before loading
    config_from_args(args)  # validate before loading
    if args.draft.strip() == "none":
        raise CliError("--draft none has nothing to check: name a drafter")
    target, prompts = load_check_target(args.target, args.runtime, args.precision)
    config = config_from_args(args)
    if args.prompt or not prompts:
        prompts = encode_prompts(target, args.prompt or list(DEFAULT_PROMPTS))
    report = check_with_progress(target, config, prompts, not args.no_progress)
    print_report(report)
    if args.out is not None:
        write_report(args.out, report)
    if args.json:
        emit_json(report.to_dict())
    if not report.exact:
        return EXIT_NOT_EXACT
    if not report.control_detected:
        raise CliError(
            f"the negative control was not detected at N = {config.samples}: this pass means "
            "nothing; raise --samples"
        )
    return 0


def check_with_progress(target: Any, config: Any, prompts: list[list[int]], progress: bool):
    from tqdm import tqdm

    from speculative.exactness import ControlTooWeak, run_check, total_draws, uses_exact_law

    try:
        total = total_draws(config, len(prompts), uses_exact_law(target, config))
    except ValueError as exc:
        raise CliError(str(exc)) from None
    bar = tqdm(total=total, desc="check", unit="seq", file=sys.stderr, disable=not progress)
    with bar:
        try:
            report = run_check(target, config, prompts, bar.update)
        except ControlTooWeak as exc:
            raise CliError(str(exc)) from None
        bar.total = bar.n  # an early look draws fewer than planned
        bar.refresh()
    return report


def print_report(report: Any) -> None:
    c = report.config
    print(
        f"target {report.target} ({report.runtime}, {report.precision}) · drafter {c.drafter} "
        f"· γ {c.gamma} · mode {c.mode} · {c.sampling_label()}"
    )
    if c.greedy:
        for p, (same, ctl) in enumerate(
            zip(report.greedy_identical, report.control_identical, strict=True)
        ):
            print(
                f"  prompt {p}: {c.greedy_length} tokens "
                f"{'identical' if same else 'DIFFER'} (control: {'same' if ctl else 'differs'})"
            )
    else:
        print(f"  {sample_sizes(report)} · {report.prompts} prompts · L = {c.horizon}")
        print("  prompt statistic         bins  p (Holm)   TV̂      TV bound")
        for x in report.comparisons:
            bound = f"{x.tv_bound:.3f}" if x.joint else "  –"
            print(
                f"  {x.prompt:>6} {x.name:<18} {x.table.bins:>4}  {x.p_adjusted:<9.3g}  "
                f"{x.tv_hat:.4f}  {bound}"
            )
        print(
            f"  control ({CONTROL_NAME}): min p (Holm) {report.min_p(report.control):.3g} · "
            f"pilot says N ≥ {report.required_samples} detects it"
        )
        if report.coupling is not None:
            print(f"  {coupling_line(report)}")
    detected = "detected" if report.control_detected else "NOT detected"
    print(f"negative control: {detected} · {report.seconds:.1f} s")
    print(f"verdict: {report.verdict}")


def coupling_line(report: Any) -> str:
    """How a coupled sample was drawn, and what the coupling added to the bound."""
    c = report.coupling
    if c.differs is not None:
        prompt, index = c.differs
        return (
            f"coupling: continuation {index} of prompt {prompt} differs between the "
            "one-sequence and batched engines; every continuation was drawn one at a time"
        )
    return (
        f"coupling: {c.redrawn} of the N drawn by both engines, identical; the rest batched "
        f"(+{report.coupling_bound:.4f} in the TV bound)"
    )


def sample_sizes(report: Any) -> str:
    """What the continuations were compared with, and how many there were."""
    n = report.samples
    if report.look is not None:
        n = f"{n} ({report.look}, TV goal {report.config.tv_goal:g})"
    if report.reference == "exact law":
        return (
            f"N = {n} speculative continuations per prompt against the target's exact law "
            f"(control: {report.control_samples})"
        )
    return f"N = {n} per prompt per way (reference: a sample of the target's own sampling)"


def write_report(out: Path, report: Any) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "check.json").write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    (out / "check.md").write_text(report_markdown(report))
    print(f"wrote {out / 'check.json'}, {out / 'check.md'}", file=sys.stderr)


def report_markdown(report: Any) -> str:
    from speculative.hardware import cpu_info

    c = report.config
    lines = [
        "# speculative check",
        "",
        f"**Verdict: {report.verdict}** · negative control "
        f"({CONTROL_NAME}): {'detected' if report.control_detected else 'NOT detected'}",
        "",
        f"- target: {report.target} ({report.runtime}, {report.precision})",
        f"- drafter: {c.drafter} · γ {c.gamma} · mode {c.mode} · {c.sampling_label()}",
        f"- CPU: {cpu_info().summary()} · {report.seconds:.1f} s",
    ]
    if not c.greedy:
        lines += [
            f"- {sample_sizes(report)}, {report.prompts} prompts, "
            f"L = {c.horizon}; {c.method} tests, Holm-corrected; TV bound at "
            f"{100 * (1 - c.alpha):g}% (simultaneous over the joint statistics)",
            *([f"- {coupling_line(report)}"] if report.coupling is not None else []),
            "",
            "| prompt | statistic | bins | p (Holm) | control p (Holm) | TV̂ | TV bound |",
            "|---|---|---|---|---|---|---|",
        ]
        control = {(x.prompt, x.name): x for x in report.control}
        for x in report.comparisons:
            ctl = control.get((x.prompt, x.name))
            name = x.name.replace("|", "\\|")
            lines.append(
                f"| {x.prompt} | {name} | {x.table.bins} | {x.p_adjusted:.3g} | "
                f"{'–' if ctl is None else f'{ctl.p_adjusted:.3g}'} | {x.tv_hat:.4f} | "
                f"{f'{x.tv_bound:.3f}' if x.joint else '–'} |"
            )
    return "\n".join(lines) + "\n"


# ---- the matrix --------------------------------------------------------------------------


def run_matrix_command(args: argparse.Namespace) -> int:
    from dataclasses import replace

    import torch
    from tqdm import tqdm

    from speculative.exactness import CheckConfig
    from speculative.exactness.matrix import (
        DEFAULT_SAMPLINGS,
        GRID_MODES,
        SAMPLINGS,
        default_drafters,
        run_matrix,
        section_markdown,
        tiny_drafters,
    )
    from speculative.exactness.tiny import TINY_PROMPTS
    from speculative.hardware import cpu_info
    from speculative.models.loading import load_tokenizer
    from speculative.targets import encode_prompt

    folder = tiny_folder()
    jobs = args.jobs or every_core()
    coupling = section_coupling(args.matrix_samples, args.coupling)
    base = replace(
        CheckConfig(), gamma=2, samples=args.matrix_samples, seed=args.seed, coupling=coupling,
        tv_goal=args.tv_goal,
    )  # fmt: skip
    plans = [("tiny", tiny_drafters(folder), [list(TINY_PROMPTS[0])], base, SAMPLINGS)]
    if args.default_samples > 0:
        default_base = replace(
            base, samples=args.default_samples, pilot=min(100, base.pilot),
            coupling=section_coupling(args.default_samples, args.coupling), tv_goal=None,
        )  # fmt: skip
        plans.append(("default", default_drafters(), None, default_base, DEFAULT_SAMPLINGS))
    sections, all_cells = [], []
    for name, drafters, prompts, config, samplings in plans:
        cells_total = len(drafters) * len(GRID_MODES) * len(samplings)
        bar = tqdm(total=cells_total, desc=f"matrix {name}", unit="cell", file=sys.stderr,
                   disable=args.no_progress)  # fmt: skip
        get = functools.partial(load_target_on, *_section_model(name, folder))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # steadiest on a shared machine; batches are small here
        if prompts is None:
            prompts = [encode_prompt(load_tokenizer(name), DEFAULT_PROMPTS[0])]

        def advance(cell, bar=bar):
            bar.set_postfix_str(f"{cell.drafter.label} {cell.mode} {cell.sampling}")
            bar.update(1)

        with bar:
            cells = run_matrix(get, drafters, prompts, config, GRID_MODES, samplings, advance, jobs)
        torch.set_num_threads(threads)
        all_cells.append((name, cells))
        exact_law = any(c.report is not None and c.report.reference == "exact law" for c in cells)
        note = _section_note(name, config, exact_law)
        sections.append(section_markdown(_section_title(name), cells, note))
        if args.out is not None:  # each section as soon as it is done
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "exactness.partial.md").write_text("\n".join(sections))
    explicit = "" if args.coupling is None else f"--coupling {args.coupling} "
    explicit += "" if args.tv_goal is None else f"--tv-goal {args.tv_goal:g} "
    command = (
        f"speculative check --matrix --matrix-samples {args.matrix_samples} {explicit}"
        f"--default-samples {args.default_samples} --jobs {jobs} --out DIR"
    )
    text = matrix_markdown(sections, cpu_info().summary(), command, base)
    print(text)
    failed = [c for _, cells in all_cells for c in cells if not c.ok]
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "exactness.md").write_text(text)
        payload = {name: [c.to_dict() for c in cells] for name, cells in all_cells}
        (args.out / "exactness.json").write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.out / 'exactness.md'}, {args.out / 'exactness.json'}", file=sys.stderr)
    if args.json:
        emit_json({name: [c.to_dict() for c in cells] for name, cells in all_cells})
    return EXIT_NOT_EXACT if failed else 0


def load_target_on(spec: str, precision: str, runtime: str) -> Any:
    """``load_target`` with the runtime last, for ``functools.partial`` (module level, so
    that the matrix's worker processes can unpickle it)."""
    from speculative.targets import load_target

    return load_target(spec, runtime, precision)


def _section_model(name: str, folder: Path) -> tuple[str, str]:
    """A matrix section's model and precision: the tiny fixture at fp32, the default model
    at its own precision."""
    return (str(folder), "fp32") if name == "tiny" else (name, "auto")


def default_coupling(samples: int) -> int:
    """--coupling's default M: a tenth of N from N = 10,000 on (then the coupling term,
    about 7.6 / M, is small beside the sample's own margin); none below, where drawing
    one sequence at a time is quick anyway."""
    return samples // 10 if samples >= 10_000 else 0


def section_coupling(samples: int, explicit: int | None) -> int:
    """A matrix section's M: --coupling where given (both sections), else the default for
    the section's own N (the default model's smaller N draws one sequence at a time)."""
    return default_coupling(samples) if explicit is None else explicit


def _section_title(name: str) -> str:
    if name == "tiny":
        return "Tiny test model (seeded random 2-layer Llama, 20-word vocabulary, random heads)"
    return "Default model (SmolLM2-135M-Instruct, its own int4 precision)"


def _section_note(name: str, config: Any, exact_law: bool) -> str:
    what = (
        "Built from a seed by `speculative check --target tiny` (a test fixture). "
        if name == "tiny"
        else "One built-in prompt, chat template; greedy and T = 1 only. "
    )
    if exact_law:
        sizes = (
            "N speculative continuations per prompt, tested against the target's exact law "
            "(enumerated: no reference sample), the control on its pilot of "
            f"{config.pilot} (more only if the pilot missed it)"
        )
        reference = "the target's exact law"
    else:
        sizes = "N per prompt per way as given (reference: the target's own sampling)"
        reference = "plain sampling"
    return (
        f"{what}γ = {config.gamma}, L = {config.horizon} tokens per continuation (greedy: "
        f"{config.greedy_length}), {sizes}; control = every drafted token accepted and the "
        "bonus token drawn from the wrong row. 'min p' is the smallest Holm-adjusted p-value "
        f"of the speculative sample against {reference} (exact cells: large); 'control min "
        "p' the same for the control (must be < 0.001). The TV bound is for the binned joint "
        "distributions of the first 1–3 tokens." + _coupling_note(config) + _looks_note(config)
    )


def _looks_note(config: Any) -> str:
    if len(config.looks) == 1:
        return ""
    first, n = config.looks
    return (
        f" Sampling cells look twice (`--tv-goal {config.tv_goal:g}`): at the first {first:,} "
        f"continuations, where a cell whose bound is already ≤ {config.tv_goal:g} stops, "
        f"then at all {n:,}; each look's tests and bounds are at level δ/2 (Bonferroni), so "
        "the verdict and the bound hold whichever look a cell stopped at."
    )


def _coupling_note(config: Any) -> str:
    if config.coupling == 0:
        return ""
    return (
        f" Chain and tree cells are coupled (`--coupling {config.coupling}`): "
        f"{config.coupling:,} of {_coupled_from(config)}, evenly spread, are drawn both one "
        "sequence at a time and by the batched engine with the same seeds; when every pair "
        "is identical the rest are drawn "
        "batched, and the TV bound (each part at δ/2) adds 1 − (δ/2)^(1/M), the bound on "
        "P(the two engines differ), since TV ≤ P(X ≠ Y) for any coupling. A drafter whose "
        "drafts differ between the two engines (one that learns across generations: "
        "`auto`'s choices, a dynamic tree's calibration) is drawn one sequence at a time."
    )


def _coupled_from(config: Any) -> str:
    return "the first look's continuations" if len(config.looks) > 1 else "the N continuations"


def matrix_markdown(sections: list[str], cpu: str, command: str, config: Any) -> str:
    from speculative.exactness.stats import (
        fit_tv_margin,
        samples_for_fit_tv_bound,
        samples_for_tv_bound,
    )

    joints = 3  # x1, x1..x2, x1..x3 of one prompt: the bound is simultaneous over them
    k, delta = config.max_bins, config.alpha / joints
    one = samples_for_fit_tv_bound(0.02, delta)
    two = samples_for_tv_bound(0.02, delta)
    margin = fit_tv_margin(config.samples, delta)
    head = (
        "# Exactness matrix\n\n"
        f"Generated by `{command}` (do not edit by hand). Each "
        "cell draws continuations from fixed prompts (speculative sampling, and the negative "
        "control: the same engine with every drafted token accepted and the bonus drawn from "
        "the wrong row) and tests them as `speculative check` does "
        "(`speculative check --help` has the method): against the target's exact law where "
        "it can be enumerated (the tiny model), else against a third sample, of the "
        "target's own sampling (the default model).\n\n"
        f"CPU: {cpu}.\n\n"
        "The TV bound (99.9%, simultaneous over the M = "
        f"{joints} joints, K ≤ {k} bins, δ = {config.alpha}): against the exact law it is "
        "TV̂ + sqrt(ln(M/δ) / (2N)), so with TV̂ = 0 a bound of 0.02 needs "
        f"N ≥ {one:,} continuations per prompt (margin {margin:.4f} "
        f"at the tiny model's N = {config.samples:,}); between two samples it is "
        f"TV̂ + sqrt(ln(M/δ) / N), which needs N ≥ {two:,} per prompt per way "
        "for the same 0.02. TV̂ is the binned sample's distance, biased upwards (Jensen), "
        "and one draw moves it by at most 1/N, so McDiarmid's inequality bounds how far it "
        "can fall below its mean, whatever the number of bins. The default model's N "
        "detects every negative control that can run; its bounds are what that N "
        "supports.\n"
    )
    return head + "\n" + "\n".join(sections)
