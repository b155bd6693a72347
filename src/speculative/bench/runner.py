"""Run the benchmark: load, measure costs, then run every configuration on every prompt.

Configurations are interleaved prompt by prompt (for each prompt and repeat, every
configuration runs once), so drift of a shared machine hits all of them alike. Each
configuration is warmed up once before measuring; a prompt's time is the median of its
repeats.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from speculative.bench.llamacpp import ENGINE as LLAMACPP
from speculative.bench.llamacpp import llamacpp_missing, llamacpp_peers
from speculative.bench.methods import (
    OURS,
    PLAIN,
    EngineMethod,
    GammaChoice,
    Method,
    RunRecord,
    max_fixed_gamma,
    peer_for,
)
from speculative.bench.prompts import BenchPrompt
from speculative.drafters import Drafter
from speculative.drafters.base import draft_model_of
from speculative.drafters.registry import build_drafter
from speculative.engine import GenerationStats
from speculative.engine.costs import TargetCosts, drafter_cost, verify_cost_curve
from speculative.sampling import SamplingParams
from speculative.sampling.constraints import TokenConstraint
from speculative.structured import OutputFormat, constraints_for
from speculative.targets import LoadedModel, encode_prompt, load_target

Loader = Callable[..., LoadedModel]  # (target, runtime, precision, kv_cache=)


@dataclass(frozen=True)
class BenchSettings:
    """What to compare, on which model, with which budget."""

    target: str = "default"
    runtimes: tuple[str, ...] = ("hf",)
    precision: str = "fp32"
    kv_cache: str = "auto"  # the native runtime's KV cache (see load_target)
    drafters: tuple[str, ...] = ("ngram", "self-bf16")
    gammas: tuple[GammaChoice, ...] = (
        GammaChoice("2", 2),
        GammaChoice("4", 4),
        GammaChoice("auto"),
        GammaChoice("heuristic"),
    )
    peers: bool = True
    max_new_tokens: int = 128
    repeats: int = 3
    warmup_tokens: int = 16
    cost_repeats: int = 7
    cost_context_tokens: int = 128
    min_curve_k: int = 9  # measure T(k) at least up to here (adaptive γ may go past max γ)
    chat: bool | None = None
    progress: bool = True
    temperature: float = 0.0  # > 0: sampled outputs, not compared with plain decoding
    top_p: float = 1.0
    trees: tuple[str, ...] = ()  # token-tree shapes run besides the chains ("static", ...)


@dataclass
class RuntimeCosts:
    """Measured costs on one runtime: the target's curve and each drafter's c."""

    target: TargetCosts
    draft_cost: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {**self.target.to_dict(), "draft_cost": dict(self.draft_cost)}


@dataclass
class Measurement:
    """One configuration on one prompt: tokens and stats of the first run, all run times."""

    method: str
    prompt_index: int
    category: str
    tokens: list[int]
    seconds: list[float]
    stats: GenerationStats | None
    prefill_seconds: list[float] = field(default_factory=list)  # ours: each run's prefill

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)

    @property
    def median_decode_seconds(self) -> float | None:
        """Median wall time after the prompt's prefill (None: not measured, e.g. peers)."""
        if len(self.prefill_seconds) != len(self.seconds):
            return None
        pairs = zip(self.seconds, self.prefill_seconds, strict=True)
        return statistics.median(s - p for s, p in pairs)


@dataclass
class Mismatch:
    method: str
    prompt_index: int
    category: str
    first_difference: int  # index of the first differing new token
    reference_length: int
    length: int

    def describe(self) -> str:
        return (
            f"OUTPUT MISMATCH: {self.method} on prompt {self.prompt_index} ({self.category}) "
            f"differs from plain decoding at new token {self.first_difference} "
            f"({self.length} vs {self.reference_length} tokens)"
        )


@dataclass
class BenchRun:
    """Everything measured: the configurations, their measurements and the costs."""

    settings: BenchSettings
    model: str
    prompts: list[BenchPrompt]
    methods: list[Method]
    measurements: list[Measurement]
    costs: dict[str, RuntimeCosts]
    mismatches: list[Mismatch]
    prompt_tokens: list[int]
    peer_agreement: dict[str, dict[str, int]] = field(default_factory=dict)  # llama.cpp rows


