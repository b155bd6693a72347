"""Build a target and a drafter from names, and generate text with them.

This is the library's front door for real models::

    from speculative import Speculator
    spec = Speculator.load(target="default", draft="ngram")
    out = spec.generate("Write a haiku about caches.", max_new_tokens=64)
    print(out.text, out.stats.mean_accepted_length)

``speculative.generate(prompt, ...)`` is the one-call form (it loads the models each time).

Drafter names (``draft=``):
  none          plain autoregressive decoding on the same runtime (the reference)
  ngram         prompt lookup: copy what followed the latest match of the last n-gram
  self-bf16     the target's own weights in bfloat16 (cheaper steps, ~98% greedy agreement)
  self-exit:N   the target's first N layers (+ final norm and head): early exit
  eagle, medusa heads trained on the target's features (shipped, or eagle:DIR / medusa:DIR)
  auto          n-gram lookup or the EAGLE head, chosen per round by tokens per cost
  <path or id>  a separate, smaller causal LM sharing the target's vocabulary
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from speculative.drafters import Drafter
from speculative.drafters.base import ChoosesDraftLength, draft_model_of
from speculative.drafters.tree import TREE_MODES, SupportsTreeShape, TreeDrafter, TreeShape
from speculative.engine import (
    DEFAULT_TREE_BUDGET,
    AdaptiveGamma,
    GammaPolicy,
    GenerationStats,
    HeuristicGamma,
    Round,
    SpeculativeEngine,
    StopCriteria,
    TreeRound,
    budget_from_verify_cost,
)
from speculative.models.base import CausalLM
from speculative.sampling import SamplingParams

DEFAULT_PROMPT = (
    "Explain in a short paragraph why the sky is blue, then list three everyday "
    "examples of light scattering."
)


@dataclass
class LoadedModel:
    """A causal LM plus what is needed to talk to it in text.

    make_variant: builds the same model at another precision ("bf16", "int8", ...), used by
    the ``self-<precision>`` drafters; ``None`` when the runtime cannot.
    """

    lm: CausalLM
    tokenizer: Any
    name: str
    eos_token_ids: frozenset[int] = frozenset()
    runtime: str = "hf"
    precision: str = "fp32"
    make_variant: Callable[[str], CausalLM] | None = None
    backend: str = "torch"  # native runtime: "kernels" (C decoder) or "torch"
    # the stream whose state the model's cache now holds (see GenerationStream.__iter__)
    cache_owner: object | None = field(default=None, repr=False, compare=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (special tokens left out)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def stop_criteria(
        self, max_new_tokens: int, stop: Sequence[str] = (), ignore_eos: bool = False
    ) -> StopCriteria:
        """Stop after ``max_new_tokens``, at the model's end-of-sequence tokens (unless
        ``ignore_eos``) and at the first of the ``stop`` strings."""
        return StopCriteria(
            max_new_tokens=max_new_tokens,
            eos_token_ids=frozenset() if ignore_eos else self.eos_token_ids,
            stop_strings=tuple(stop),
            decode=self.decode if stop else None,
        )


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str | None
    prompt_tokens: int
    rounds: list[Round] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "stats": self.stats.to_dict(),
        }


def eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """End-of-sequence ids from the tokenizer and the model's (generation) config."""
    ids: set[int] = set()
    sources = [getattr(tokenizer, "eos_token_id", None)]
    for config in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        sources.append(getattr(config, "eos_token_id", None))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


