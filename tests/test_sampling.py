"""Exactness of the sampling primitives: analytic identity, reference equivalence, edges."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speculative.sampling import (
    SamplingParams,
    check_probs,
    logits_to_probs,
    residual,
    sample_from,
    speculative_step,
    verify,
    verify_from_uniforms,
    verify_greedy,
)
from speculative.sampling.reference import verify_reference


def single_step_output(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact output distribution of one accept/recover step, from the library's pieces."""
    accepted = q * torch.clamp(p / q.clamp_min(1e-300), max=1.0)  # q · min(1, p/q)
    accepted = torch.where(q > 0, accepted, torch.zeros_like(p))
    rate = torch.minimum(p, q).sum()
    leftover = residual(p, q)
    mass = leftover.sum()
    recovered = leftover / mass if mass > 0 else torch.zeros_like(p)
    return accepted + (1 - rate) * recovered


def edge_pairs() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(5)
    pairs = [
        (rng.dirichlet(np.ones(8) * a), rng.dirichlet(np.ones(8) * b))
        for a in (0.1, 1.0, 10.0)
        for b in (0.1, 1.0, 10.0)
    ]
    p = np.array([0.3, 0.25, 0.2, 0.15, 0.07, 0.03])
    pairs += [
        (p, p.copy()),  # p == q: residual has zero mass
        (p, np.array([0.0, 0.1, 0.3, 0.3, 0.2, 0.1])),  # q(x) = 0 where p(x) > 0
        (np.array([0.0, 0.5, 0.5, 0, 0, 0]), np.ones(6) / 6),  # p(x) = 0 for drafted x
        (p, np.eye(6)[3]),  # one-hot q
        (np.eye(6)[2], p),  # one-hot p
        (np.array([1 - 5e-9, 1e-9, 1e-9, 1e-9, 1e-9, 1e-9]), np.ones(6) / 6),  # peaked
        (p, p + np.array([1e-8, -1e-8, 0, 0, 0, 0])),  # residual mass 1e-8
    ]
    return pairs


@pytest.mark.parametrize("pair", edge_pairs())
def test_analytic_identity_recovers_target(pair):
    p, q = (torch.tensor(x, dtype=torch.float64) for x in pair)
    out = single_step_output(p, q)
    if torch.minimum(p, q).sum() < 1 - 1e-12:  # the identity is exact whenever p != q
        assert torch.allclose(out, p, atol=1e-6)
    assert torch.isfinite(out).all()


def test_analytic_identity_negative_control():
    """Resampling from p instead of the residual breaks the identity."""
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03], dtype=torch.float64)
    q = torch.tensor([0.10, 0.10, 0.30, 0.30, 0.15, 0.05], dtype=torch.float64)
    broken = torch.minimum(p, q) + (1 - torch.minimum(p, q).sum()) * p
    assert not torch.allclose(broken, p, atol=1e-3)
    assert torch.allclose(single_step_output(p, q), p, atol=1e-12)


def random_block(batch, gamma, vocab, generator, point_mass=False, peaked=False):
    scale = 8.0 if peaked else 1.5
    t_logits = torch.randn(batch, gamma + 1, vocab, generator=generator) * scale
    d_logits = t_logits[:, :gamma] + torch.randn(batch, gamma, vocab, generator=generator)
    target = torch.softmax(t_logits, -1)
    draft = torch.softmax(d_logits, -1)
    tokens = torch.multinomial(draft.reshape(-1, vocab), 1, generator=generator)
    tokens = tokens.reshape(batch, gamma)
    return tokens, (None if point_mass else draft), target


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("peaked", [False, True])
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_fast_verify_matches_reference(point_mass, peaked, gamma):
    g = torch.Generator().manual_seed(11 + gamma)
    tokens, draft, target = random_block(64, gamma, 12, g, point_mass, peaked)
    u_accept = torch.rand(64, gamma, generator=g)
    u_sample = torch.rand(64, generator=g, dtype=torch.float64)
    fast = verify_from_uniforms(tokens, draft, target, u_accept, u_sample)
    slow = verify_reference(tokens, draft, target, u_accept, u_sample)
    assert [fast.emitted(b) for b in range(64)] == slow


