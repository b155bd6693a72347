"""The facade: a target and a drafter from their names, and text generated with them.

This is the library's front door for real models (the parts behind it: targets in
:mod:`speculative.targets`, drafters by name in :mod:`speculative.drafters.registry`, γ and
tree settings in :mod:`speculative.engine`)::

    from speculative import Speculator
    spec = Speculator.load(target="default")  # draft="default": auto, or ngram
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
  default       auto where an EAGLE head ships for the target, else ngram (the default)
  <path or id>  a separate, smaller causal LM sharing the target's vocabulary
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from speculative.drafters import Drafter
from speculative.drafters.base import draft_model_of
from speculative.drafters.registry import build_drafter
from speculative.drafters.tree import TREE_MODES
from speculative.engine import (
    DEFAULT_TREE_BUDGET,
    GenerationStats,
    Round,
    SpeculativeEngine,
    StopCriteria,
    budget_from_verify_cost,
)
from speculative.engine.gamma import GammaPolicy, make_gamma_policy, parse_gamma
from speculative.engine.round import TokenLogprobs, rounds_logprobs
from speculative.engine.tree import make_tree_round
from speculative.sampling import SamplingParams
from speculative.sampling.constraints import TokenConstraint
from speculative.sampling.penalties import Penalties
from speculative.targets import LoadedModel, encode_infill, encode_prompt, load_target

DEFAULT_PROMPT = (
    "Explain in a short paragraph why the sky is blue, then list three everyday "
    "examples of light scattering."
)


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str | None
    prompt_tokens: int
    rounds: list[Round] = field(default_factory=list)

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        """Each token's log-probability under the target (and the alternatives asked
        for), where the generation asked for them (``logprobs=``); else None."""
        return rounds_logprobs(self.rounds)

    @property
    def prompt_logprobs(self) -> list[TokenLogprobs] | None:
        """Each prompt token's log-probability after the tokens before it, from the
        second token on, where the generation asked for them (``prompt_logprobs=``)."""
        first = self.rounds[0].prompt_logprobs if self.rounds else None
        return None if first is None else list(first)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "stats": self.stats.to_dict(),
        }
        if self.logprobs is not None:
            out["logprobs"] = [entry.to_dict() for entry in self.logprobs]
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = [entry.to_dict() for entry in self.prompt_logprobs]
        return out


class Speculator:
    """A loaded target plus drafter: generate text, streaming or not.

    gamma: drafted tokens per round, "auto" (:class:`AdaptiveGamma`) or "heuristic"
    (:class:`HeuristicGamma`). With "auto" and no
    ``draft_cost`` / ``verify_cost`` given, both are measured on first use (a few seconds):
    the draft cost c and the target's verify-cost curve T(k)/T(1). The γ policy is kept
    from one generation to the next while those stay the same: "auto" goes on from the
    acceptance, drafting overhead and round timings it has learnt (running estimates, so a
    new text moves them within a few rounds) instead of starting from its priors again.
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
        self._kept_policy: tuple[Hashable, GammaPolicy | int] | None = None
        self._kept_engine: tuple[Hashable, SpeculativeEngine] | None = None

    @classmethod
    def load(
        cls,
        target: str = "default",
        draft: str | None = "default",
        gamma: int | str = 4,
        runtime: str = "auto",
        precision: str = "auto",
        tree: str = "off",
        tree_budget: int | str = DEFAULT_TREE_BUDGET,
        kv_cache: str = "auto",
        max_context: int | None = None,
    ) -> Speculator:
        if tree not in TREE_MODES:  # before loading anything
            raise ValueError(f"tree must be one of {', '.join(TREE_MODES)}, got {tree!r}")
        loaded = load_target(target, runtime, precision, kv_cache=kv_cache, max_context=max_context)
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
        """The engine of the next generation: the last one's while its γ policy, drafter
        and tree settings are unchanged, so that its cache, which still holds the last
        prompt and output, serves the next prompt's common prefix (a conversation's
        earlier turns, a shared system prompt) without computing it again."""
        if self.gamma == "auto" and (self.draft_cost is None or self.verify_cost is None):
            self.calibrate()
        policy, budget = self.gamma_policy(), self.resolved_tree_budget()
        inputs = (id(policy), self.drafter, self.tree, budget)
        if self._kept_engine is None or self._kept_engine[0] != inputs:
            tree = make_tree_round(self.tree, self.drafter, budget)
            engine = SpeculativeEngine(self.target.lm, self.drafter, policy, tree)
            self._kept_engine = (inputs, engine)
        return self._kept_engine[1]

    def forget_cache(self) -> None:
        """Start the next generation on an empty cache: after a generation interrupted
        inside a round (Ctrl-C during a pass), the cache may hold tokens its bookkeeping
        does not know of. (Stopping between rounds, by leaving the loop over a stream, is
        safe without this.)"""
        self._kept_engine = None

    def gamma_policy(self) -> GammaPolicy | int:
        """The γ policy of the next generation: the last one's while γ, c and the curve
        are unchanged (a new calibration builds a new one)."""
        curve = None if self.verify_cost is None else tuple(sorted(self.verify_cost.items()))
        inputs = (self.gamma, self.draft_cost, curve)
        if self._kept_policy is None or self._kept_policy[0] != inputs:
            policy = make_gamma_policy(
                self.gamma, self.draft_cost or 0.0, self.verify_cost, self.drafter
            )
            self._kept_policy = (inputs, policy)
        return self._kept_policy[1]

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
        min_p: float = 0.0,
        seed: int = 0,
        stop: Sequence[str] = (),
        logprobs: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        prompt_logprobs: int | None = None,
        json_schema: dict[str, Any] | str | None = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        grammar: str | None = None,
        suffix: str | None = None,
        min_tokens: int = 0,
        prediction: str | Sequence[int] | None = None,
    ) -> GenerationStream:
        """Start a generation; iterate the result for each round's emitted tokens.
        ``suffix``: fill in the middle, between ``prompt`` and ``suffix`` (a raw prompt,
        through the model's fill-in-the-middle tokens: ``targets.encode_infill``;
        ValueError for a model without them or with chat).
        ``logprobs``: each token's log-probability under the target's raw distribution
        and this many alternatives' (``GenerationOutput.logprobs``); None: none.
        ``prompt_logprobs``: the same for the prompt's tokens after the first
        (``GenerationOutput.prompt_logprobs``); with ``max_new_tokens=0`` the prompt is
        only scored. ``json_schema``: the output is JSON that satisfies it (a schema dict
        or its JSON text; ``structured.ANY_OBJECT`` for any object): the target is
        restricted to tokens that keep it so, and speculation is exact with respect to that
        restricted target (ValueError for a schema that cannot be compiled); ``regex``
        (a full match), ``choice`` (one of these strings) and ``grammar`` (a Lark
        grammar's sentence) in its place, at most one of the four.
        The penalties adjust the target's logits by what the sequence holds
        (:mod:`speculative.sampling.penalties`; exact under speculation); ``min_tokens``
        holds end-of-sequence back until the output has that many tokens, and a ``stop``
        string inside them does not count (vLLM's). ``prediction``: text (or token ids)
        the output is expected to resemble (a file being edited): drafted from in place
        of the drafter, γ as ``gamma`` says (a policy at no draft cost), n-gram lookup
        where the output leaves it (:class:`~speculative.drafters.prediction.
        PredictionDrafter`; exact whatever it says)."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        prompt_ids = self._prompt_ids(prompt, messages, chat, suffix)
        criteria = self.target.stop_criteria(max_new_tokens, stop, min_tokens=min_tokens)
        held = tuple(sorted(criteria.eos_token_ids)) if min_tokens else ()
        penalties = Penalties(
            presence_penalty, frequency_penalty, repetition_penalty, (), min_tokens, held
        )
        generator = torch.Generator().manual_seed(seed)
        constraint = None
        from speculative.structured import OutputFormat, constraints_for

        output = OutputFormat.given(json_schema, regex, choice, grammar)
        if output is not None:
            constraint = constraints_for(self.target, output)()
        engine = self.engine() if prediction is None else self._predicted(prediction, prompt_ids)
        stream = GenerationStream(
            self, engine, prompt_ids, params, criteria, generator, logprobs, penalties,
            prompt_logprobs, constraint,
        )  # fmt: skip
        self.target.cache_owner = stream
        return stream

    def _predicted(
        self, prediction: str | Sequence[int], prompt_ids: list[int]
    ) -> SpeculativeEngine:
        """An engine whose drafts come from ``prediction`` (a chain at a fixed γ)."""
        from speculative.drafters.prediction import PredictionDrafter

        tokens = prediction
        if isinstance(prediction, str):
            tokens = self.target.tokenizer(prediction, add_special_tokens=False)["input_ids"]
        drafter = PredictionDrafter(tokens, len(prompt_ids))
        if self.gamma == "auto" and self.verify_cost is None:
            self.calibrate()
        # a lookup's drafts cost nothing: the policy weighs only their verification
        policy = make_gamma_policy(self.gamma, 0.0, self.verify_cost, drafter)
        return SpeculativeEngine(self.target.lm, drafter, policy)

    def _prompt_ids(
        self,
        prompt: str | None,
        messages: Sequence[dict[str, str]] | None,
        chat: bool | None,
        suffix: str | None,
    ) -> list[int]:
        tokenizer = self.target.tokenizer
        if not suffix:
            return encode_prompt(tokenizer, prompt, messages, chat)
        if messages is not None or chat:
            raise ValueError("a suffix fills in after a raw prompt: no chat messages or template")
        if prompt is None or not prompt.strip():
            raise ValueError("the prompt is empty")
        return encode_infill(tokenizer, prompt, suffix)

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
        logprobs: int | None = None,
        penalties: Penalties | None = None,
        prompt_logprobs: int | None = None,
        constraint: TokenConstraint | None = None,
    ) -> None:
        self.speculator = speculator
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.criteria = criteria
        self.rounds: list[Round] = []
        self.stats = GenerationStats()
        self._rounds = engine.stream(
            prompt_ids,
            params,
            criteria,
            generator,
            self.stats,
            logprobs,
            penalties,
            prompt_logprobs,
            constraint,
        )

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
            text=self.criteria.final_text(self.speculator.decode(tokens), tokens),
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
    draft: str | None = "default",
    gamma: int | str = 4,
    runtime: str = "auto",
    tree: str = "off",
    **kwargs: Any,
) -> GenerationOutput:
    """Load ``target`` and ``draft`` and generate once (use :class:`Speculator` to reuse)."""
    return Speculator.load(target, draft, gamma, runtime, tree=tree).generate(prompt, **kwargs)
