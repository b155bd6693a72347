"""`provides`: the engine's per-round capability checks give isinstance's answers.

The engine asks runtimes, drafters and γ policies for capability protocols each row and
round, through :func:`speculative.capabilities.provides` (a class-level, cached
``issubclass``) instead of ``isinstance`` (which re-derives the protocol's members on every
call). These tests hold the two to the same answers on the project's real objects, and
show that a protocol the class-level check cannot answer is refused loudly.
"""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from speculative.capabilities import provides
from speculative.drafters import base as drafter_protocols
from speculative.drafters.model import DraftModelDrafter
from speculative.drafters.ngram import PromptLookupDrafter
from speculative.engine import gamma as gamma_protocols
from speculative.engine.gamma import AdaptiveGamma, FixedGamma, HeuristicGamma, LoadAwareGamma
from speculative.models import base as model_protocols
from speculative.models import session as session_protocols
from speculative.models.hf import HFCausalLM
from speculative.models.native import load_native
from speculative.models.session import ModelSession
from test_native import VOCAB, _tiny_llama
from tiny import tiny_llama


def _runtime_protocols() -> list[type]:
    modules = (model_protocols, drafter_protocols, gamma_protocols, session_protocols)
    found = {
        value
        for module in modules
        for value in vars(module).values()
        if isinstance(value, type) and getattr(value, "_is_runtime_protocol", False)
    }
    return sorted(found, key=lambda p: p.__qualname__)


def _methods_only(protocol: type) -> bool:
    members = typing._get_protocol_attrs(protocol)  # type: ignore[attr-defined]
    return all(callable(getattr(protocol, name, None)) for name in members)


PROTOCOLS = _runtime_protocols()


@pytest.fixture(scope="module")
def objects(tmp_path_factory: pytest.TempPathFactory) -> list[object]:
    """Every kind of object the engine asks: runtimes (native kernels, native PyTorch,
    transformers), sessions, drafters and γ policies."""
    folder: Path = tmp_path_factory.mktemp("capabilities")
    _tiny_llama(folder, layers=2)
    native = load_native(folder, backend="auto")
    torch_native = load_native(folder, backend="torch")
    hf = HFCausalLM(tiny_llama(seed=0, vocab=VOCAB))
    return [
        native,
        torch_native,
        hf,
        ModelSession(native),
        PromptLookupDrafter(),
        DraftModelDrafter(torch_native, VOCAB),
        FixedGamma(3),
        HeuristicGamma(),
        AdaptiveGamma(c=0.1),
        LoadAwareGamma({1: 1.0, 2: 1.1}),
        None,
    ]


def test_there_are_protocols_of_both_kinds() -> None:
    """The grid below covers method-only protocols and ones with data members."""
    kinds = {_methods_only(p) for p in PROTOCOLS}
    assert kinds == {True, False}, [p.__qualname__ for p in PROTOCOLS]


@pytest.mark.parametrize("protocol", [p for p in PROTOCOLS if _methods_only(p)], ids=str)
def test_provides_answers_as_isinstance(protocol: type, objects: list[object]) -> None:
    answers = [(type(o).__name__, provides(o, protocol), isinstance(o, protocol)) for o in objects]
    assert all(fast == slow for _, fast, slow in answers), answers


def test_the_grid_sees_yes_and_no_answers(objects: list[object]) -> None:
    """A grid where every answer were False (or True) could not tell the two apart."""
    answers = {provides(o, p) for p in PROTOCOLS if _methods_only(p) for o in objects}
    assert answers == {True, False}


@pytest.mark.parametrize("protocol", [p for p in PROTOCOLS if not _methods_only(p)], ids=str)
def test_protocols_with_data_members_are_refused(protocol: type, objects: list[object]) -> None:
    """A class cannot answer for attributes its instances set: such a check must stay an
    isinstance, and provides says so instead of guessing."""
    with pytest.raises(TypeError):
        provides(objects[0], protocol)


def test_a_method_set_on_the_instance_is_not_seen() -> None:
    """The documented limit (capabilities are class methods): the negative control that
    shows the class-level check is not isinstance in disguise."""

    class Bare:
        pass

    bare = Bare()
    bare.observe_costs = lambda gamma, draft_seconds, verify_seconds: None  # type: ignore[attr-defined]
    assert isinstance(bare, gamma_protocols.SupportsCostFeedback)
    assert not provides(bare, gamma_protocols.SupportsCostFeedback)
