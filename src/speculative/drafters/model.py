"""Draft with a separate, cheaper causal LM over the target's vocabulary.

The same class serves every model-based drafter: a smaller model of the same family, the
target itself in lower precision (``self-bf16``), or the target truncated to its first
layers (early exit). Only the :class:`~speculative.models.base.CausalLM` differs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speculative.drafters.base import Draft
from speculative.models.base import CausalLM
from speculative.models.session import ModelSession
from speculative.sampling import SamplingParams, logits_to_probs, sample


def fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """logits: [..., draft_vocab] -> [..., vocab], dropping or -inf-padding extra rows."""
    width = logits.shape[-1]
    if width == vocab:
        return logits
    if width > vocab:
        return logits[..., :vocab]
    pad = logits.new_full((*logits.shape[:-1], vocab - width), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


class DraftModelDrafter:
    """Autoregressive drafting with a draft model whose cache follows the sequence."""

    def __init__(
        self,
        model: CausalLM,
        vocab_size: int,
        name: str = "draft-model",
        share_prefill: bool = False,
    ) -> None:
        """share_prefill: start each generation from the target's prompt cache instead of
        a prefill of our own (only for the target at another precision, whose keys and
        values mean the same; lossless either way, it changes only the drafts)."""
        self.name = name
        self.vocab_size = vocab_size
        self.session = ModelSession(model)
        self.share_prefill = share_prefill

    @property
    def forward_calls(self) -> int:
        return self.session.forward_calls

    def reset(self) -> None:
        self.session.reset()

    def propose(
        self,
        context: Sequence[int],
        gamma: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        sequence = list(context)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(gamma):
            logits = self.session.logits_after(sequence)[:, -1]  # [1, vocab]
            q = logits_to_probs(fit_vocab(logits, self.vocab_size), params)  # [1, vocab]
            token = int(q.argmax()) if params.greedy else int(sample(q, generator)[0])
            tokens.append(token)
            rows.append(q)
            sequence.append(token)
        probs = torch.stack(rows, dim=1) if rows else None  # [1, gamma, vocab]
        return Draft(tokens=tokens, probs=probs)

    def prime(self, target: ModelSession) -> None:
        """Called once the target has prefilled the prompt."""
        if self.share_prefill:
            self.session.adopt(target)

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        """Nothing to do: the next propose() rolls the cache back and catches up."""
