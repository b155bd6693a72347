"""Deliberately broken verification rules: the negative controls of ``speculative check``.

LOSSY BY DESIGN. Each has the signature of the exact rule it replaces
(:func:`speculative.sampling.verify` or :func:`speculative.sampling.verify_tree`) and is
only ever passed explicitly (``SpeculativeEngine(verifier=...)``, ``TreeRound.verifier``,
``BatchEngine(verifier=...)``) so a check can show that it would notice a broken rule.
"""

from __future__ import annotations

import torch

from speculative.sampling import TreeVerifyResult, VerifyResult, sample
from speculative.sampling.tree import children_lists

CONTROL_NAME = "accept-all + bonus from the wrong row"  # what the controls break, in reports


def accept_all(
    draft_tokens: torch.Tensor,  # [batch, γ]
    draft_probs: torch.Tensor | None,  # [batch, γ, vocab] (ignored: the bug)
    target_probs: torch.Tensor,  # [batch, γ + 1, vocab]
    generator: torch.Generator,
    validate: bool = True,
) -> VerifyResult:
    """Keeps every drafted token, then a bonus token from the target's distribution at the
    wrong row (the first, after the context, instead of the last: an indexing bug). Two
    classic bugs at once, so the control shows with any drafter: a poor one through the
    accepted drafts, a near-perfect one (q ≈ p) through the bonus at position γ + 1."""
    batch, gamma = draft_tokens.shape
    bonus = sample(target_probs[:, 0], generator)  # [batch]
    tokens = torch.cat([draft_tokens, bonus.unsqueeze(1)], dim=1)  # [batch, γ + 1]
    return VerifyResult(torch.full((batch,), gamma, dtype=torch.long), tokens)


def accept_all_tree(
    tokens: torch.Tensor,  # [n]
    parents: torch.Tensor,  # [n]
    draft_probs: torch.Tensor | None,  # [n, vocab] (ignored: the bug)
    target_probs: torch.Tensor,  # [n + 1, vocab]
    generator: torch.Generator,
    validate: bool = True,
) -> TreeVerifyResult:
    """Tree twin of :func:`accept_all`: keeps the first child at every depth down to a
    leaf, then a bonus token from the target's distribution at the root (the wrong row)."""
    children = children_lists(parents.tolist())
    path: list[int] = []
    while children[path[-1] + 1 if path else 0]:
        path.append(children[path[-1] + 1 if path else 0][0])
    bonus = int(sample(target_probs[0].unsqueeze(0), generator)[0])
    return TreeVerifyResult(path, [int(tokens[i]) for i in path] + [bonus])
