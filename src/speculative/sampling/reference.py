"""Slow, obviously-correct reference implementation of block verification.

Pure Python loops over one row at a time, written straight from the definition; the
fast batched :func:`speculative.sampling.verify.verify_from_uniforms` is tested against it.
"""

from __future__ import annotations

import torch


def inverse_cdf(weights: list[float], u: float) -> int:
    """Index i with cumsum(weights)[i-1] <= u * total < cumsum(weights)[i], weight > 0."""
    total = sum(weights)
    target = u * total
    running = 0.0
    last_positive = max(i for i, w in enumerate(weights) if w > 0)
    for i, w in enumerate(weights):
        running += w
        if w > 0 and target < running:
            return i
    return last_positive


def verify_row_reference(
    draft_tokens: list[int],
    draft_probs: list[list[float]] | None,
    target_probs: list[list[float]],
    accept_uniforms: list[float],
    sample_uniform: float,
) -> list[int]:
    """Emitted tokens for one row (accepted..., recovered-or-bonus)."""
    vocab = len(target_probs[0])
    emitted: list[int] = []
    for j, x in enumerate(draft_tokens):
        p = target_probs[j]
        q = draft_probs[j] if draft_probs is not None else [float(i == x) for i in range(vocab)]
        if accept_uniforms[j] * q[x] < p[x]:
            emitted.append(x)
            continue
        leftover = [max(0.0, pi - qi) for pi, qi in zip(p, q, strict=True)]
        if sum(leftover) <= 1e-12:
            leftover = list(p)
        emitted.append(inverse_cdf(leftover, sample_uniform))
        return emitted
    emitted.append(inverse_cdf(list(target_probs[len(draft_tokens)]), sample_uniform))
    return emitted


def verify_reference(
    draft_tokens: torch.Tensor,  # [batch, gamma]
    draft_probs: torch.Tensor | None,  # [batch, gamma, vocab]
    target_probs: torch.Tensor,  # [batch, gamma + 1, vocab]
    accept_uniforms: torch.Tensor,  # [batch, gamma]
    sample_uniforms: torch.Tensor,  # [batch]
) -> list[list[int]]:
    """Emitted tokens per row, computed one row at a time in float64."""
    return [
        verify_row_reference(
            draft_tokens[b].tolist(),
            None if draft_probs is None else draft_probs[b].double().tolist(),
            target_probs[b].double().tolist(),
            accept_uniforms[b].double().tolist(),
            float(sample_uniforms[b]),
        )
        for b in range(draft_tokens.shape[0])
    ]


def nucleus_threshold_reference(probs: list[float], top_p: float) -> float:
    """The least probability in the top-p nucleus of one row, from a full sort: the
    smallest descending prefix whose mass reaches top_p (the first token always kept)."""
    ordered = sorted(probs, reverse=True)
    mass_before = 0.0
    threshold = ordered[0]
    for p in ordered:
        if mass_before >= top_p:
            break
        threshold = p
        mass_before += p
    return threshold


def verify_tree_reference(
    tokens: list[int],
    parents: list[int],
    draft_probs: list[list[float]] | None,
    target_probs: list[list[float]],
    accept_uniforms: list[float],
    sample_uniform: float,
) -> list[int]:
    """Emitted tokens of one tree (accepted path..., recovered-or-bonus), in plain floats.

    Recursive rejection sampling over siblings drawn without replacement, written out.
    """
    vocab = len(target_probs[0])
    emitted: list[int] = []
    node = -1
    while True:
        p = list(target_probs[node + 1])
        siblings = [i for i, parent in enumerate(parents) if parent == node]
        q = None if draft_probs is None or not siblings else list(draft_probs[siblings[0]])
        accepted = None
        for child in siblings:
            x = tokens[child]
            q_x = 1.0 if q is None else q[x]
            if accept_uniforms[child] * q_x < p[x]:
                accepted = child
                break
            one_hot = [float(i == x) for i in range(vocab)]
            leftover = [max(0.0, pi - qi) for pi, qi in zip(p, q or one_hot, strict=True)]
            mass = sum(leftover)
            if mass > 1e-12:
                p = [w / mass for w in leftover]
            if q is not None:
                q[x] = 0.0
                total = sum(q)
                q = [w / total for w in q] if total > 0 else q
        if accepted is None:
            emitted.append(inverse_cdf(p, sample_uniform))
            return emitted
        emitted.append(tokens[accepted])
        node = accepted