@dataclass
class RuntimeSetup:
    """A loaded target on one runtime with its drafters."""

    runtime: str
    target: LoadedModel
    drafters: dict[str, Drafter | None]


def kv_cache_of(kv_cache: str) -> dict[str, str]:
    """A loader's ``kv_cache`` argument for a cache type (none for "auto", so loaders
    that take no such argument still serve)."""
    return {} if kv_cache == "auto" else {"kv_cache": kv_cache}


def load_runtimes(settings: BenchSettings, loader: Loader) -> list[RuntimeSetup]:
    setups = []
    for runtime in settings.runtimes:
        target = loader(
            settings.target, runtime, settings.precision, **kv_cache_of(settings.kv_cache)
        )
        drafters: dict[str, Drafter | None] = {PLAIN: None}
        for spec in settings.drafters:
            try:
                drafters[spec] = build_drafter(spec, target)
            except ValueError as exc:  # e.g. self-int4 on the hf runtime
                print(f"bench: {runtime}: skipping drafter {spec}: {exc}", file=sys.stderr)
        if any(s.runtime == target.runtime for s in setups):  # e.g. "auto" and "native"
            continue
        setups.append(RuntimeSetup(target.runtime, target, drafters))  # "auto" resolved
    return setups


def cost_context(target: LoadedModel, prompt: BenchPrompt, settings: BenchSettings) -> list[int]:
    ids = encode_prompt(target.tokenizer, prompt.prompt, prompt.messages, settings.chat)
    return ids[: settings.cost_context_tokens]


def measure_costs(
    setup: RuntimeSetup, context: Sequence[int], settings: BenchSettings
) -> RuntimeCosts:
    max_k = max(max_fixed_gamma(settings.gammas) + 1, settings.min_curve_k)
    target_costs = verify_cost_curve(setup.target.lm, context, max_k, settings.cost_repeats)
    costs = RuntimeCosts(target_costs)
    for name, drafter in setup.drafters.items():
        if drafter is None:
            continue
        costs.draft_cost[name] = drafter_cost(
            drafter,
            draft_model_of(drafter),
            setup.target.lm,
            context,
            target_costs.step_ms,
            settings.cost_repeats,
        )
    return costs


def build_methods(
    setup: RuntimeSetup, costs: RuntimeCosts, settings: BenchSettings, with_peers: bool
) -> list[Method]:
    """Plain decoding, every drafter × γ on this runtime, then the transformers peers."""
    methods: list[Method] = []
    curve = costs.target.verify_cost
    for family, drafter in setup.drafters.items():
        if drafter is None:
            methods.append(
                EngineMethod(
                    f"{setup.runtime}/plain", setup.runtime, PLAIN, "-", setup.target, None,
                    0, params=sampling_params(settings),
                )
            )  # fmt: skip
            continue
        c = costs.draft_cost[family]
        for choice in settings.gammas:
            methods.append(
                EngineMethod(
                    name=f"{setup.runtime}/{family}/γ={choice.label}",
                    runtime=setup.runtime,
                    family=family,
                    gamma=choice.label,
                    target=setup.target,
                    drafter=drafter,
                    policy=choice.policy(c, curve, drafter),
                    params=sampling_params(settings),
                )
            )
        methods += tree_methods(setup, family, drafter, curve, settings)
    if with_peers and settings.temperature == 0:  # the peers run greedy only
        lookup = max_fixed_gamma(settings.gammas)
        for family, drafter in setup.drafters.items():
            peer = peer_for(drafter, family, setup.target, lookup, setup.runtime)
            if peer is not None:
                methods.append(peer)
    return methods


