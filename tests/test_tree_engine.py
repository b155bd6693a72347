"""Tree rounds through the real engine: Markov toy models (fast) and tiny transformers."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from scipy import stats

import broken
from speculative.drafters import DraftModelDrafter
from speculative.drafters.tree import TreeShape
from speculative.engine import SpeculativeEngine, StopCriteria
from speculative.engine.tree import TreeRound
from speculative.models import MarkovLM
from speculative.models.markov import stochastic_matrix
from speculative.sampling import SamplingParams, verify_tree

pytestmark = pytest.mark.usefixtures("single_thread")

# A flat target and an unrelated, peaked draft (not a blur of P): low acceptance, so most
# tokens pass through the sibling and residual rules and a wrong sibling rule is visible
# at small N (from the prompt's last token 0 the broken rule's chi-square divergence is
# 0.86 per step; for the specification's blurred pair it is ~4e-5).
P = stochastic_matrix(np.random.default_rng(2), 5, 1.5)
Q = stochastic_matrix(np.random.default_rng(3), 5, 0.7)


def markov_tree_engine(shape: TreeShape | None, budget=8, verifier=verify_tree):
    if shape is None:
        return SpeculativeEngine(MarkovLM(P, "target"), None)
    drafter = DraftModelDrafter(MarkovLM(Q, "draft"), 5)
    drafter.set_tree_shape(shape)
    return SpeculativeEngine(
        MarkovLM(P, "target"), drafter, tree=TreeRound(drafter, budget, verifier)
    )


def sequence_counts(engine, n, length, params, seed) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(5**length)
    stop = StopCriteria(max_new_tokens=length)
    for _ in range(n):
        tokens = engine.generate([0, 3, 0], params, stop, g).token_ids
        assert len(tokens) == length
        counts[int("".join(map(str, tokens)), 5)] += 1
    return counts


@functools.cache
def plain_counts(n: int, length: int) -> np.ndarray:
    """Target-only sampling, shared by the tests below (same seed, same N)."""
    return sequence_counts(markov_tree_engine(None), n, length, SamplingParams(), seed=1)


def two_sample_p_value(a: np.ndarray, b: np.ndarray) -> float:
    keep = (a + b) > 0
    return float(stats.chi2_contingency(np.stack([a[keep], b[keep]]))[1])


SHAPES = [
    TreeShape("static", branching=(3, 2)),  # sampled siblings, q rows
    TreeShape("static", branching=(2, 2, 1)),
    TreeShape("dynamic", depth=3, width=2),  # calibrated: siblings where q is unsure
    TreeShape("dynamic", depth=3, width=3, sibling_below=1.0),  # siblings at every depth
]
ALPHA = 1e-3 / len(SHAPES)  # Bonferroni over the configurations of one test


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.mode}{s.branching}{s.width}")
def test_markov_tree_sequences_match_plain_sampling(shape):
    n, length = 2000, 3
    plain = plain_counts(n, length)
    spec = sequence_counts(markov_tree_engine(shape), n, length, SamplingParams(), seed=2)
    assert two_sample_p_value(plain, spec) > ALPHA


def test_markov_tree_negative_control_sibling_rule():
    """The same test at the same N detects a verifier that keeps rejected siblings in q."""
    n, length = 2000, 3
    shape = TreeShape("static", branching=(3, 2))
    plain = plain_counts(n, length)
    wrong_engine = markov_tree_engine(shape, verifier=broken.tree_keep_rejected_in_q)
    wrong = sequence_counts(wrong_engine, n, length, SamplingParams(), seed=2)
    assert two_sample_p_value(plain, wrong) < ALPHA


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.mode}{s.branching}{s.width}")
def test_markov_greedy_tree_matches_plain(shape):
    params = SamplingParams(temperature=0)
    stop = StopCriteria(max_new_tokens=40)
    g = torch.Generator().manual_seed(0)
    plain = markov_tree_engine(None).generate([1, 2], params, stop, g).token_ids
    spec = markov_tree_engine(shape).generate([1, 2], params, stop, g)
    assert spec.token_ids == plain
    assert spec.stats.new_tokens == 40
    assert spec.stats.drafted_tokens <= 8 * spec.stats.target_calls


def test_tree_round_stops_exactly_and_counts():
    eos = 4
    g = torch.Generator().manual_seed(3)
    engine = markov_tree_engine(TreeShape("static", branching=(2, 2, 2)), budget=6)
    for budget in (1, 2, 5):
        result = engine.generate([0], SamplingParams(), StopCriteria(max_new_tokens=budget), g)
        assert len(result.token_ids) == budget == result.stats.new_tokens
    stop = StopCriteria(max_new_tokens=50, eos_token_ids=frozenset({eos}))
    for _ in range(10):
        tokens = engine.generate([0], SamplingParams(), stop, g).token_ids
        assert eos not in tokens[:-1]
    s = engine.generate([0], SamplingParams(), StopCriteria(max_new_tokens=100), g).stats
    assert s.new_tokens == 100 and s.drafted_tokens <= 6 * s.target_calls
    # each round emits its accepted path plus one token (the last round may be cut)
    assert s.new_tokens <= s.accepted_tokens + s.target_calls <= s.new_tokens + 1
    assert s.mean_accepted_length > 1.2


def test_ngram_trie_and_greedy_identity():
    from speculative.drafters import PromptLookupDrafter
    from speculative.drafters.ngram import find_continuations, trie

    context = [1, 2, 3, 1, 2, 4, 1, 2, 3, 0, 1, 2]
    follows = find_continuations(context, 3, max_ngram=2, min_ngram=1, limit=4)
    assert follows[:2] == [[3, 0, 1], [4, 1, 2]]
    tree = trie(follows, budget=5)
    assert tree.tokens.tolist()[:3] == [3, 0, 1] and tree.parents.tolist()[:3] == [-1, 0, 1]
    assert tree.size == 5 and tree.parents.tolist()[3] == -1  # 4 branches off the root
    drafter = PromptLookupDrafter()
    engine = SpeculativeEngine(MarkovLM(P), drafter, tree=TreeRound(drafter, 6))
    params, stop = SamplingParams(temperature=0), StopCriteria(max_new_tokens=40)
    plain = markov_tree_engine(None).generate([1, 2, 1, 2], params, stop, torch.Generator())
    spec = engine.generate([1, 2, 1, 2], params, stop, torch.Generator())
    assert spec.token_ids == plain.token_ids and spec.stats.accepted_tokens > 0


def test_budget_from_verify_cost():
    from speculative.engine import budget_from_verify_cost

    curve = {1: 1.0, 2: 1.02, 3: 1.05, 4: 1.07, 5: 1.16, 6: 1.3, 7: 1.64, 8: 1.83}
    assert budget_from_verify_cost(curve) == 5  # k = 6 is the last within 1.3
    assert budget_from_verify_cost(curve, flat=1.1) == 3
    assert budget_from_verify_cost({1: 1.0, 2: 2.0}) == 1
    assert budget_from_verify_cost({1: 1.0, 2: 1.0, 3: 1.5, 4: 1.0}) == 1  # first rise stops
