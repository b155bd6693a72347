"""Toy "language models" from the specification: last-token stochastic matrices.

Row t of a matrix is the next-token distribution when the last token is t. The target
is one such matrix P; the draft is a blurred copy Q = normalize(0.6 P + 0.4 / V). A real
transformer supplies the same rows from a forward pass, so the engine drives these
through the same :class:`~speculative.models.base.CausalLM` protocol.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from speculative.models.base import check_keep_slots


def stochastic_matrix(rng: np.random.Generator, vocab: int, temperature: float) -> np.ndarray:
    """Row-stochastic [vocab, vocab] matrix: softmax of N(0, 1) / temperature per row."""
    e = np.exp(rng.normal(0, 1, (vocab, vocab)) / temperature)
    return e / e.sum(1, keepdims=True)


def blurred(p: np.ndarray, weight: float = 0.6) -> np.ndarray:
    """Draft matrix weight * P + (1 - weight) * uniform, rows renormalized."""
    vocab = p.shape[-1]
    q = weight * p + (1 - weight) * np.ones_like(p) / vocab
    return q / q.sum(-1, keepdims=True)


def seed_matrices(vocab: int = 5, seed: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """The specification's (P, Q): P = stochastic(0.7) from default_rng(seed), Q blurred."""
    rng = np.random.default_rng(seed)
    target = stochastic_matrix(rng, vocab, 0.7)
    return target, blurred(target)


class MarkovLM:
    """A :class:`CausalLM` whose next-token distribution depends only on the last token."""

    def __init__(self, matrix: np.ndarray | torch.Tensor, name: str = "markov") -> None:
        probs = torch.as_tensor(np.asarray(matrix), dtype=torch.float64)
        if probs.dim() != 2 or probs.shape[0] != probs.shape[1]:
            raise ValueError(f"matrix must be square [vocab, vocab], got {tuple(probs.shape)}")
        if (probs < 0).any() or not torch.allclose(
            probs.sum(-1), torch.ones(len(probs), dtype=torch.float64)
        ):
            raise ValueError("matrix rows must be probability distributions")
        self.name = name
        self.log_probs = torch.log(probs).float()  # [vocab, vocab]
        self._length = 0

    @property
    def vocab_size(self) -> int:
        return self.log_probs.shape[0]

    @property
    def max_length(self) -> int | None:
        return None

    @property
    def cache_length(self) -> int:
        return self._length

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [batch, k] -> logits [batch, k, vocab] (log of the matrix rows)."""
        self._length += input_ids.shape[1]
        return self.log_probs[input_ids]

    def forward_tree(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """A token tree: each row depends only on its own token, so the mask is moot."""
        return self.forward(input_ids)

    def keep_slots(self, first: int, slots: Sequence[int]) -> None:
        self._length = first + len(check_keep_slots(first, slots, self._length))

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self._length:
            raise ValueError(f"cannot roll back {n} of {self._length} cached positions")
        self._length -= n

    def reset(self) -> None:
        self._length = 0
