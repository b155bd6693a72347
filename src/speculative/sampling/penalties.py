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
same at every position; and ``min_tokens`` (vLLM's): the ``held`` tokens (end of sequence,
stop tokens) get probability 0 at output positions before ``min_tokens``, so the output
is at least that long.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: tuple[tuple[int, float], ...] = ()  # (token id, offset) pairs
    min_tokens: int = 0  # output positions before this one cannot hold ``held`` tokens
    held: tuple[int, ...] = ()  # the tokens that would end the output (EOS, stop tokens)

    def __post_init__(self) -> None:
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int):
            raise ValueError(f"min_tokens must be an integer, got {self.min_tokens!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.held):
            raise ValueError(f"held tokens must be ids >= 0, got {self.held!r}")
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
        return (
            self.presence != 0
            or self.frequency != 0
            or self.repetition != 1
            or bool(self.bias)
            or self.holds
        )

    @property
    def holds(self) -> bool:
        """Whether some output positions hold tokens back (``min_tokens``)."""
        return self.min_tokens > 0 and bool(self.held)


class PenaltyHistory:
    """A sequence's ``penalties`` and what they read: its prompt's distinct tokens and its
    output's token counts, kept as the output grows, so that a round costs what its new
    tokens and the distinct tokens cost, not the output's length."""

    def __init__(self, prompt: Sequence[int], penalties: Penalties) -> None:
        self.penalties = penalties
        self.prompt_ids = np.unique(np.asarray(prompt, dtype=np.int64))  # [P] sorted
        self.counts: dict[int, int] = {}  # output token -> occurrences
        self.length = 0  # output tokens so far
        self._ids: np.ndarray | None = None  # [m] sorted: prompt tokens and counted ones
        self._base: np.ndarray | None = None  # [m] their output counts

    def extend(self, tokens: Sequence[int]) -> None:
        """The output grew by ``tokens``."""
        self.length += len(tokens)
        for token in tokens:
            known = token in self.counts
            self.counts[token] = self.counts.get(token, 0) + 1
            if self._ids is None or self._base is None:
                continue
            at = int(np.searchsorted(self._ids, token))
            if known or (at < self._ids.size and self._ids[at] == token):
                self._base[at] += 1  # a column already there (an output or prompt token)
            else:
                self._ids = self._base = None  # a new column: rebuilt when next asked

    def _columns(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids [m], their output counts [m])."""
        if self._ids is None or self._base is None:
            counted = np.fromiter(self.counts, dtype=np.int64, count=len(self.counts))
            self._ids = np.union1d(self.prompt_ids, counted)
            self._base = np.zeros(self._ids.size, dtype=np.int64)
            values = np.fromiter(self.counts.values(), dtype=np.int64, count=len(self.counts))
            self._base[np.searchsorted(self._ids, counted)] = values
        return self._ids, self._base

    def apply(
        self,
        logits: torch.Tensor,  # [n, vocab] the rows to penalize
        extras: Sequence[Sequence[int]],  # [n] tokens after the output in row i's history
    ) -> torch.Tensor:  # [n, vocab] float32, a new tensor
        """Row i penalized as the next token after prompt + output + extras[i]. Only the
        columns of tokens the histories hold are touched (gathered, changed, put back)."""
        penalties = self.penalties
        out = logits.float().clone()
        if penalties.bias:
            vocab = out.shape[-1]
            if any(token >= vocab for token, _ in penalties.bias):
                raise ValueError(f"logit bias names a token outside the vocabulary of {vocab}")
            tokens = torch.tensor([token for token, _ in penalties.bias], dtype=torch.long)
            out[:, tokens] += torch.tensor([offset for _, offset in penalties.bias])
        if penalties.holds:
            early = [
                i
                for i, extra in enumerate(extras)
                if self.length + len(extra) < penalties.min_tokens
            ]
            if early:
                held = torch.tensor(penalties.held, dtype=torch.long)
                out[torch.tensor(early)[:, None], held[None, :]] = -math.inf
        if penalties.repetition == 1 and penalties.frequency == 0 and penalties.presence == 0:
            return out
        known, base = self._columns()
        extra_ids = [np.asarray(extra, dtype=np.int64) for extra in extras]
        ids = np.union1d(known, np.concatenate(extra_ids)) if extra_ids else known  # [m]
        if ids.size == 0:
            return out
        m = ids.size
        aligned = np.zeros(m, dtype=np.int64)  # [m] the output's counts
        aligned[np.searchsorted(ids, known)] = base
        counts = np.stack(  # [n, m] output counts of each row's history
            [aligned + np.bincount(np.searchsorted(ids, extra), minlength=m) for extra in extra_ids]
        ).astype(np.float32)
        index = torch.from_numpy(ids)
        columns = out[:, index].numpy()  # [n, m] float32, a copy
        if penalties.repetition != 1:
            in_prompt = np.zeros(m, dtype=bool)  # [m]
            in_prompt[np.searchsorted(ids, self.prompt_ids)] = True  # (all are in ids)
            seen = in_prompt | (counts > 0)  # [n, m]
            r = np.float32(penalties.repetition)
            columns = np.where(seen, np.where(columns > 0, columns / r, columns * r), columns)
        if penalties.frequency or penalties.presence:
            f, p = np.float32(penalties.frequency), np.float32(penalties.presence)
            columns = columns - (f * counts + p * (counts > 0).astype(np.float32))
        out[:, index] = torch.from_numpy(np.ascontiguousarray(columns, dtype=np.float32))
        return out


def apply_penalties(
    logits: torch.Tensor,  # [n, vocab] the rows to penalize
    prompt: Sequence[int],
    output: Sequence[int],
    extras: Sequence[Sequence[int]],  # [n] tokens after ``output`` in row i's history
    penalties: Penalties,
) -> torch.Tensor:  # [n, vocab] float32, a new tensor
    """Row i penalized as the next token after prompt + output + extras[i]
    (:meth:`PenaltyHistory.apply` over a history built here)."""
    history = PenaltyHistory(prompt, penalties)
    history.extend(output)
    return history.apply(logits, extras)
