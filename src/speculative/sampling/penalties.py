"""Repetition, frequency and presence penalties: the target's logits adjusted by what the
sequence already holds, before temperature, top-k and top-p.

With penalties the target distribution at a position depends on the tokens before it, so
verification penalizes each scored row by its own history: row i of a chain round by the
committed sequence plus the first i drafted tokens, a tree node's row by its path. The
drafts keep their own q (any q is exact); verification compares them against the
penalized target, so the output is distributed exactly as plain decoding with the same
penalties. As vLLM applies them:
  - ``repetition`` r (prompt and output tokens): a seen token's logit l becomes l / r
    where l > 0, else l * r (r = 1: off);
  - ``frequency`` f and ``presence`` p (output tokens only): l - f * count - p * [count > 0];
and, before them, ``bias`` (OpenAI's ``logit_bias``): a fixed offset per token id, the
same at every position.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: tuple[tuple[int, float], ...] = ()  # (token id, offset) pairs

    def __post_init__(self) -> None:
        if len({token for token, _ in self.bias}) != len(self.bias):
            raise ValueError("a token is biased twice")
        for token, offset in self.bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"a biased token must be an id >= 0, got {token!r}")
            if not isinstance(offset, int | float) or not math.isfinite(offset):
                raise ValueError(f"the bias of token {token} must be finite, got {offset!r}")
        for name in ("presence", "frequency"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} penalty must be a finite number, got {value!r}")
        if (
            not isinstance(self.repetition, int | float)
            or not math.isfinite(self.repetition)
            or self.repetition <= 0
        ):
            raise ValueError(f"repetition penalty must be > 0, got {self.repetition!r}")

    @property
    def active(self) -> bool:
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1 or bool(self.bias)


def apply_penalties(
    logits: torch.Tensor,  # [n, vocab] the rows to penalize
    prompt: Sequence[int],
    output: Sequence[int],
    extras: Sequence[Sequence[int]],  # [n] tokens after ``output`` in row i's history
    penalties: Penalties,
) -> torch.Tensor:  # [n, vocab] float32, a new tensor
    """Row i penalized as the next token after prompt + output + extras[i]."""
    out = logits.float().clone()
    if penalties.bias:
        vocab = out.shape[-1]
        if any(token >= vocab for token, _ in penalties.bias):
            raise ValueError(f"logit bias names a token outside the vocabulary of {vocab}")
        tokens = torch.tensor([token for token, _ in penalties.bias], dtype=torch.long)
        out[:, tokens] += torch.tensor([offset for _, offset in penalties.bias])
    counts = Counter(output)
    prompt_tokens = set(prompt)
    for i, extra in enumerate(extras):
        row_counts = counts + Counter(extra) if extra else counts
        _penalize_row(out[i], prompt_tokens, row_counts, penalties)
    return out


def _penalize_row(
    row: torch.Tensor,  # [vocab], changed in place
    prompt_tokens: set[int],
    counts: Counter[int],
    penalties: Penalties,
) -> None:
    if penalties.repetition != 1:
        seen = torch.tensor(sorted(prompt_tokens | set(counts)), dtype=torch.long)
        if seen.numel():
            values = row[seen]
            row[seen] = torch.where(
                values > 0, values / penalties.repetition, values * penalties.repetition
            )
    if (penalties.frequency or penalties.presence) and counts:
        tokens = torch.tensor(list(counts), dtype=torch.long)
        number = torch.tensor([counts[t] for t in counts], dtype=torch.float32)
        row[tokens] -= penalties.frequency * number + penalties.presence