def test_verify_edges_no_nan_and_rules():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
    # p == q: always accepted, bonus drawn, never NaN.
    same = verify(torch.tensor([[2, 0]]), p.expand(1, 2, 6).clone(), p.expand(1, 3, 6).clone(), g)
    assert int(same.num_accepted[0]) == 2 and min(same.emitted()) >= 0
    # Drafted token with p(x) = 0 is never accepted and never recovered.
    zero = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0, 0.0])
    for _ in range(50):
        r = verify(torch.tensor([[3]]), torch.ones(1, 1, 6) / 6, zero.expand(1, 2, 6).clone(), g)
        assert int(r.num_accepted[0]) == 0 and r.emitted()[0] in (1, 2)
    # q(x) = 0 where p(x) > 0 (e.g. a point-mass draft elsewhere): always accepted.
    q0 = torch.tensor([[[0.0, 0.2, 0.2, 0.2, 0.2, 0.2]]])
    r = verify(torch.tensor([[0]]), q0, p.expand(1, 2, 6).clone(), g)
    assert int(r.num_accepted[0]) == 1
    # Point-mass draft: the recovered token is never the rejected drafted token.
    for _ in range(50):
        r = verify(torch.tensor([[0]]), None, p.expand(1, 2, 6).clone(), g)
        if int(r.num_accepted[0]) == 0:
            assert r.emitted()[0] != 0


def test_residual_with_float32_rounding_is_finite():
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([[[0.5, 0.5 - 1e-8, 1e-8]] * 2])  # [1, 2, 3]
    q = torch.tensor([[[0.5, 0.5, 0.0]]])
    for _ in range(100):
        r = verify(torch.tensor([[1]]), q, p, g)
        assert all(0 <= t < 3 for t in r.emitted())


def test_sample_from_never_returns_zero_weight():
    weights = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0]] * 4)
    tokens = sample_from(
        weights, torch.tensor([0.0, 0.3, 0.9999999, 1 - 1e-16], dtype=torch.float64)
    )
    assert set(tokens.tolist()) <= {1, 3}


def test_greedy_verify_is_argmax_prefix():
    logits = torch.tensor([[[0, 5, 1.0], [3, 0, 0], [0, 0, 9], [1, 0, 0]]])  # [1, 4, 3]
    r = verify_greedy(torch.tensor([[1, 0, 1]]), logits)
    assert r.emitted() == [1, 0, 2]  # two accepted, third replaced by argmax
    r = verify_greedy(torch.tensor([[1, 0, 2]]), logits)
    assert r.emitted() == [1, 0, 2, 0]  # all accepted plus the bonus argmax


def test_logits_to_probs_processing():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    greedy = logits_to_probs(logits, SamplingParams(temperature=0))
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    top2 = logits_to_probs(logits, SamplingParams(top_k=2))
    assert (top2[0, 2:] == 0).all() and torch.isclose(top2.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)
    nucleus = logits_to_probs(logits, SamplingParams(top_p=0.8))
    kept = (nucleus > 0).sum().item()
    assert full[0, : kept - 1].sum() < 0.8 <= full[0, :kept].sum()
    hot = logits_to_probs(logits, SamplingParams(temperature=0.5))
    assert hot[0, 0] > full[0, 0]


def test_nucleus_matches_the_full_sort_reference():
    """The partial-sort nucleus equals a full sort's, ties at the cut included, for
    peaked rows (found above the first cutoff) and flat ones (the cutoff lowered)."""
    from speculative.sampling.probs import nucleus_threshold
    from speculative.sampling.reference import nucleus_threshold_reference

    generator = torch.Generator().manual_seed(5)
    peaked = torch.randn(3, 5000, generator=generator) * 4
    flat = torch.randn(2, 5000, generator=generator) * 0.1
    tied = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0, -2.0]])  # the cut falls inside a tie
    for logits in (peaked, flat, tied):
        probs = torch.softmax(logits, dim=-1)
        for top_p in (0.3, 0.8, 0.95):
            fast = nucleus_threshold(probs, top_p)[:, 0]
            slow = [nucleus_threshold_reference(row.tolist(), top_p) for row in probs]
            assert fast.tolist() == slow, (top_p, fast.tolist(), slow)
    flat_probs = torch.softmax(flat, dim=-1)
    assert (flat_probs >= nucleus_threshold(flat_probs, 0.95)).sum(-1).min() > 4000
    kept = logits_to_probs(tied, SamplingParams(top_p=0.7)) > 0  # 3.0 has 0.64 of the mass
    assert kept[0].tolist() == [True, True, True, True, False, False]


