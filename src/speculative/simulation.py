"""Vectorized reproductions of the specification's experiments.

- :func:`single_step_experiment`: many draws of the single-position primitive (accept
  rate vs Σ min(p, q), empirical vs target distribution).
- :func:`round_length_experiment`: tokens per round under i.i.d. acceptance vs formula.
- :func:`markov_experiment`: the sequence-level Markov-chain experiment, target-only vs
  speculative, run for all sequences at once with the batched block verifier.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from speculative.models.markov import seed_matrices
from speculative.sampling import sample, verify
from speculative.theory import acceptance_rate, expected_tokens, tv_distance

Progress = Callable[[int], None]

SEED_P = np.array([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
SEED_Q = np.array([0.10, 0.10, 0.30, 0.30, 0.15, 0.05])

BlockVerifier = Callable[..., object]


@dataclass(frozen=True)
class SingleStepReport:
    draws: int
    target: list[float]
    empirical: list[float]
    max_error: float
    standard_error: float
    accept_rate: float
    overlap: float
    one_minus_tv: float


def single_step_experiment(
    p: np.ndarray = SEED_P,
    q: np.ndarray = SEED_Q,
    draws: int = 2_000_000,
    seed: int = 0,
    verifier: BlockVerifier = verify,
) -> SingleStepReport:
    """Draw ``draws`` tokens with the primitive (vectorized as a batch of γ = 1 blocks)."""
    generator = torch.Generator().manual_seed(seed)
    p_t = torch.as_tensor(p, dtype=torch.float32)
    q_t = torch.as_tensor(q, dtype=torch.float32)
    counts = np.zeros(len(p))
    accepts = 0
    chunk = 250_000
    for start in range(0, draws, chunk):
        n = min(chunk, draws - start)
        drafted = sample(q_t.expand(n, -1), generator).unsqueeze(-1)  # [n, 1]
        target_probs = p_t.expand(n, 2, -1)  # [n, 2, vocab]
        result = verifier(drafted, q_t.expand(n, 1, -1), target_probs, generator, validate=False)
        accepts += int(result.num_accepted.sum())
        counts += np.bincount(result.tokens[:, 0].numpy(), minlength=len(p))
    emp = counts / draws
    return SingleStepReport(
        draws=draws,
        target=[float(x) for x in p],
        empirical=emp.tolist(),
        max_error=float(np.max(np.abs(emp - p))),
        standard_error=float(np.sqrt(np.max(p * (1 - p)) / draws)),
        accept_rate=accepts / draws,
        overlap=acceptance_rate(p, q),
        one_minus_tv=1 - tv_distance(p, q),
    )


@dataclass(frozen=True)
class RoundLengthRow:
    alpha: float
    gamma: int
    formula: float
    simulated: float


def round_length_experiment(
    alphas: tuple[float, ...] = (0.5, 0.7, 0.9),
    gammas: tuple[int, ...] = (1, 4, 8),
    trials: int = 300_000,
    seed: int = 1,
) -> list[RoundLengthRow]:
    """Tokens per round with i.i.d. acceptance: simulation against (1−α^{γ+1})/(1−α)."""
    rng = np.random.default_rng(seed)
    rows = []
    for alpha in alphas:
        for gamma in gammas:
            accepted = rng.random((trials, gamma)) < alpha
            run = np.cumprod(accepted, axis=1).sum(axis=1)  # accepted before first failure
            rows.append(
                RoundLengthRow(alpha, gamma, expected_tokens(alpha, gamma), float(np.mean(run + 1)))
            )
    return rows


@dataclass(frozen=True)
class MarkovReport:
    vocab: int
    length: int
    gamma: int
    sequences: int
    target_freq: list[float]
    speculative_freq: list[float]
    max_abs_diff: float
    standard_error: float
    tokens_per_target_call: float
    target_calls_saved: float
    mean_acceptance: float


def target_only_sequences(
    p: torch.Tensor, sequences: int, length: int, start: int, generator: torch.Generator
) -> torch.Tensor:
    """p: [vocab, vocab] -> [sequences, length] token ids sampled from the chain."""
    out = torch.empty(sequences, length, dtype=torch.long)
    last = torch.full((sequences,), start, dtype=torch.long)
    for t in range(length):
        last = sample(p[last], generator)
        out[:, t] = last
    return out


def speculative_sequences(
    p: torch.Tensor,
    q: torch.Tensor,
    sequences: int,
    length: int,
    gamma: int,
    start: int,
    generator: torch.Generator,
    verifier: BlockVerifier = verify,
    progress: Progress | None = None,
) -> tuple[torch.Tensor, int]:
    """Speculative generation of all sequences at once.

    p, q: [vocab, vocab] target and draft matrices. Returns ([sequences, length] tokens,
    total target calls). Every unfinished sequence costs one target call per round.
    ``verifier`` is the block verifier (replaceable to test broken samplers).
    """
    out = torch.full((sequences, length + gamma + 1), -1, dtype=torch.long)
    filled = torch.zeros(sequences, dtype=torch.long)  # tokens written per sequence
    last = torch.full((sequences,), start, dtype=torch.long)
    calls = 0
    rows = torch.arange(sequences)
    while True:
        active = rows[filled < length]
        if len(active) == 0:
            return out[:, :length], calls
        calls += len(active)
        ctx = last[active]
        drafted, q_rows, p_rows = [], [], []
        for _ in range(gamma):  # draft γ tokens from Q
            q_row = q[ctx]  # [active, vocab]
            p_rows.append(p[ctx])
            q_rows.append(q_row)
            ctx = sample(q_row, generator)
            drafted.append(ctx)
        p_rows.append(p[ctx])  # distribution after the last drafted token (bonus)
        result = verifier(
            torch.stack(drafted, 1),  # [active, γ]
            torch.stack(q_rows, 1),  # [active, γ, vocab]
            torch.stack(p_rows, 1),  # [active, γ+1, vocab]
            generator,
            validate=False,
        )
        n_emit = result.num_accepted + 1  # [active]
        offsets = torch.arange(gamma + 1).unsqueeze(0)  # [1, γ+1]
        keep = offsets < n_emit.unsqueeze(1)  # [active, γ+1]
        columns = filled[active].unsqueeze(1) + offsets  # [active, γ+1]
        active_rows = active.unsqueeze(1).expand_as(columns)
        out[active_rows[keep], columns[keep]] = result.tokens[keep]
        last[active] = result.tokens[torch.arange(len(active)), result.num_accepted]
        filled[active] += n_emit
        if progress is not None:
            progress(int(torch.clamp(filled, max=length).sum()))


def per_sequence_frequencies(tokens: torch.Tensor, vocab: int) -> np.ndarray:
    """tokens: [sequences, length] -> [sequences, vocab] within-sequence frequencies."""
    counts = torch.zeros(tokens.shape[0], vocab, dtype=torch.float64)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.float64))
    return (counts / tokens.shape[1]).numpy()


def markov_experiment(
    vocab: int = 5,
    length: int = 64,
    gamma: int = 4,
    sequences: int = 60_000,
    seed: int = 2,
    progress: Progress | None = None,
    verifier: BlockVerifier = verify,
) -> MarkovReport:
    """The specification's Markov experiment (P, Q from default_rng(seed) as there)."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if vocab < 2 or length < 1 or sequences < 2:
        raise ValueError("need vocab >= 2, length >= 1 and sequences >= 2")
    p_np, q_np = seed_matrices(vocab, seed)
    p = torch.as_tensor(p_np, dtype=torch.float32)
    q = torch.as_tensor(q_np, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    spec, calls = speculative_sequences(
        p, q, sequences, length, gamma, 0, generator, verifier, progress
    )
    plain = target_only_sequences(p, sequences, length, 0, generator)
    f_plain = per_sequence_frequencies(plain, vocab)
    f_spec = per_sequence_frequencies(spec, vocab)
    ft, fs = f_plain.mean(0), f_spec.mean(0)
    # Standard error of the difference, from the spread across independent sequences.
    se = np.sqrt(f_plain.var(0, ddof=1) / sequences + f_spec.var(0, ddof=1) / sequences)
    worst = int(np.argmax(np.abs(ft - fs)))
    total = sequences * length
    alphas = [acceptance_rate(p_np[t], q_np[t]) for t in range(vocab)]
    return MarkovReport(
        vocab=vocab,
        length=length,
        gamma=gamma,
        sequences=sequences,
        target_freq=ft.tolist(),
        speculative_freq=fs.tolist(),
        max_abs_diff=float(np.abs(ft - fs)[worst]),
        standard_error=float(se[worst]),
        tokens_per_target_call=total / calls,
        target_calls_saved=1 - calls / total,
        mean_acceptance=float(np.dot(ft, alphas)),
    )
