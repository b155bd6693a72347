"""Exact verification of a drafted token tree (recursive rejection sampling over siblings).

A tree is given flat: node i has token ``tokens[i]`` and parent ``parents[i]`` (-1 is the
root, the last committed token); parents come before children and siblings appear in the
order they were drawn. ``target_probs[0]`` is the target's distribution after the root,
``target_probs[i + 1]`` the one after the path to node i.

Walking down from the root, at a node with target distribution p whose children
x1..xm were drawn WITHOUT replacement from the draft distribution q:

* test x1: accept with probability min(1, p(x1) / q(x1));
* on rejection p <- normalize(max(p - q, 0)) and q <- q with x1 removed, renormalized;
  test x2 the same way against the updated p and q, and so on;
* on acceptance of a sibling descend into it (its own children, its own target row);
* when every sibling is rejected emit a *recovered* token from the final p; at a node
  without children emit a *bonus* token from its p.

Each stage is the single-token rule with proposal q_i (the law of x_i given the earlier
draws) and target p_i, so it outputs p_i; p_{i+1} does not depend on x_i, hence by
induction from the last stage the node outputs exactly p (Jeon et al. 2024, "Recursive
Speculative Decoding"; SpecTr / SpecInfer are the multi-draft relatives). Point-mass
drafts (``q = None``, deterministic siblings such as top-k or n-gram candidates) use a
one-hot q per sibling: accept x with probability p(x), else p <- p with x zeroed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from speculative.sampling.probs import RowProbs, check_probs

EMPTY_RESIDUAL = 1e-12  # residual mass below which a rejection had probability ~0


@dataclass(frozen=True)
class TreeVerifyResult:
    """Outcome of verifying one tree.

    path:   accepted node indices, root to leaf (len = num_accepted).
    tokens: emitted tokens: the accepted path's tokens, then one recovered or bonus token.
    """

    path: list[int]
    tokens: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def children_lists(parents: list[int]) -> list[list[int]]:
    """Children of the root (entry 0) and of node i (entry i + 1), in node order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        children[parent + 1].append(node)
    return children


def check_tree(
    tokens: torch.Tensor,  # [n]
    parents: torch.Tensor,  # [n]
    draft_probs: torch.Tensor | None,  # [n, vocab]
    target_probs: torch.Tensor,  # [n + 1, vocab]
) -> None:
    """Raise ValueError when the tree's tensors do not fit together."""
    if tokens.dim() != 1 or parents.shape != tokens.shape:
        raise ValueError(
            f"tokens and parents must be [n], got {tuple(tokens.shape)} and {tuple(parents.shape)}"
        )
    n = tokens.shape[0]
    if target_probs.dim() != 2 or target_probs.shape[0] != n + 1:
        raise ValueError(
            f"target_probs must be [n+1={n + 1}, vocab], got {tuple(target_probs.shape)}"
        )
    vocab = target_probs.shape[1]
    if draft_probs is not None and tuple(draft_probs.shape) != (n, vocab):
        raise ValueError(
            f"draft_probs must be [n={n}, vocab={vocab}], got {tuple(draft_probs.shape)}"
        )
    # a tree has a handful of nodes: plain Python on lists costs less than torch reductions
    if any(not 0 <= token < vocab for token in tokens.tolist()):
        raise ValueError(f"tokens must be token ids in [0, {vocab})")
    if not parents_come_first(parents.tolist()):
        raise ValueError("parents[i] must lie in [-1, i): parents come before children")


def parents_come_first(parents: list[int]) -> bool:
    """Whether every parents[i] lies in [-1, i) (the root, or a node before i). A tree has
    a handful of nodes: a Python walk costs less than torch's elementwise ops."""
    return all(-1 <= parent < node for node, parent in enumerate(parents))


def accept_probability(p: np.ndarray, q: np.ndarray | None, token: int) -> float:
    """min(1, p(x) / q(x)) for the current p, q ([vocab] float64); one-hot q when None."""
    q_x = 1.0 if q is None else float(q[token])
    p_x = float(p[token])
    return 1.0 if p_x >= q_x else p_x / q_x


def accepts(p: np.ndarray, q: np.ndarray | None, token: int, uniform: float) -> bool:
    """u < min(1, p/q)  <=>  u * q < p  (no division; q(x) = 0 with p(x) > 0 accepts)."""
    q_x = 1.0 if q is None else float(q[token])
    return uniform * q_x < float(p[token])