RUNTIMES = ("auto", "native", "hf")
HF_PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_target(
    spec: str = "default",
    runtime: str = "auto",
    precision: str = "auto",
    native_backend: str = "auto",
) -> LoadedModel:
    """Load a target model by name, folder, .gguf file or hub id (offline-aware).

    runtime: "native" (this package's Llama-family runtime), "hf" (transformers), or
    "auto" (native when the architecture is supported, else hf).
    precision: "auto" (the model's own: a Q4 GGUF runs int4 as stored, a bfloat16
    checkpoint bf16, anything else fp32); fp32 or bf16 on both runtimes; int8 and int4
    (weight-only) on native. Speculative decoding is exact with respect to the target at
    this precision.
    native_backend: the native runtime's decoder: "kernels" (C), "torch", or "auto"
    (the kernels when they build here).
    """
    from speculative.models.loading import resolve_model, stored_precision

    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    resolved = resolve_model(spec)
    if runtime == "auto":
        runtime = "native" if native_supports(resolved.path) else "hf"
    if precision == "auto":
        precision = stored_precision(resolved)
        if runtime == "hf" and precision not in HF_PRECISIONS:
            precision = "fp32"  # transformers runs the file's values in float32
    if runtime == "native":
        return _load_native_target(resolved, precision, native_backend)
    return _load_hf_target(resolved, precision)


def native_supports(folder: Any) -> bool:
    """Whether the native runtime implements the architecture in ``folder/config.json``."""
    from speculative.models.native.config import SUPPORTED_MODEL_TYPES

    return _read_config(folder).get("model_type") in SUPPORTED_MODEL_TYPES


def _load_hf_target(resolved: Any, precision: str) -> LoadedModel:
    from speculative.models.hf import load_hf_model

    dtype = HF_PRECISIONS.get(precision)
    if dtype is None:
        raise ValueError(
            f"precision {precision!r} needs the native runtime; the hf runtime has "
            f"{', '.join(HF_PRECISIONS)}"
        )
    hf = load_hf_model(resolved, dtype=dtype)
    if hf.tokenizer is None:
        raise ValueError(f"model '{resolved.name}' ships no tokenizer; text generation needs one")
    return hf_loaded(hf, precision)


def hf_loaded(hf: Any, precision: str = "fp32", eos: frozenset[int] | None = None) -> LoadedModel:
    """Wrap an :class:`~speculative.models.hf.HFCausalLM` (its tokenizer attached)."""

    def variant(other: str) -> CausalLM:
        if other not in HF_PRECISIONS:
            raise ValueError(f"the hf runtime has no {other!r} precision")
        return hf.to_dtype(HF_PRECISIONS[other])

    return LoadedModel(
        lm=hf,
        tokenizer=hf.tokenizer,
        name=hf.name,
        eos_token_ids=eos_ids(hf.model, hf.tokenizer) if eos is None else eos,
        runtime="hf",
        precision=precision,
        make_variant=variant,
    )


def _load_native_target(resolved: Any, precision: str, backend: str) -> LoadedModel:
    from speculative.models.loading import load_tokenizer
    from speculative.models.native import PRECISIONS, load_native

    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    tokenizer = load_tokenizer(resolved)
    if tokenizer is None:
        raise ValueError(f"model '{resolved.name}' ships no tokenizer; text generation needs one")

    def variant(other: str) -> CausalLM:
        # int4 runs a GGUF's Q4 weights exactly as stored; other precisions load the
        # converted float folder (much faster to read than the GGUF).
        source = resolved.source_gguf if other == "int4" and resolved.source_gguf else resolved.path
        return load_native(source, precision=other, backend=backend)

    lm = variant(precision)
    config = _read_config(resolved.path)
    ids = eos_ids(None, tokenizer) | _config_eos(config)
    return LoadedModel(
        lm=lm,
        tokenizer=tokenizer,
        name=resolved.name,
        eos_token_ids=ids,
        runtime="native",
        precision=precision,
        make_variant=variant,
        backend=lm.backend,
    )


def _read_config(folder: Any) -> dict[str, Any]:
    import json
    from pathlib import Path

    path = Path(folder) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _config_eos(config: dict[str, Any]) -> frozenset[int]:
    value = config.get("eos_token_id")
    if isinstance(value, int):
        return frozenset({value})
    if isinstance(value, list):
        return frozenset(int(v) for v in value)
    return frozenset()


def build_drafter(spec: str | None, target: LoadedModel) -> Drafter | None:
    """A drafter for ``target`` from its name (see :mod:`speculative.drafters.registry`)."""
    from speculative.drafters.registry import build_drafter as from_registry

    return from_registry(spec, target)


