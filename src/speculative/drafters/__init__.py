"""Drafting strategies, one class each, behind the :class:`Drafter` protocol."""

from speculative.drafters.base import Draft, Drafter
from speculative.drafters.model import DraftModelDrafter
from speculative.drafters.ngram import PromptLookupDrafter

__all__ = ["Draft", "DraftModelDrafter", "Drafter", "PromptLookupDrafter"]
