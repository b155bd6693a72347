"""The configurations a benchmark compares: our engine (runtime × drafter × γ schedule) and
the transformers peers (``model.generate`` plain, assisted and prompt-lookup).

Every configuration runs one greedy generation of given prompt ids and reports the new
tokens and the wall time (prefill included), so all of them are measured alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from speculative.capabilities import provides
from speculative.drafters import Drafter
from speculative.drafters.base import LooksUpContext, RunsDraftModel
from speculative.engine import (
    FixedGamma,
    GammaPolicy,
    GenerationStats,
    HeuristicGamma,
    SpeculativeEngine,
    StopCriteria,
)
from speculative.engine.gamma import make_gamma_policy, parse_gamma
from speculative.engine.tree import TreeRound
from speculative.models.base import CausalLM
from speculative.sampling import SamplingParams
from speculative.sampling.constraints import TokenConstraint
from speculative.targets import LoadedModel

PLAIN = "plain"
OURS = "speculative"
TRANSFORMERS = "transformers"
GREEDY = SamplingParams(temperature=0.0)


@dataclass
class RunRecord:
    """One generation: the new tokens, its wall time and (ours only) the engine's stats."""

    tokens: list[int]
    seconds: float
    stats: GenerationStats | None = None


class Method(Protocol):
    """One benchmarked configuration."""

    name: str
    runtime: str
    family: str  # "plain" or the drafter's name: pairs ours with the transformers peer
    gamma: str  # "-" (no drafting), a fixed value, "auto" or "heuristic"
    engine: str  # OURS or TRANSFORMERS

    def run(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        constraint: TokenConstraint | None = None,
    ) -> RunRecord:
        """One generation; ``constraint``: the output's (structured outputs; only our
        engine takes one, the peers are not run on such prompts)."""
        ...


# --------------------------------------------------------------------------- γ schedules

PolicyFactory = Callable[[float, dict[int, float], object], GammaPolicy | int]

SCHEDULES: dict[str, PolicyFactory] = {
    "auto": lambda c, curve, drafter: make_gamma_policy("auto", c, curve, drafter),
    "heuristic": lambda c, curve, drafter: HeuristicGamma(),
}


@dataclass(frozen=True)
class GammaChoice:
    """A γ setting: ``label`` as typed (``4``, ``auto``, ``heuristic``) and how to build it."""

    label: str
    fixed: int | None = None

    def policy(
        self, c: float, curve: dict[int, float], drafter: object = None
    ) -> GammaPolicy | int:
        if self.fixed is not None:
            return FixedGamma(self.fixed)
        return SCHEDULES[self.label](c, curve, drafter)


def parse_gamma_choices(values: Sequence[str]) -> list[GammaChoice]:
    """``["2", "4", "auto", "heuristic"]`` → choices, each parsed by
    :func:`speculative.engine.gamma.parse_gamma` (the one γ parser); ValueError otherwise."""
    choices = []
    for value in dict.fromkeys(v.strip() for v in values):
        parsed = parse_gamma(value)
        fixed = None if isinstance(parsed, str) else parsed
        choices.append(GammaChoice(value, fixed))
    if not choices:
        raise ValueError("give at least one --gamma value")
    return choices


def max_fixed_gamma(choices: Sequence[GammaChoice], default: int = 4) -> int:
    fixed = [c.fixed for c in choices if c.fixed is not None]
    return max(fixed) if fixed else default


# --------------------------------------------------------------------------- our engine


@dataclass
class EngineMethod:
    """Our engine on one runtime with one drafter (None: plain decoding) and γ schedule."""

    name: str
    runtime: str
    family: str
    gamma: str
    target: LoadedModel
    drafter: Drafter | None
    # the method's γ policy, kept across its runs as a Speculator keeps it across
    # generations (an adaptive one's estimates carry over from one prompt to the next)
    policy: GammaPolicy | int
    engine: str = OURS
    params: SamplingParams = GREEDY
    make_tree: Callable[[], TreeRound | None] = lambda: None  # token trees instead of chains

    def run(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        constraint: TokenConstraint | None = None,
    ) -> RunRecord:
        # A fresh engine per run: its target session starts from a reset cache, so runs of
        # different methods sharing one model never see each other's cache.
        engine = SpeculativeEngine(self.target.lm, self.drafter, self.policy, self.make_tree())
        criteria = StopCriteria(max_new_tokens, eos_token_ids=self.target.eos_token_ids)
        generator = torch.Generator().manual_seed(0)
        started = time.perf_counter()
        result = engine.generate(
            list(prompt_ids), self.params, criteria, generator, constraint=constraint
        )
        seconds = time.perf_counter() - started
        return RunRecord(tokens=result.token_ids, seconds=seconds, stats=result.stats)


# --------------------------------------------------------------------------- transformers


def transformers_model(lm: CausalLM) -> Any | None:
    """The transformers ``PreTrainedModel`` behind a CausalLM, if it has one."""
    from transformers import PreTrainedModel

    model = getattr(lm, "model", None)
    return model if isinstance(model, PreTrainedModel) else None


@dataclass
class GeneratePeer:
    """transformers' ``model.generate`` (greedy) with the given extra keyword arguments."""

    name: str
    family: str
    gamma: str
    model: Any  # transformers PreTrainedModel
    eos_token_ids: frozenset[int]
    kwargs: dict[str, Any] = field(default_factory=dict)
    runtime: str = "hf"
    engine: str = TRANSFORMERS

    def run(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        constraint: TokenConstraint | None = None,
    ) -> RunRecord:
        if constraint is not None:
            raise ValueError("transformers' generate() peers take no output constraint")
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)  # [1, n]
        eos = sorted(self.eos_token_ids)
        started = time.perf_counter()
        with torch.inference_mode():
            output = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos or None,
                pad_token_id=eos[0] if eos else None,
                **self.kwargs,
            )  # [1, n + new]
        seconds = time.perf_counter() - started
        new = output[0, input_ids.shape[1] :].tolist()
        return RunRecord(tokens=cut_at_eos(new, self.eos_token_ids), seconds=seconds)


def cut_at_eos(tokens: list[int], eos: frozenset[int]) -> list[int]:
    """Tokens up to and including the first end-of-sequence token."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def peer_for(
    drafter: Drafter | None, family: str, target: LoadedModel, lookup_tokens: int, runtime: str
) -> GeneratePeer | None:
    """transformers' equivalent of a drafter, or None when it has none (or no HF model).

    ``runtime`` names the loaded target whose prompt ids and plain outputs the peer shares.
    """
    model = transformers_model(target.lm)
    if model is None:
        return None
    eos = target.eos_token_ids
    if drafter is None:
        return GeneratePeer("transformers/generate", PLAIN, "-", model, eos, runtime=runtime)
    if provides(drafter, LooksUpContext):
        kwargs = {
            "prompt_lookup_num_tokens": lookup_tokens,
            "max_matching_ngram_size": drafter.longest_ngram(),
        }
        name = f"transformers/prompt-lookup:{lookup_tokens}"
        return GeneratePeer(name, family, str(lookup_tokens), model, eos, kwargs, runtime)
    if isinstance(drafter, RunsDraftModel):
        assistant = transformers_model(drafter.draft_model)
        if assistant is None:
            return None
        kwargs = {"assistant_model": assistant}
        name = f"transformers/assisted:{family}"
        return GeneratePeer(name, family, "hf", model, eos, kwargs, runtime)
    return None
