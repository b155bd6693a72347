"""Drafts from a predicted output: a text the reply is expected to resemble (OpenAI's
Predicted Outputs: a file the model is asked to edit, a document to be revised).

The reply starts where the prediction starts. After that, each round drafts what follows
the reply's end in the prediction: the longest match of the reply's last tokens in it
(up to ``max_ngram`` compared, at least ``min_match``), the one nearest where the last
draft from the prediction ended among equally long ones, so a reply that edits the
prediction in a few places drafts from it again right after each edit. Where the reply
matches nothing in the prediction (new text), n-gram lookup in the prompt and the reply
drafts instead. Drafts are point masses, so speculation stays exact whatever the
prediction says: a wrong prediction only costs rejected drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speculative.drafters.base import Draft
from speculative.drafters.ngram import PromptLookupDrafter
from speculative.sampling import SamplingParams


class PredictionDrafter:
    """Point-mass drafts from ``prediction`` (token ids) for a reply to a prompt of
    ``prompt_length`` tokens; n-gram lookup in the context where the reply has left it."""

    def __init__(
        self,
        prediction: Sequence[int],
        prompt_length: int,
        max_ngram: int = 16,
        min_match: int = 2,
    ) -> None:
        if max_ngram < min_match or min_match < 1:
            raise ValueError(f"need 1 <= min_match <= max_ngram, got {min_match}, {max_ngram}")
        self.name = "prediction"
        self.prediction = [int(t) for t in prediction]
        self.prompt_length = prompt_length
        self.max_ngram = max_ngram
        self.min_match = min_match
        self.positions: dict[int, list[int]] = {}  # token -> its positions in the prediction
        for i, token in enumerate(self.prediction):
            self.positions.setdefault(token, []).append(i)
        self.lookup = PromptLookupDrafter()
        self.reset()

    @property
    def forward_calls(self) -> int:
        return 0

    def reset(self) -> None:
        self.lookup.reset()
        self.expected = 0  # where the reply's end should lie in the prediction
        self.last_drafted = 0  # tokens of the last draft that came from the prediction
        self.accepted = 0  # drafted from the prediction and accepted, this generation
        self.rejected = 0  # drafted from the prediction and rejected

    def propose(
        self,
        context: Sequence[int],
        gamma: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        self.last_drafted = 0
        if gamma < 1:
            return Draft(tokens=[])
        at = self.aligned(context[self.prompt_length :])
        if at is None or at >= len(self.prediction):
            return self.lookup.propose(context, gamma, params, generator)
        tokens = self.prediction[at : at + gamma]
        self.last_drafted = len(tokens)
        self.expected = at + len(tokens)
        return Draft(tokens=tokens)

    def aligned(self, reply: Sequence[int]) -> int | None:
        """Where the reply's continuation starts in the prediction: 0 for an empty reply,
        else just after the longest (then nearest to where it was expected) match of the
        reply's end; None where fewer than ``min_match`` tokens match (or the whole reply,
        if shorter)."""
        if not reply:
            return 0
        need = min(self.min_match, len(reply))
        best, best_length = None, 0
        for end in self.positions.get(int(reply[-1]), ()):
            length = 1
            while (
                length < self.max_ngram
                and length < len(reply)
                and end - length >= 0
                and self.prediction[end - length] == reply[-1 - length]
            ):
                length += 1
            closer = best is not None and abs(end + 1 - self.expected) < abs(best - self.expected)
            if length > best_length or (length == best_length and closer):
                best, best_length = end + 1, length
        return best if best_length >= need else None

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        if self.last_drafted:
            self.accepted += num_accepted
            self.rejected += self.last_drafted - num_accepted
            # the reply ends after the accepted tokens and one of the target's own
            self.expected += num_accepted - self.last_drafted + 1
        self.last_drafted = 0