def encode_prompt(
    tokenizer: Any,
    prompt: str | None = None,
    messages: Sequence[dict[str, str]] | None = None,
    chat: bool | None = None,
) -> list[int]:
    """Token ids for a prompt; ``chat`` (default: when the tokenizer has a chat template)
    wraps it as a user message and adds the assistant generation prompt."""
    if messages is None:
        if prompt is None or not prompt.strip():
            raise ValueError("the prompt is empty")
        messages = [{"role": "user", "content": prompt}]
    elif not messages:
        raise ValueError("messages is empty")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    use_chat = has_template if chat is None else chat
    if use_chat and not has_template:
        raise ValueError("--chat needs a tokenizer with a chat template; this one has none")
    if use_chat:
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "\n".join(m["content"] for m in messages)
    return list(tokenizer(text)["input_ids"])


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


def make_tree_round(
    mode: str, drafter: Drafter | None, budget: int = DEFAULT_TREE_BUDGET
) -> TreeRound | None:
    """The tree strategy for ``--tree off|static|dynamic`` (None: chains of γ tokens)."""
    if mode not in TREE_MODES:
        raise ValueError(f"tree must be one of {', '.join(TREE_MODES)}, got {mode!r}")
    if mode == "off" or drafter is None:
        return None
    if not isinstance(drafter, TreeDrafter):
        raise ValueError(f"the '{drafter.name}' drafter cannot draft trees; use tree 'off'")
    if isinstance(drafter, SupportsTreeShape):
        drafter.set_tree_shape(TreeShape(mode))
    return TreeRound(drafter, budget)


