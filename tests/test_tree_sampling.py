"""Exactness of tree verification: analytic enumeration, reference equivalence, greedy."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
import torch

from speculative.drafters.tree import DraftTree
from speculative.sampling.probs import sample_from
from speculative.sampling.reference import verify_tree_reference
from speculative.sampling.tree import (
    accept_probability,
    reject_sibling,
    sample_without_replacement,
    verify_tree,
    verify_tree_from_uniforms,
    verify_tree_greedy,
)

VOCAB = 4


def distribution(prefix: tuple[int, ...], salt: int, sharp: float = 1.5) -> torch.Tensor:
    """A fixed, prefix-dependent distribution over VOCAB tokens (float64)."""
    g = torch.Generator().manual_seed(hash((prefix, salt)) % (2**31))
    return torch.softmax(torch.randn(VOCAB, generator=g, dtype=torch.float64) * sharp, -1)


def target(prefix):
    return distribution(prefix, 1)


def draft(prefix):
    return distribution(prefix, 2, sharp=1.0)


def ordered_draws(q: torch.Tensor | None, m: int, replacement: bool):
    """(draw sequence, probability) for m siblings from q; q None: the top-m of the draft."""
    if q is None:
        yield (), 1.0
        return
    for draws in itertools.product(range(VOCAB), repeat=m):
        if not replacement and len(set(draws)) < m:
            continue
        prob, weights = 1.0, q.clone()
        for x in draws:
            prob *= float(weights[x] / weights.sum())
            if not replacement:
                weights[x] = 0.0
        if prob > 0:
            yield draws, prob


def target_sequences(prefix, length):
    """Exact target law of the next ``length`` tokens after prefix: {tokens: prob}."""
    if length == 0:
        return {(): 1.0}
    p = target(prefix)
    return {
        (x, *rest): float(p[x]) * pr
        for x in range(VOCAB)
        for rest, pr in target_sequences((*prefix, x), length - 1).items()
    }


def keep_q(p, q, token):
    """Broken rule: the rejected sibling stays in q."""
    p_next, _ = reject_sibling(p, q, token)
    return p_next, q


def round_law(
    prefix, branching, point_mass=False, replacement=False, step=reject_sibling, prune=None
):
    """Exact law of one tree round's emitted tokens, completed by target sampling to
    len(branching) + 1 tokens: all sibling draws x all accept/reject branches.
    prune(q, draws) -> how many of the draws to keep (a broken drafter's pruning)."""
    length = len(branching) + 1
    if not branching:  # a leaf: the bonus token, then nothing more
        return target_sequences(prefix, length)
    out: dict[tuple[int, ...], float] = defaultdict(float)
    q0 = draft(prefix)
    if point_mass:
        top = torch.argsort(q0, descending=True)[: branching[0]].tolist()
        draws_list = [(tuple(top), 1.0)]
    else:
        draws_list = ordered_draws(q0, branching[0], replacement)
    for draws, prob in draws_list:
        if prune is not None:
            draws = draws[: prune(q0, draws)]
        # the rules take numpy float64 rows, as the verifier walks them
        p, q, reach = target(prefix).numpy(), (None if point_mass else q0.numpy()), prob
        for x in draws:
            a = accept_probability(p, q, x)
            for rest, pr in round_law(
                (*prefix, x), branching[1:], point_mass, replacement, step, prune
            ).items():
                out[(x, *rest)] += reach * a * pr
            reach *= 1 - a
            p, q = step(p, q, x)
        for r in range(VOCAB):  # every sibling rejected: recovered from the final p
            for rest, pr in target_sequences((*prefix, r), length - 1).items():
                out[(r, *rest)] += reach * float(p[r]) * pr
    return out


def max_error(law, prefix, length):
    exact = target_sequences(prefix, length)
    assert abs(sum(law.values()) - 1) < 1e-9
    return max(abs(law.get(s, 0.0) - pr) for s, pr in exact.items())


@pytest.mark.parametrize("branching", [(2,), (3,), (2, 2), (3, 1), (4,)])
@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("prefix", [(2,), (0, 3)])
def test_analytic_tree_round_is_exact(branching, point_mass, prefix):
    law = round_law(prefix, branching, point_mass)
    assert max_error(law, prefix, len(branching) + 1) < 1e-6


def prune_unlikely(q, draws):
    """Keep the first draw, then siblings only while q(x) >= 0.2: the group's size
    depends on the drawn values."""
    kept = 1
    while kept < len(draws) and q[draws[kept]] >= 0.2:
        kept += 1
    return kept


def prune_fixed(q, draws):
    """Keep two siblings whatever was drawn (a size fixed before drawing): still exact."""
    return 2


@pytest.mark.parametrize("prefix", [(2,), (0, 3)])
def test_analytic_pruning_fixed_before_drawing_is_exact(prefix):
    law = round_law(prefix, (3, 2), prune=prune_fixed)
    assert max_error(law, prefix, 3) < 1e-6


@pytest.mark.parametrize(
    "broken",
    [
        {"step": keep_q},  # rejected sibling not removed from q
        {"replacement": True},  # siblings drawn with replacement, verified as without
        {"prune": prune_unlikely},  # sibling group cut by the drawn values
    ],
)
@pytest.mark.parametrize("branching", [(3,), (2, 2)])
def test_analytic_negative_controls(broken, branching):
    prefix = (2,)  # (for some prefixes the first residual is one-hot and both rules agree)
    law = round_law(prefix, branching, **broken)
    assert max_error(law, prefix, len(branching) + 1) > 1e-3


def random_tree(generator, n_levels=(3, 2, 2), vocab=8, point_mass=False):
    """A static tree (branching per level) drawn w/o replacement from random q rows,
    plus random target rows: (DraftTree, target_probs [n + 1, vocab])."""
    tokens, parents, q_rows = [], [], []
    frontier = [-1]
    for width in n_levels:
        new = []
        for parent in frontier:
            q = torch.softmax(torch.randn(vocab, generator=generator) * 2, -1)
            if point_mass:
                kids = torch.argsort(q, descending=True)[:width].tolist()
            else:
                kids = sample_without_replacement(q, width, generator)
            for x in kids:
                tokens.append(x)
                parents.append(parent)
                q_rows.append(q)
                new.append(len(tokens) - 1)
        frontier = new
    target_probs = torch.softmax(torch.randn(len(tokens) + 1, vocab, generator=generator) * 2, -1)
    q = None if point_mass else torch.stack(q_rows)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), q), target_probs


