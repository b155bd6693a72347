"""Deliberately broken block verifiers: the negative controls of the statistical tests.

Each has the signature of :func:`speculative.sampling.verify` and breaks one rule.
"""

from __future__ import annotations

import torch

from speculative.sampling import VerifyResult, sample, verify


def always_accept(draft_tokens, draft_probs, target_probs, generator, validate=True):
    """Keeps every drafted token (output follows the draft, not the target)."""
    batch, gamma = draft_tokens.shape
    bonus = sample(target_probs[:, gamma], generator)  # [batch]
    tokens = torch.cat([draft_tokens, bonus.unsqueeze(1)], dim=1)
    return VerifyResult(torch.full((batch,), gamma, dtype=torch.long), tokens)


def resample_from_target(draft_tokens, draft_probs, target_probs, generator, validate=True):
    """On rejection samples from p instead of the residual max(0, p - q)."""
    result = verify(draft_tokens, draft_probs, target_probs, generator, validate=False)
    batch, gamma = draft_tokens.shape
    rows = torch.arange(batch)
    rejected = result.num_accepted < gamma  # [batch]
    from_p = sample(target_probs[rows, result.num_accepted], generator)  # [batch]
    tokens = result.tokens.clone()
    tokens[rows[rejected], result.num_accepted[rejected]] = from_p[rejected]
    return VerifyResult(result.num_accepted, tokens)


def forget_bonus(draft_tokens, draft_probs, target_probs, generator, validate=True):
    """Emits nothing extra when all drafted tokens are accepted."""
    result = verify(draft_tokens, draft_probs, target_probs, generator, validate=False)
    gamma = draft_tokens.shape[1]
    tokens = result.tokens.clone()
    tokens[result.num_accepted == gamma, gamma] = -1
    return VerifyResult(result.num_accepted, tokens)


def tree_keep_rejected_in_q(tokens, parents, draft_probs, target_probs, generator, validate=True):
    """Tree verifier that forgets to remove a rejected sibling from q (the residual p is
    updated, but the next sibling is tested against the original q)."""
    from speculative.sampling import sample_from
    from speculative.sampling.tree import TreeVerifyResult, accepts, children_lists, reject_sibling

    n = tokens.shape[0]
    uniforms = torch.rand(n, generator=generator, dtype=torch.float64).tolist()
    last = torch.rand(1, generator=generator, dtype=torch.float64)
    token_list, children = tokens.tolist(), children_lists(parents.tolist())
    path, node = [], -1
    while True:
        p = target_probs[node + 1].double().numpy()  # the rules' numpy float64 rows
        siblings = children[node + 1]
        q = None if draft_probs is None or not siblings else draft_probs[siblings[0]].double()
        q = None if q is None else q.numpy()
        accepted = None
        for child in siblings:
            if accepts(p, q, token_list[child], uniforms[child]):
                accepted = child
                break
            p, _ = reject_sibling(p, q, token_list[child])  # BUG: q keeps the rejected token
        if accepted is None:
            extra = int(sample_from(torch.from_numpy(p).unsqueeze(0), last)[0])
            return TreeVerifyResult(path, [token_list[i] for i in path] + [extra])
        path.append(accepted)
        node = accepted