class Speculator:
    """A loaded target plus drafter: generate text, streaming or not.

    gamma: drafted tokens per round, "auto" (:class:`AdaptiveGamma`) or "heuristic"
    (:class:`HeuristicGamma`). With "auto" and no
    ``draft_cost`` / ``verify_cost`` given, both are measured on first use (a few seconds):
    the draft cost c and the target's verify-cost curve T(k)/T(1).
    tree: "off" (chains), "static" or "dynamic" token trees of at most ``tree_budget`` nodes
    ("auto": sized from the verify-cost curve, measured on first use like γ "auto").
    """

    def __init__(
        self,
        target: LoadedModel,
        drafter: Drafter | None,
        gamma: int | str = 4,
        draft_cost: float | None = None,
        verify_cost: dict[int, float] | None = None,
        tree: str = "off",
        tree_budget: int | str = DEFAULT_TREE_BUDGET,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.gamma = parse_gamma(gamma)
        self.draft_cost = draft_cost
        self.verify_cost = verify_cost
        if tree_budget != "auto" and (not isinstance(tree_budget, int) or tree_budget < 1):
            raise ValueError(f"tree budget must be an integer >= 1 or 'auto', got {tree_budget!r}")
        self.tree = tree
        self.tree_budget = tree_budget
        make_tree_round(tree, drafter)  # validate now

    @classmethod
    def load(
        cls,
        target: str = "default",
        draft: str | None = "ngram",
        gamma: int | str = 4,
        runtime: str = "auto",
        precision: str = "auto",
        tree: str = "off",
        tree_budget: int | str = DEFAULT_TREE_BUDGET,
    ) -> Speculator:
        if tree not in TREE_MODES:  # before loading anything
            raise ValueError(f"tree must be one of {', '.join(TREE_MODES)}, got {tree!r}")
        loaded = load_target(target, runtime, precision)
        drafter = build_drafter(draft, loaded)
        return cls(loaded, drafter, gamma, tree=tree, tree_budget=tree_budget)

    def calibrate(self, max_k: int = 13, repeats: int = 3) -> None:
        """Measure the draft cost c and the verify-cost curve T(k)/T(1) on this machine."""
        from speculative.engine.costs import drafter_cost, probe_context, verify_cost_curve

        context = probe_context(self.target.lm.vocab_size)
        costs = verify_cost_curve(self.target.lm, context, max_k, repeats)
        self.verify_cost = costs.verify_cost
        if self.drafter is None:
            self.draft_cost = 0.0
            return
        self.draft_cost = drafter_cost(
            self.drafter,
            draft_model_of(self.drafter),
            self.target.lm,
            context,
            costs.step_ms,
            repeats,
        )

    def engine(self) -> SpeculativeEngine:
        if self.gamma == "auto" and (self.draft_cost is None or self.verify_cost is None):
            self.calibrate()
        policy = make_gamma_policy(
            self.gamma, self.draft_cost or 0.0, self.verify_cost, self.drafter
        )
        tree = make_tree_round(self.tree, self.drafter, self.resolved_tree_budget())
        return SpeculativeEngine(self.target.lm, self.drafter, policy, tree)

    def resolved_tree_budget(self) -> int:
        """The tree budget; "auto" measures the verify-cost curve once (calibrate)."""
        if self.tree_budget != "auto":
            return int(self.tree_budget)
        if self.tree == "off":
            return DEFAULT_TREE_BUDGET
        if self.verify_cost is None:
            self.calibrate()
        return budget_from_verify_cost(self.verify_cost or {})

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.target.decode(token_ids)

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[dict[str, str]] | None = None,
        chat: bool | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: Sequence[str] = (),
    ) -> GenerationStream:
        """Start a generation; iterate the result for each round's emitted tokens."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        prompt_ids = encode_prompt(self.target.tokenizer, prompt, messages, chat)
        criteria = self.target.stop_criteria(max_new_tokens, stop)
        generator = torch.Generator().manual_seed(seed)
        stream = GenerationStream(self, self.engine(), prompt_ids, params, criteria, generator)
        self.target.cache_owner = stream
        return stream

    def generate(self, prompt: str | None = None, **kwargs: Any) -> GenerationOutput:
        """Generate to completion; keyword arguments as in :meth:`stream`."""
        stream = self.stream(prompt, **kwargs)
        for _ in stream:
            pass
        return stream.output()


class GenerationStream:
    """One generation in progress: iterate for rounds, then call :meth:`output`."""

    def __init__(
        self,
        speculator: Speculator,
        engine: SpeculativeEngine,
        prompt_ids: list[int],
        params: SamplingParams,
        criteria: StopCriteria,
        generator: torch.Generator,
    ) -> None:
        self.speculator = speculator
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.criteria = criteria
        self.rounds: list[Round] = []
        self.stats = GenerationStats()
        self._rounds = engine.stream(prompt_ids, params, criteria, generator, self.stats)

    def __iter__(self) -> Iterator[Round]:
        """Each round; RuntimeError if a later stream on the same target started since (it
        reset the shared cache and drafter: going on would silently corrupt both)."""
        while True:
            if self.speculator.target.cache_owner is not self:
                raise RuntimeError(
                    "another stream on this target model started after this one and reset "
                    "its cache: finish one stream before starting the next (interleaved "
                    "generations need a model each, or the batched engine)"
                )
            round_ = next(self._rounds, None)
            if round_ is None:
                return
            self.rounds.append(round_)
            yield round_

    @property
    def token_ids(self) -> list[int]:
        return [t for r in self.rounds for t in r.tokens]

    def output(self) -> GenerationOutput:
        tokens = self.token_ids
        return GenerationOutput(
            text=self.criteria.final_text(self.speculator.decode(tokens)),
            token_ids=tokens,
            stats=self.stats,
            finish_reason=self.rounds[-1].reason if self.rounds else None,
            prompt_tokens=len(self.prompt_ids),
            rounds=self.rounds,
        )


def generate(
    prompt: str,
    *,
    target: str = "default",
    draft: str | None = "ngram",
    gamma: int | str = 4,
    runtime: str = "auto",
    tree: str = "off",
    **kwargs: Any,
) -> GenerationOutput:
    """Load ``target`` and ``draft`` and generate once (use :class:`Speculator` to reuse)."""
    return Speculator.load(target, draft, gamma, runtime, tree=tree).generate(prompt, **kwargs)