@pytest.mark.parametrize("point_mass", [False, True])
def test_fast_tree_verify_matches_reference(point_mass):
    g = torch.Generator().manual_seed(3)
    paths = set()
    for _ in range(300):
        tree, target_probs = random_tree(g, point_mass=point_mass)
        u = torch.rand(tree.size, generator=g, dtype=torch.float64)
        s = float(torch.rand(1, generator=g, dtype=torch.float64))
        fast = verify_tree_from_uniforms(tree.tokens, tree.parents, tree.q, target_probs, u, s)
        slow = verify_tree_reference(
            tree.tokens.tolist(),
            tree.parents.tolist(),
            None if tree.q is None else tree.q.double().tolist(),
            target_probs.double().tolist(),
            u.tolist(),
            s,
        )
        assert fast.tokens == slow
        assert [tree.tokens[i].item() for i in fast.path] == slow[:-1]
        assert fast.path == tree.path_to(fast.path[-1]) if fast.path else True
        paths.add(len(fast.path))
    assert paths == {0, 1, 2, 3}  # every depth was reached


def test_verify_tree_consumes_generator_like_documented():
    g = torch.Generator().manual_seed(5)
    tree, target_probs = random_tree(g)
    a, b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    result = verify_tree(tree.tokens, tree.parents, tree.q, target_probs, a)
    u = torch.rand(tree.size, generator=b, dtype=torch.float64)
    s = float(torch.rand(1, generator=b, dtype=torch.float64))
    again = verify_tree_from_uniforms(tree.tokens, tree.parents, tree.q, target_probs, u, s)
    assert result == again
    assert torch.equal(a.get_state(), b.get_state())