def tree_methods(
    setup: RuntimeSetup,
    family: str,
    drafter: Drafter,
    curve: dict[int, float],
    settings: BenchSettings,
) -> list[Method]:
    """The drafter with token trees of each shape in ``settings.trees`` (none for a drafter
    that drafts chains only); the budget comes from the measured verify-cost curve."""
    from speculative.drafters.tree import TreeDrafter
    from speculative.engine.tree import budget_from_verify_cost, make_tree_round

    if not isinstance(drafter, TreeDrafter):
        return []
    budget = budget_from_verify_cost(curve)
    return [
        EngineMethod(
            name=f"{setup.runtime}/{family}/tree={shape}",
            runtime=setup.runtime,
            family=family,
            gamma=f"tree-{shape}",
            target=setup.target,
            drafter=drafter,
            policy=budget,  # unused: a tree round drafts up to its budget
            params=sampling_params(settings),
            make_tree=lambda shape=shape: make_tree_round(shape, drafter, budget),
        )
        for shape in settings.trees
    ]


def sampling_params(settings: BenchSettings) -> SamplingParams:
    return SamplingParams(temperature=settings.temperature, top_p=settings.top_p)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def llamacpp_methods(settings: BenchSettings, setups: Sequence[RuntimeSetup]) -> list[Method]:
    """llama.cpp's plain and prompt-lookup rows on the target's own GGUF file, when the
    target is one and llama-cpp-python is installed (else none, with the reason)."""
    import torch

    from speculative.models.loading import resolve_model

    gguf = resolve_model(settings.target).source_gguf
    native = [s for s in setups if s.runtime == "native"]
    missing = llamacpp_missing()
    if gguf is None or not native or missing:
        reason = missing or "the target is not a GGUF file on the native runtime"
        print(f"bench: no llama.cpp rows ({reason})", file=sys.stderr)
        return []
    lookup = max_fixed_gamma(settings.gammas)
    eos = native[0].target.eos_token_ids
    return list(llamacpp_peers(gguf, eos, torch.get_num_threads(), lookup, "native"))


def same_text_as_ours(
    methods: Sequence[Method], measurements: Sequence[Measurement], engine: str
) -> dict[str, dict[str, int]]:
    """For each ``engine`` row: on how many prompts its greedy tokens equal our plain
    decoding's (another program may round a near tie the other way)."""
    by_name = {m.name: m for m in methods}
    ours = {
        x.prompt_index: x.tokens
        for x in measurements
        if by_name[x.method].engine == OURS and by_name[x.method].family == PLAIN
        and by_name[x.method].runtime == "native"
    }  # fmt: skip
    counts: dict[str, dict[str, int]] = {}
    for x in measurements:
        if by_name[x.method].engine != engine or x.prompt_index not in ours:
            continue
        entry = counts.setdefault(x.method, {"same": 0, "prompts": 0})
        entry["prompts"] += 1
        entry["same"] += int(x.tokens == ours[x.prompt_index])
    return counts


def check_outputs(methods: Sequence[Method], measurements: Sequence[Measurement]) -> list[Mismatch]:
    """Compare every configuration's tokens with plain decoding on its runtime."""
    by_name = {m.name: m for m in methods}
    reference = {
        (by_name[x.method].runtime, x.prompt_index): x.tokens
        for x in measurements
        if by_name[x.method].family == PLAIN and by_name[x.method].gamma == "-"
        and by_name[x.method].engine == OURS
    }  # fmt: skip
    mismatches = []
    for x in measurements:
        ref = reference.get((by_name[x.method].runtime, x.prompt_index))
        if ref is None or by_name[x.method].engine == LLAMACPP:  # another program's rounding
            continue
        index = first_difference(ref, x.tokens)
        if index is not None:
            mismatches.append(
                Mismatch(x.method, x.prompt_index, x.category, index, len(ref), len(x.tokens))
            )
    return mismatches


Constraints = dict[str, list[Callable[[], TokenConstraint] | None]]  # per runtime, per prompt