def test_short_float64_rows_take_the_nucleus_in_python_as_the_full_sort_does():
    """Rows of at most 64 float64 probabilities (a small vocabulary, a top-k cut) find
    their nucleus in plain Python: the same threshold as the full-sort reference and
    every token at or above it, ties at the cut and zero-probability tokens included."""
    from speculative.sampling.probs import SMALL_DRAW, _row_nucleus
    from speculative.sampling.reference import nucleus_threshold_reference

    generator = torch.Generator().manual_seed(7)
    rows = [
        torch.randn(n, generator=generator, dtype=torch.float64) * scale
        for n in (1, 2, 5, 20, SMALL_DRAW)
        for scale in (0.1, 1.0, 4.0)
    ]
    rows.append(torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0, -2.0], dtype=torch.float64))  # a tie
    rows.append(torch.tensor([0.0, float("-inf"), 2.0, float("-inf")], dtype=torch.float64))
    for logits in rows:
        probs = torch.softmax(logits, dim=-1).numpy()  # [n] float64
        for top_p in (0.3, 0.8, 0.95, 1.0):
            found = _row_nucleus(probs, top_p)
            want = nucleus_threshold_reference(probs.tolist(), top_p)
            assert float(found.threshold) == want, (probs.size, top_p)
            assert found.kept.tolist() == [i for i, p in enumerate(probs) if p >= want]


def test_short_rows_in_a_block_take_each_rows_nucleus_bit_for_bit():
    """A block of short rows (a small vocabulary: the nucleus in whole-array steps) gives
    every row's float32 bits as that row's own nucleus and renormalization do, for peaked,
    flat and tied rows, masked tokens, and cuts inside a tie; a block with a NaN takes the
    per-row path."""
    from speculative.sampling.probs import (
        SMALL_DRAW,
        SMALL_NUCLEI_ROWS,
        _renormalized_nucleus,
        cut_probs,
        nucleus_probs,
    )

    generator = torch.Generator().manual_seed(11)
    for vocab in (2, 20, SMALL_DRAW):
        for scale in (0.1, 1.0, 5.0, 20.0):
            logits = torch.randn(64 * SMALL_NUCLEI_ROWS, vocab, generator=generator) * scale
            logits[::3] = logits[::3].round()  # ties, and cuts inside them
            logits[1::4, vocab // 2] = float("-inf")
            for top_p in (0.1, 0.5, 0.9, 1 - 1e-7):
                block = nucleus_probs(logits, top_p)
                probs = cut_probs(logits).numpy()
                for row, (values, masses) in enumerate(zip(logits.numpy(), probs, strict=True)):
                    alone = _renormalized_nucleus(values, masses, top_p)
                    want = torch.from_numpy(alone.dense(vocab).numpy())
                    assert torch.equal(block[row], want), (vocab, scale, top_p, row)
    broken = torch.randn(SMALL_NUCLEI_ROWS, 20, generator=generator)
    broken[0, 3] = float("nan")

    def outcome(logits: torch.Tensor) -> object:
        try:
            return torch.isnan(nucleus_probs(logits, 0.9)).any().item()
        except ValueError as error:
            return type(error)

    assert outcome(broken) == outcome(broken[0])  # the block falls back to the row's path


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_bad_sampling_params(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "probs, fragment",
    [
        ([0.5, -0.1, 0.6], "negative"),
        ([0.5, float("nan"), 0.5], "NaN"),
        ([0.5, 0.4, 0.0], "sum"),
    ],
)
def test_bad_distributions(probs, fragment):
    with pytest.raises(ValueError, match=fragment):
        check_probs(torch.tensor(probs), "p")
    with pytest.raises(ValueError, match=fragment):
        speculative_step(np.array(probs), np.ones(3) / 3, np.random.default_rng(0))


def test_bad_block_shapes():
    g = torch.Generator().manual_seed(0)
    p = torch.ones(1, 3, 4) / 4
    with pytest.raises(ValueError, match="vocab"):
        verify(torch.tensor([[0, 1]]), torch.ones(1, 2, 5) / 5, p, g)
    with pytest.raises(ValueError, match="gamma"):
        verify(torch.tensor([[0]]), None, p, g)
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_step(np.ones(3) / 3, np.ones(4) / 4, np.random.default_rng(0))