def test_greedy_tree_walks_argmax():
    # root -> {5, 2}; 2 -> {7, 1}; 5 -> {3}
    tree = DraftTree(torch.tensor([5, 2, 7, 1, 3]), torch.tensor([-1, -1, 1, 1, 0]))
    logits = torch.full((6, 9), 0.0)
    logits[0, 2] = 1  # root: argmax 2 (second child)
    logits[2, 1] = 1  # after 2: argmax 1 (node 3)
    logits[4, 8] = 1  # after 2,1: argmax 8 (a leaf: bonus)
    r = verify_tree_greedy(tree.tokens, tree.parents, logits)
    assert (r.path, r.tokens) == ([1, 3], [2, 1, 8])
    logits[2] = 0
    logits[2, 4] = 1  # after 2: argmax 4, no such child
    r = verify_tree_greedy(tree.tokens, tree.parents, logits)
    assert (r.path, r.tokens) == ([1], [2, 4])


def test_tree_helpers_and_validation():
    tree = DraftTree(torch.tensor([5, 2, 7, 1, 3]), torch.tensor([-1, -1, 1, 1, 0]))
    assert tree.depths().tolist() == [1, 1, 2, 2, 2]
    mask = tree.ancestor_mask()
    assert mask[4].tolist() == [True, False, True, False, True, False]  # node 3: root, 1, 3
    assert mask[0].tolist() == [True] + [False] * 5
    assert tree.path_to(3) == [1, 3]
    chain = DraftTree.chain([4, 4, 1])
    assert chain.parents.tolist() == [-1, 0, 1]
    with pytest.raises(ValueError, match="parents"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 1]))
    with pytest.raises(ValueError, match="q must be"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), torch.ones(3, 4) / 4)
    with pytest.raises(ValueError, match="target_probs"):
        verify_tree(tree.tokens, tree.parents, None, torch.ones(3, 9) / 9, torch.Generator())


def test_sample_without_replacement_respects_support():
    g = torch.Generator().manual_seed(0)
    q = torch.tensor([0.0, 0.5, 0.0, 0.5])
    for _ in range(20):
        drawn = sample_without_replacement(q, 3, g)
        assert sorted(drawn) == [1, 3]


def _sequential_draws(
    q: torch.Tensor, count: int, g: torch.Generator, remove: bool = True
) -> list[int]:
    """The sibling law by definition: each token by sample_from (torch) from q with the
    earlier draws zeroed (``remove`` False: the broken rule, draws with replacement)."""
    weights, drawn = q.double().clone(), []
    for _ in range(min(count, int((weights > 0).sum()))):
        uniform = torch.rand(1, generator=g, dtype=torch.float64)
        drawn.append(int(sample_from(weights.unsqueeze(0), uniform)[0]))
        if remove:
            weights[drawn[-1]] = 0.0
    return drawn


def test_sample_without_replacement_is_sequential_inverse_cdf_draws():
    """The numpy draws are sample_from's, token for token, and leave the generator where
    the torch draws leave it: wide and narrow rows, zeros, float32 and float64 q. The
    control: the same comparison catches draws with replacement."""
    g = torch.Generator().manual_seed(7)
    caught = 0
    for trial in range(400):
        vocab = (5, 20, 300, 49152)[trial % 4]
        q = torch.softmax(torch.randn(vocab, generator=g) * (trial % 7), -1)
        if trial % 3 == 0:
            q[torch.rand(vocab, generator=g) < 0.5] = 0.0
        if trial % 5 == 0:
            q = q.double()
        count = 1 + trial % 6
        ours, theirs = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        drawn = sample_without_replacement(q, count, ours)
        assert drawn == _sequential_draws(q, count, theirs)
        assert torch.equal(ours.get_state(), theirs.get_state())
        broken = _sequential_draws(q, count, torch.Generator().manual_seed(trial), remove=False)
        caught += broken != drawn
    assert caught >= 40