def reject_sibling(
    p: np.ndarray, q: np.ndarray | None, token: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """(p, q) for the next sibling after ``token`` was rejected.   p, q: [vocab] float64.

    p <- normalize(max(p - q, 0)) (with a one-hot q: p with ``token`` zeroed); q <- q with
    ``token`` removed, renormalized (None stays None: each point-mass sibling is its own q).
    """
    if q is None:
        leftover = p.copy()
        leftover[token] = 0.0
    else:
        leftover = np.maximum(p - q, 0.0)
    mass = float(leftover.sum())
    # p == q up to rounding: the rejection had probability ~0; keep p (continuous limit).
    p_next = p if mass <= EMPTY_RESIDUAL else leftover / mass
    if q is None:
        return p_next, None
    q_next = q.copy()
    q_next[token] = 0.0
    q_mass = float(q_next.sum())
    return p_next, (q_next / q_mass if q_mass > 0 else q_next)


def verify_tree_from_uniforms(
    tokens: torch.Tensor,  # [n] int64
    parents: torch.Tensor,  # [n] int64, -1 = root
    draft_probs: torch.Tensor | None,  # [n, vocab] (row i: the q node i was drawn from)
    target_probs: torch.Tensor,  # [n + 1, vocab]
    accept_uniforms: torch.Tensor,  # [n] in [0, 1): node i's accept test uses entry i
    sample_uniform: float,  # in [0, 1): the recovered or bonus token
) -> TreeVerifyResult:
    """Tree verification driven by explicit uniforms (deterministic given them). Rows
    run in numpy float64 (a tree's walk reads single entries, where torch's per-call
    cost is tens of times numpy's)."""
    token_list = tokens.tolist()
    children = children_lists(parents.tolist())
    uniforms = accept_uniforms.double().tolist()
    target = target_probs.detach().numpy()  # [n + 1, vocab]
    draft = None if draft_probs is None else draft_probs.detach().numpy()  # [n, vocab]
    path: list[int] = []
    node = -1
    while True:
        p = target[node + 1].astype(np.float64)  # [vocab]
        siblings = children[node + 1]
        q = None if draft is None or not siblings else draft[siblings[0]].astype(np.float64)
        accepted = None
        for child in siblings:
            if accepts(p, q, token_list[child], uniforms[child]):
                accepted = child
                break
            p, q = reject_sibling(p, q, token_list[child])
        if accepted is None:  # recovered (all siblings rejected) or bonus (a leaf)
            extra = RowProbs(p).draw(sample_uniform)  # sample_from's token, bit for bit
            return TreeVerifyResult(path, [token_list[i] for i in path] + [extra])
        path.append(accepted)
        node = accepted


def verify_tree(
    tokens: torch.Tensor,  # [n] int64
    parents: torch.Tensor,  # [n] int64
    draft_probs: torch.Tensor | None,  # [n, vocab] or None (point-mass siblings)
    target_probs: torch.Tensor,  # [n + 1, vocab]
    generator: torch.Generator,
    validate: bool = True,
) -> TreeVerifyResult:
    """Verify a drafted tree against the target; randomness only from ``generator``.

    Draws n accept uniforms then one sample uniform (float64), always, so two verifiers
    given the same generator state see the same randomness.
    """
    check_tree(tokens, parents, draft_probs, target_probs)
    if validate:
        check_probs(target_probs, "target_probs")
        if draft_probs is not None:
            check_probs(draft_probs, "draft_probs")
    n = tokens.shape[0]
    accept_uniforms = torch.rand(n, generator=generator, dtype=torch.float64)
    sample_uniform = float(torch.rand(1, generator=generator, dtype=torch.float64)[0])
    return verify_tree_from_uniforms(
        tokens, parents, draft_probs, target_probs, accept_uniforms, sample_uniform
    )


def verify_tree_greedy(
    tokens: torch.Tensor,  # [n] int64
    parents: torch.Tensor,  # [n] int64
    target_logits: torch.Tensor,  # [n + 1, vocab] (logits or probabilities)
) -> TreeVerifyResult:
    """Temperature 0: walk down taking the child equal to the target's argmax; emit the
    accepted path and the argmax after it."""
    if target_logits.dim() != 2 or target_logits.shape[0] != tokens.shape[0] + 1:
        raise ValueError(
            f"target_logits must be [n+1={tokens.shape[0] + 1}, vocab], "
            f"got {tuple(target_logits.shape)}"
        )
    best = target_logits.argmax(dim=-1).tolist()  # [n + 1]
    token_list = tokens.tolist()
    children = children_lists(parents.tolist())
    path: list[int] = []
    node = -1
    while True:
        wanted = best[node + 1]
        match = next((c for c in children[node + 1] if token_list[c] == wanted), None)
        if match is None:
            return TreeVerifyResult(path, [token_list[i] for i in path] + [wanted])
        path.append(match)
        node = match


def sample_without_replacement(
    q: torch.Tensor, count: int, generator: torch.Generator
) -> list[int]:
    """Up to ``count`` distinct tokens drawn one by one from q ([vocab]) without
    replacement (each draw from q with the earlier draws removed, renormalized): the
    sibling law :func:`verify_tree` assumes. Fewer when q has fewer nonzero entries.
    Each draw is :func:`sample_from`'s token for one float64 uniform from ``generator``,
    bit for bit (by :meth:`RowProbs.draw`, in numpy: a tenth of the torch calls' time)."""
    weights = q.detach().numpy().copy()  # [vocab], its own dtype (float64 sums either way)
    drawn: list[int] = []
    for _ in range(min(count, int(np.count_nonzero(weights > 0)))):
        uniform = float(torch.rand(1, generator=generator, dtype=torch.float64)[0])
        token = RowProbs(weights).draw(uniform)
        drawn.append(token)
        weights[token] = 0.0
    return drawn