def output_constraints(
    setups: Sequence[RuntimeSetup], prompts: Sequence[BenchPrompt]
) -> Constraints:
    """Per runtime, each prompt's fresh-constraint factory (its JSON schema's grammar over
    that runtime's tokenizer), or None for a free-text prompt."""
    out: Constraints = {}
    for setup in setups:
        factories: list[Callable[[], TokenConstraint] | None] = []
        for prompt in prompts:
            if prompt.json_schema is None:
                factories.append(None)
                continue
            output = OutputFormat(json_schema=prompt.json_schema)
            factories.append(constraints_for(setup.target, output))
        out[setup.runtime] = factories
    return out


def _constraint(constraints: Constraints, runtime: str, index: int) -> TokenConstraint | None:
    make = constraints[runtime][index] if constraints else None
    return None if make is None else make()


def measure(
    methods: Sequence[Method],
    prompts: Sequence[BenchPrompt],
    prompt_ids: dict[str, list[list[int]]],
    settings: BenchSettings,
    constraints: Constraints | None = None,
) -> list[Measurement]:
    """Warm every configuration up, then run them interleaved prompt by prompt (each run
    with a fresh constraint where its prompt has a JSON schema)."""
    made = constraints or {}
    for method in methods:
        method.run(
            prompt_ids[method.runtime][0],
            settings.warmup_tokens,
            _constraint(made, method.runtime, 0),
        )
    total = len(prompts) * settings.repeats * len(methods)
    bar = tqdm(
        total=total, desc="bench", unit="run", file=sys.stderr, disable=not settings.progress
    )
    measurements = []
    with bar:
        for index, prompt in enumerate(prompts):
            records: dict[str, list[RunRecord]] = {m.name: [] for m in methods}
            for _ in range(settings.repeats):
                for method in methods:
                    ids = prompt_ids[method.runtime][index]
                    constraint = _constraint(made, method.runtime, index)
                    run = method.run(ids, settings.max_new_tokens, constraint)
                    records[method.name].append(run)
                    bar.update(1)
            for method in methods:
                runs = records[method.name]
                first = runs[0]
                measurements.append(
                    Measurement(
                        method=method.name,
                        prompt_index=index,
                        category=prompt.category,
                        tokens=first.tokens,
                        seconds=[r.seconds for r in runs],
                        stats=first.stats,
                        prefill_seconds=[r.stats.prefill_seconds for r in runs if r.stats],
                    )
                )
    return measurements


def run_bench(
    settings: BenchSettings, prompts: Sequence[BenchPrompt], loader: Loader = load_target
) -> BenchRun:
    """Load the target on every runtime, measure costs, then benchmark every configuration."""
    if not prompts:
        raise ValueError("no prompts to benchmark")
    setups = load_runtimes(settings, loader)
    prompt_ids = {
        s.runtime: [
            encode_prompt(s.target.tokenizer, p.prompt, p.messages, settings.chat) for p in prompts
        ]
        for s in setups
    }
    costs: dict[str, RuntimeCosts] = {}
    methods: list[Method] = []
    structured = any(p.json_schema is not None for p in prompts)
    peers = settings.peers and not structured  # the peers take no output constraint
    peers_done = not peers
    for setup in setups:
        context = cost_context(setup.target, prompts[0], settings)
        costs[setup.runtime] = measure_costs(setup, context, settings)
        ours = build_methods(setup, costs[setup.runtime], settings, with_peers=not peers_done)
        peers_done = peers_done or any(m.engine != OURS for m in ours)
        methods.extend(ours)
    if peers and settings.temperature == 0:
        methods.extend(llamacpp_methods(settings, setups))
    constraints = output_constraints(setups, prompts) if structured else None
    measurements = measure(methods, prompts, prompt_ids, settings, constraints)
    # under sampling the outputs differ by chance: only greedy runs must be identical
    mismatches = check_outputs(methods, measurements) if settings.temperature == 0 else []
    agreement = same_text_as_ours(methods, measurements, LLAMACPP)
    return BenchRun(
        settings=settings,
        model=setups[0].target.name,
        prompts=list(prompts),
        methods=methods,
        measurements=measurements,
        costs=costs,
        mismatches=mismatches,
        prompt_tokens=[len(ids) for ids in prompt_ids[setups[0].runtime]],
        peer_agreement=agreement,
    )
