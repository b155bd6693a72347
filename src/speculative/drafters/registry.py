"""Drafter names -> drafters: one table, so a new drafter is one file plus one line here.

  none          plain autoregressive decoding on the same runtime (the reference)
  ngram         prompt lookup: copy what followed the longest earlier match of the end
  self-<prec>   the target's own weights at another precision (bf16, int8, int4)
  self-exit:N   the target's first N layers (+ final norm and head): early exit
  eagle         the EAGLE head shipped for the target (eagle:DIR: a trained folder)
  medusa        the Medusa heads shipped for the target (medusa:DIR: a trained folder)
  auto          per round, n-gram lookup or the EAGLE head, by expected tokens per cost
                (auto:DIR: with the head in DIR)
  default       the best drafter at hand: auto where an EAGLE head ships for the target
                (and it gives features), else ngram
  text:<model>  a separate causal LM with a vocabulary of its own, bridged through text
  <path or id>  a separate, smaller causal LM sharing the target's vocabulary

Factories ask capability protocols (SupportsHiddenStates, SupportsEarlyExit), never
concrete model classes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculative.capabilities import provides
from speculative.drafters.base import Drafter
from speculative.models.base import SupportsBatchRows
from speculative.models.precision import PRECISION_TRAITS, cheaper_precisions

if TYPE_CHECKING:
    from speculative.models.base import CausalLM
    from speculative.targets import LoadedModel

Factory = Callable[[str, "LoadedModel"], Drafter | None]


@dataclass(frozen=True)
class Entry:
    """``prefix`` matches a name equal to it or starting with ``prefix:`` (or ``prefix-``
    when ``dash``); ``factory(argument, target)`` builds the drafter."""

    prefix: str
    factory: Factory
    summary: str
    dash: bool = False

    def argument(self, name: str) -> str | None:
        """The text after the prefix (possibly empty), or None when ``name`` is not ours."""
        if name == self.prefix:
            return ""
        separator = "-" if self.dash else ":"
        if name.startswith(self.prefix + separator):
            return name[len(self.prefix) + 1 :]
        return None


def _none(argument: str, target: LoadedModel) -> Drafter | None:
    return None


def _ngram(argument: str, target: LoadedModel) -> Drafter:
    from speculative.drafters.ngram import PromptLookupDrafter

    return PromptLookupDrafter()


def _self_precision(argument: str, target: LoadedModel) -> Drafter:
    from speculative.drafters.model import DraftModelDrafter

    if not argument:
        raise ValueError("self-<precision> needs a precision, e.g. self-int4")
    if target.make_variant is None:
        raise ValueError(f"the runtime of '{target.name}' cannot build a self-{argument} drafter")
    # a self-drafter must read fewer weight bytes per step than the target
    cheaper = cheaper_precisions(target.precision)
    if argument in PRECISION_TRAITS and argument not in cheaper:
        options = "".join(f", self-{p}" for p in cheaper)
        raise ValueError(
            f"self-{argument} cannot speed up this {target.precision} target: a draft step "
            f"would cost as much as a target step or more (drafters that can: ngram, eagle, "
            f"auto, self-exit:N{options})"
        )
    # the same model at another precision: it follows the target's cache (lossless)
    make = target.make_variant
    model = _shared_draft_model(target, ("self", argument), lambda: make(argument))
    return DraftModelDrafter(model, target.lm.vocab_size, f"self-{argument}", follow_target=True)


def _self_exit(argument: str, target: LoadedModel) -> Drafter:
    from speculative.drafters.model import DraftModelDrafter
    from speculative.models.base import SupportsEarlyExit

    lm = target.lm
    if not isinstance(lm, SupportsEarlyExit):
        raise ValueError(f"the runtime of '{target.name}' does not support early exit")
    layers = parse_layers(argument, lm.num_layers)
    name = f"self-exit:{argument}" if argument else "self-exit"
    model = _shared_draft_model(target, ("self-exit", layers), lambda: lm.early_exit(layers))
    return DraftModelDrafter(model, lm.vocab_size, name, follow_target=True)


def _shared_draft_model(
    target: LoadedModel, key: Hashable, build: Callable[[], CausalLM]
) -> CausalLM:
    """The target's draft model ``key``: one for all its drafters where the model has
    cache slots (each drafter holds one, so a batch's rows draft in shared passes), else a
    model of the drafter's own (its single cache is the drafter's)."""
    model = target.shared(key, build)
    if not provides(model, SupportsBatchRows):
        del target.parts[key]  # the drafter's own: the next drafter builds another
    return model


def parse_layers(value: str, total: int) -> int:
    """A self-exit layer count ("" = half the layers), in [1, total)."""
    if not value:
        return max(1, total // 2)
    try:
        layers = int(value)
    except ValueError:
        raise ValueError(
            f"self-exit wants a layer count, e.g. self-exit:12, got 'self-exit:{value}'"
        ) from None
    if layers < 1 or layers >= total:
        raise ValueError(f"self-exit layer count must be in [1, {total}), got {layers}")
    return layers


def load_trained_head(method: str, argument: str, target: LoadedModel) -> Any:
    """The head in folder ``argument``, or the one shipped for ``target`` (loaded once per
    target: its drafters share it)."""
    return target.shared(("head", method, argument), lambda: _read_head(method, argument, target))


def _read_head(method: str, argument: str, target: LoadedModel) -> Any:
    from speculative.heads.store import load_head, require_features, shipped_head_dir

    require_features(target.lm, f"target '{target.name}' on the {target.runtime} runtime")
    folder = Path(argument) if argument else shipped_head_dir(method, target.name)
    if folder is None:
        raise ValueError(
            f"no {method} head ships for '{target.name}'; train one with "
            f"`speculative train-draft --method {method} --target ... --out DIR` and use "
            f"--draft {method}:DIR"
        )
    return load_head(folder, target.lm, method)


def _eagle(argument: str, target: LoadedModel) -> Drafter:
    from speculative.drafters.eagle import EagleDrafter
    from speculative.drafters.head_common import nucleus_search, target_kernels
    from speculative.heads.runners import KernelEagleHead

    head = load_trained_head("eagle", argument, target)
    library = target_kernels(target.lm)
    runner = None
    if library is not None:  # the head's steps on the target's own C kernels, packed once:
        max_length = target.lm.max_length or 4096  # every row's runner has a slot of them
        kernels = target.shared(
            ("eagle kernels", argument),
            lambda: KernelEagleHead(head, library, target.precision, max_length),
        )
        runner = kernels.runner()
    name = "eagle" if not argument else f"eagle:{argument}"
    return EagleDrafter(head, target.lm.vocab_size, name, runner, nucleus_search(target.lm))


def _medusa(argument: str, target: LoadedModel) -> Drafter:
    from speculative.drafters.head_common import target_kernels
    from speculative.drafters.medusa import MedusaDrafter
    from speculative.heads.runners import KernelMedusaRunner

    head = load_trained_head("medusa", argument, target)
    library = target_kernels(target.lm)
    runner = None
    if library is not None:  # stateless: every row's drafter shares it
        runner = target.shared(
            ("medusa kernels", argument),
            lambda: KernelMedusaRunner(head, library, target.precision),
        )
    name = "medusa" if not argument else f"medusa:{argument}"
    return MedusaDrafter(head, target.lm.vocab_size, name, runner)


def _auto(argument: str, target: LoadedModel) -> Drafter:
    from speculative.drafters.auto import AutoDrafter

    return AutoDrafter(_eagle(argument, target), "auto" if not argument else f"auto:{argument}")


def default_drafter_name(target: LoadedModel) -> str:
    """``auto`` (n-gram lookup or the shipped EAGLE head, per round: the fastest on the
    bench and on long prompts) where a head ships for the target and its runtime gives
    features, else ``ngram`` (prompt lookup needs nothing trained)."""
    from speculative.heads.store import shipped_head_dir
    from speculative.models.base import SupportsHiddenStates

    has_head = shipped_head_dir("eagle", target.name) is not None
    return "auto" if has_head and isinstance(target.lm, SupportsHiddenStates) else "ngram"


def _default(argument: str, target: LoadedModel) -> Drafter | None:
    if argument:
        raise ValueError(f"'default' takes no argument, got 'default:{argument}'")
    return build_drafter(default_drafter_name(target), target)


def _text_bridge(argument: str, target: LoadedModel) -> Drafter:
    from speculative.drafters.text_bridge import TextBridgeDrafter
    from speculative.targets import load_target

    if not argument:
        raise ValueError("text:<model> names the draft model, e.g. text:path/to/small-model")
    if target.tokenizer is None:
        raise ValueError(f"'{target.name}' has no tokenizer: a text bridge needs one")
    # one load for all of the target's text-bridged drafters (each holds a cache slot of
    # it where the runtime has slots)
    draft = target.shared(("text", argument), lambda: load_target(argument, "auto"))
    return TextBridgeDrafter(
        draft.lm, draft.tokenizer, target.tokenizer, draft.eos_token_ids, f"text:{draft.name}"
    )


def _draft_model(name: str, target: LoadedModel) -> Drafter:
    from speculative.drafters.model import DraftModelDrafter
    from speculative.models.loading import VocabularyMismatchError, check_vocab_compatible
    from speculative.targets import load_target

    vocab = target.lm.vocab_size
    draft = load_target(name, target.runtime)
    try:
        check_vocab_compatible(
            target.tokenizer, vocab, draft.tokenizer, draft.lm.vocab_size, target.name, draft.name
        )
    except VocabularyMismatchError as error:
        raise VocabularyMismatchError(
            f"{error}; --draft text:{name} drafts with it through text (lossless too)"
        ) from None
    return DraftModelDrafter(draft.lm, vocab, f"draft:{draft.name}")


REGISTRY: tuple[Entry, ...] = (
    Entry("none", _none, "plain decoding (no drafter)"),
    Entry("ngram", _ngram, "prompt lookup (n-gram copy)"),
    Entry("self-exit", _self_exit, "the target's first N layers: self-exit:N"),
    Entry(
        "self",
        _self_precision,
        "the target at a cheaper precision: self-bf16, self-int8, self-int4",
        dash=True,
    ),
    Entry("eagle", _eagle, "EAGLE head (shipped, or eagle:DIR)"),
    Entry("medusa", _medusa, "Medusa heads (shipped, or medusa:DIR)"),
    Entry("auto", _auto, "n-gram or EAGLE head per round (auto:DIR)"),
    Entry("default", _default, "auto where a head ships for the target, else ngram"),
    Entry("text", _text_bridge, "a causal LM of another vocabulary, through text: text:MODEL"),
)


def build_drafter(spec: str | None, target: LoadedModel) -> Drafter | None:
    """The drafter a name stands for (see the module docstring); anything not in the
    table is a draft model's name or path."""
    name = (spec or "none").strip()
    for entry in REGISTRY:
        argument = entry.argument(name)
        if argument is not None:
            return entry.factory(argument, target)
    return _draft_model(name, target)


def drafter_names() -> list[str]:
    return [entry.prefix for entry in REGISTRY]


def drafter_help() -> str:
    """One line per registry entry (for --help), then the draft-model fallback."""
    names = [entry.prefix + ("-<precision>" if entry.dash else "") for entry in REGISTRY]
    width = max(len(n) for n in [*names, "PATH | ID"]) + 2
    lines = [f"  {n:<{width}}{e.summary}" for n, e in zip(names, REGISTRY, strict=True)]
    lines.append(f"  {'PATH | ID':<{width}}a smaller causal LM with the same vocabulary")
    return "\n".join(lines) + "\n"
