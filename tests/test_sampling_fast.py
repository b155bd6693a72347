"""The fast sampling paths equal their references bit for bit (torch.equal): the numpy
nucleus and mask, support-only inverse-CDF sampling, the numpy greedy check, and the
row-at-a-time verification from logits that the engine runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speculative.sampling import (
    SamplingParams,
    VerifyUniforms,
    logits_to_probs,
    residual,
    sample_from,
    sample_row,
    verify,
    verify_greedy,
    verify_greedy_row,
    verify_logits,
)
from speculative.sampling.probs import (
    RowProbs,
    float32,
    mask_top_k,
    mask_top_p,
    nucleus_probs,
    nucleus_threshold,
    row_probs,
    top_k_ids,
)


def logits_like_a_model(rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """[rows, vocab] logits from peaked (a few likely tokens) to flat, plus exact ties."""
    scales = torch.tensor([8.0, 4.0, 1.0, 0.2])[torch.arange(rows) % 4]
    logits = torch.randn(rows, vocab, generator=generator) * scales[:, None]
    logits[:, 7] = logits[:, 3]  # a tie (the argmax's first index, the nucleus cut)
    return logits


PARAMS = [
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(temperature=1.3, top_k=50, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02),
]


def test_mask_top_p_equals_masked_fill():
    """The nucleus is cut on float64 masses; the float32 softmax's cut differs at a top_p
    this close to 1 (its masses stray by ~1e-5), so the test can tell the two apart."""
    generator = torch.Generator().manual_seed(0)
    logits = logits_like_a_model(8, 3000, generator)
    for top_p in (0.1, 0.9, 0.95, 1 - 1e-7):
        probs = torch.softmax(logits, -1, dtype=torch.float64)
        want = logits.masked_fill(probs < nucleus_threshold(probs, top_p), float("-inf"))
        assert torch.equal(mask_top_p(logits, top_p), want)
    probs32 = torch.softmax(logits, -1)  # a cut on the float32 masses
    cut32 = logits.masked_fill(probs32 < nucleus_threshold(probs32, 1 - 1e-7), float("-inf"))
    assert not torch.equal(mask_top_p(logits, 1 - 1e-7), cut32)


def test_top_k_ids_are_the_tokens_mask_top_k_keeps():
    """The search near the top finds exactly mask_top_k's survivors: ties at the k-th
    value, -inf entries, fewer finite entries than k, k at or past the vocabulary, and a
    row spread over hundreds of units (the search widens many times); a row with a NaN or
    +inf is left to the mask (None). A search that kept exactly k ids would drop the tie."""
    generator = torch.Generator().manual_seed(12)
    rows = list(logits_like_a_model(8, 3000, generator) / 0.05)  # T = 0.05: widely spread
    tie = torch.randn(3000, generator=generator)
    tie[[10, 11, 12]] = tie.topk(20).values[19]  # three more tokens at the 20th value
    few = torch.full((3000,), float("-inf"))
    few[:10] = torch.randn(10, generator=generator)  # 10 finite entries, k = 20
    rows += [tie, few]
    for row in rows:
        for k in (1, 20, 2999, 3000, 5000):
            want = np.flatnonzero((mask_top_k(row, k) > float("-inf")).numpy())
            if k >= 3000 or int(torch.isfinite(row).sum()) < k:
                want = np.arange(3000)  # the k-th largest is -inf (or none): no mask
            assert np.array_equal(top_k_ids(row.numpy(), k), want), k
    assert top_k_ids(tie.numpy(), 20).size == 23  # 19 above the 20th value, 4 holding it
    for bad in (float("nan"), float("inf")):
        broken = tie.clone()
        broken[5] = bad
        assert top_k_ids(broken.numpy(), 20) is None


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_top_k_probs_are_the_masked_softmax_on_the_kept_tokens(top_p):
    """A top-k row is softmax(mask_top_k(logits / T)) (then its top-p nucleus) to float
    rounding, with exactly its support, summed over the kept tokens alone; a row with a
    NaN still takes the masked softmax (and stays NaN for the checks to report). The row
    without the cut differs (the control)."""
    generator = torch.Generator().manual_seed(13)
    logits = logits_like_a_model(8, 3000, generator)
    params = SamplingParams(temperature=0.7, top_k=30, top_p=top_p)
    masked = mask_top_k(logits / 0.7, 30)
    want = torch.softmax(mask_top_p(masked, top_p) if top_p < 1 else masked, -1)
    got = logits_to_probs(logits, params)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(got, torch.softmax(logits / 0.7, -1), atol=1e-3)
    if top_p == 1.0:
        broken = logits[0].clone()
        broken[9] = float("nan")
        assert torch.isnan(logits_to_probs(broken, params)).any()


def test_nucleus_probs_is_the_masked_softmax_renormalized_on_the_nucleus():
    """nucleus_probs gives softmax(mask_top_p(logits)) (the definition) to float rounding,
    with exactly its support; a row's bits do not depend on the other rows of the call.
    A renormalization over the whole vocabulary (the nucleus not cut) is caught."""
    generator = torch.Generator().manual_seed(3)
    logits = logits_like_a_model(8, 3000, generator)
    for top_p in (0.1, 0.9, 0.95, 1 - 1e-7):
        want = torch.softmax(mask_top_p(logits, top_p), -1)
        got = nucleus_probs(logits, top_p)
        assert torch.equal(got > 0, want > 0), top_p
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        for row in range(logits.shape[0]):
            assert torch.equal(nucleus_probs(logits[row], top_p), got[row])
    uncut = torch.softmax(logits, -1)  # a sampler that forgot the nucleus
    assert not torch.allclose(nucleus_probs(logits, 0.9), uncut, atol=1e-3)


def test_sample_row_equals_sample_from():
    """Sparse (a nucleus) and dense weights, uniforms up to the largest below 1 (where
    u * total rounds up to the total and the last positive weight is drawn)."""
    generator = torch.Generator().manual_seed(1)
    uniforms = [0.0, 0.25, 0.5, 0.999999, 1 - 2**-53]
    uniforms += torch.rand(40, generator=generator, dtype=torch.float64).tolist()
    logits = logits_like_a_model(8, 5000, generator)
    for params in (SamplingParams(0.8, top_p=0.95), SamplingParams(1.0), SamplingParams(0.7)):
        for weights in logits_to_probs(logits, params):
            weights = weights.clone()
            weights[-3:] = 0.0  # zero weight at the end of the vocabulary
            for u in uniforms:
                want = sample_from(weights[None], torch.tensor([u], dtype=torch.float64))
                assert sample_row(weights, u) == int(want[0]), (params, u)


def test_small_row_draw_is_sample_from_bit_for_bit():
    """Rows of up to SMALL_DRAW entries draw in plain Python: the token sample_from gives
    on the dense row they stand for, zeros inside the row (a residual) and uniforms up to
    the largest below 1 included. A draw that forgot to skip zero entries is caught."""
    from speculative.sampling.probs import SMALL_DRAW

    generator = torch.Generator().manual_seed(9)
    uniforms = [0.0, 0.5, 0.999999, 1 - 2**-53]
    uniforms += torch.rand(30, generator=generator, dtype=torch.float64).tolist()
    for size in (1, 2, 7, SMALL_DRAW):
        for trial in range(4):
            support = torch.randperm(1000, generator=generator)[:size].sort().values.numpy()
            values = torch.rand(size, generator=generator) ** 4
            values[torch.rand(size, generator=generator) < 0.3] = 0.0  # a residual's zeros
            values[trial % size] = 0.5  # at least one positive entry
            row = RowProbs(values.numpy(), support)
            for u in uniforms:
                want = sample_from(dense(row, 1000)[None], torch.tensor([u], dtype=torch.float64))
                assert row.draw(u) == int(want[0]), (size, trial, u)
    zero_last = RowProbs(np.array([0.5, 0.5, 0.0], dtype=np.float32), np.array([1, 2, 3]))
    assert zero_last.draw(1 - 2**-53) == 2  # never the zero-weight token 3


def dense(row: RowProbs, vocab: int) -> torch.Tensor:
    """A RowProbs as the [vocab] row it stands for."""
    out = torch.zeros(vocab)
    index = torch.arange(vocab) if row.support is None else torch.from_numpy(row.support)
    out[index] = torch.from_numpy(row.values)
    return out


@pytest.mark.parametrize("params", [*PARAMS, SamplingParams(0.0)], ids=str)
def test_row_probs_is_logits_to_probs_row_bit_for_bit(params):
    """The sparse row (a nucleus where top-p cuts one) stands for logits_to_probs's row
    exactly; its p(x) and its residual are the dense ones' bits, and a residual that
    forgot to remove the drafted token (the point-mass rule) is caught."""
    generator = torch.Generator().manual_seed(5)
    logits = logits_like_a_model(8, 3000, generator)
    want = logits_to_probs(logits, params)  # [8, vocab]
    for row in range(logits.shape[0]):
        got = row_probs(logits[row], params)
        assert torch.equal(dense(got, 3000), want[row])
        token = int(want[row].argmax())
        assert got.prob(token) == want[row, token] and got.prob(token) > 0
        without = want[row].clone()
        without[token] = 0.0
        assert torch.equal(dense(got.residual(token, None), 3000), without)
        q = torch.softmax(logits[row] + torch.randn(3000, generator=generator), -1)
        assert torch.equal(dense(got.residual(token, q.numpy()), 3000), residual(want[row], q))
        assert not torch.equal(dense(got, 3000), without)  # the control: token still in


def test_row_probs_takes_a_found_row_and_falls_back_without_one():
    """A search's answer (the native kernels' nucleus) is the row; None leaves the sampling
    layer's own row, bit for bit; under a top-k cut the search is not asked (it cuts
    without top-k); greedy never asks."""
    generator = torch.Generator().manual_seed(6)
    logits = logits_like_a_model(4, 3000, generator)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    marker = RowProbs(np.ones(1, dtype=np.float32), np.array([5]))
    asked = []

    def search(row: torch.Tensor, temperature: float, top_p: float) -> RowProbs:
        asked.append((temperature, top_p))
        return marker

    for row in logits:
        assert row_probs(row, params, search) is marker
        want = dense(row_probs(row, params), 3000)
        assert torch.equal(dense(row_probs(row, params, lambda *args: None), 3000), want)
    assert asked == [(0.8, 0.9)] * 4
    row_probs(logits[0], SamplingParams(temperature=0.8, top_p=0.9, min_p=0.1), search)
    assert asked == [(0.8, 0.9)] * 4  # the search cuts no min-p
    row_probs(logits[0], SamplingParams(temperature=0.8, top_k=50, top_p=0.9), search)
    row_probs(logits[0], SamplingParams(temperature=0, top_p=0.9), search)
    assert len(asked) == 4


def torch_verify_greedy(drafts: torch.Tensor, logits: torch.Tensor) -> tuple:
    """The previous torch implementation of verify_greedy (the reference)."""
    gamma = drafts.shape[1]
    best = logits.argmax(dim=-1)
    num_accepted = (drafts == best[:, :gamma]).int().cumprod(dim=-1).sum(dim=-1)
    positions = torch.arange(gamma + 1).unsqueeze(0)
    return num_accepted, torch.where(positions <= num_accepted.unsqueeze(-1), best, -1)


def test_verify_greedy_equals_the_torch_argmax_prefix():
    generator = torch.Generator().manual_seed(2)
    for gamma in (0, 1, 4):
        logits = logits_like_a_model(3 * (gamma + 1), 1000, generator).view(3, gamma + 1, -1)
        logits[0, :, 3] = logits[0].max(-1).values  # ties with index 7: the first wins
        logits[0, :, 7] = logits[0, :, 3]
        best = logits.argmax(-1)
        drafts = best[:, :gamma].clone()
        drafts[1, gamma // 2 :] = 5  # row 1 rejects halfway (or accepts all when γ <= 1)
        result = verify_greedy(drafts, logits)
        num_accepted, tokens = torch_verify_greedy(drafts, logits)
        assert torch.equal(result.num_accepted, num_accepted)
        assert torch.equal(result.tokens, tokens)
        for row in range(3):  # one row from its argmax ids, in plain Python
            one = verify_greedy_row(drafts[row].tolist(), best[row].tolist())
            assert torch.equal(one.num_accepted, num_accepted[row : row + 1])
            assert torch.equal(one.tokens, tokens[row : row + 1])
            assert one.emitted(0) == result.emitted(row)
            assert one.accepted_count(0) == int(num_accepted[row])
    with pytest.raises(ValueError, match="γ \\+ 1"):
        verify_greedy_row([1, 2], [1, 2])


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
@pytest.mark.parametrize("drafter", ["point-mass", "model"])
def test_verify_logits_equals_verify_of_the_processed_block(params, drafter):
    """Same accepted count, same tokens, and the generator left in the same state (the
    same uniforms were drawn), for drafts the target likes, dislikes and half likes."""
    generator = torch.Generator().manual_seed(3)
    vocab = 2000
    for trial in range(24):
        gamma = trial % 5
        logits = logits_like_a_model(gamma + 1, vocab, generator)[None]  # [1, γ+1, V]
        probs = logits_to_probs(logits, params)
        draft_probs = None
        if drafter == "model":  # q: the target's distribution, perturbed
            noisy = logits[:, :gamma] + torch.randn(1, gamma, vocab, generator=generator)
            draft_probs = logits_to_probs(noisy, params)
            tokens = [int(torch.multinomial(q, 1, generator=generator)) for q in draft_probs[0]]
        elif trial % 3 == 0:  # the target's likeliest tokens: mostly accepted
            tokens = probs[0, :gamma].argmax(-1).tolist()
        else:  # arbitrary tokens: mostly rejected (p = 0 outside the nucleus)
            tokens = torch.randint(0, vocab, (gamma,), generator=generator).tolist()
        seed = 100 + trial
        fast_generator = torch.Generator().manual_seed(seed)
        slow_generator = torch.Generator().manual_seed(seed)
        fast = verify_logits(tokens, draft_probs, logits, params, fast_generator)
        drafted = torch.tensor([tokens], dtype=torch.long).reshape(1, -1)
        slow = verify(drafted, draft_probs, probs, slow_generator, validate=False)
        assert torch.equal(fast.num_accepted, slow.num_accepted), trial
        assert torch.equal(fast.tokens, slow.tokens), trial
        assert torch.equal(
            torch.rand(3, generator=fast_generator), torch.rand(3, generator=slow_generator)
        )
        if draft_probs is not None:  # the same q as sparse rows (a head's Draft.rows)
            rows = [sparse_row(q) for q in draft_probs[0]]
            again = torch.Generator().manual_seed(seed)
            sparse = verify_logits(tokens, rows, logits, params, again)
            assert torch.equal(sparse.tokens, slow.tokens), trial


def sparse_row(q: torch.Tensor) -> RowProbs:
    """[vocab] probabilities -> their nonzero entries as a RowProbs."""
    support = torch.nonzero(q).flatten()
    return RowProbs(q[support].numpy(), support.numpy())


def test_sparse_q_rows_read_as_the_dense_row():
    """RowProbs.at reads a sparse row's values (0 off its support) as indexing the dense
    row does; on_ids moves a draft-vocabulary row onto target ids as the scatter
    (to_full_vocab) does; a dense p's residual against a sparse q is the one against the
    dense q (bitwise)."""
    from speculative.drafters.head_common import to_full_vocab

    generator = torch.Generator().manual_seed(0)
    vocab = 500
    q = torch.softmax(torch.randn(vocab, generator=generator) * 3, -1)
    q[torch.rand(vocab, generator=generator) < 0.8] = 0.0  # a sparse q
    row = sparse_row(q)
    ids = torch.randperm(vocab, generator=generator)[:60].sort().values.numpy()
    assert np.array_equal(row.at(ids), q.numpy()[ids])
    draft_to_target = torch.randperm(4 * vocab, generator=generator)[:vocab]  # [N] distinct
    full = to_full_vocab(q[None], draft_to_target, 4 * vocab)[0]  # [4 * vocab]
    moved = row.on_ids(draft_to_target.numpy())
    assert torch.equal(moved.dense(4 * vocab), full)
    assert np.all(np.diff(moved.support) > 0)
    p = RowProbs(torch.softmax(torch.randn(4 * vocab, generator=generator), -1).numpy())
    token = int(moved.support[0])
    assert np.array_equal(p.residual(token, moved).values, p.residual(token, full.numpy()).values)


def test_float32_rounds_sums_and_products_as_numpy():
    """float32(a op b) for float32 operands is numpy's float32 result, for products,
    differences and sums of probabilities over many magnitudes; the unrounded float64
    result differs for most of them (the control)."""
    generator = torch.Generator().manual_seed(21)
    a = (torch.rand(4000, generator=generator, dtype=torch.float64) ** 8).float().numpy()
    b = (torch.rand(4000, generator=generator, dtype=torch.float64) ** 3).float().numpy()
    unrounded = 0
    for x, y in zip(a.tolist(), b.tolist(), strict=True):
        fx, fy = np.float32(x), np.float32(y)
        assert float32(x * y) == float(fx * fy)
        assert float32(x - y) == float(fx - fy)
        assert float32(x + y) == float(fx + fy)
        unrounded += x * y != float(fx * fy)
    assert unrounded > 2000


def test_rows_from_lists_read_as_rows_from_arrays():
    """A row built from Python lists (as the kernels' top-p search returns it) answers
    every read as the same row built from numpy arrays, bit for bit: p(x), the residual
    against a point mass, a sparse q (of lists or arrays, small or not) and a dense q,
    the mass, the draw, ``at`` and ``on_ids``. A residual taken in float64 without the
    float32 rounding differs (the control)."""
    generator = torch.Generator().manual_seed(22)
    vocab = 3000
    for size in (1, 5, 40):
        for trial in range(5):
            support = torch.randperm(vocab, generator=generator)[:size].sort().values
            values = torch.softmax(torch.randn(size, generator=generator) * 3, -1)
            arrays = RowProbs(values.numpy(), support.numpy())
            lists = RowProbs.of_lists(values.tolist(), support.tolist())
            assert np.array_equal(lists.values, arrays.values)
            assert np.array_equal(lists.support, arrays.support)
            token = int(support[trial % size])
            assert lists.prob(token) == arrays.prob(token) == float(values[trial % size])
            assert lists.prob(vocab) == 0.0
            q = torch.softmax(torch.randn(vocab, generator=generator) * 2, -1)
            q[support[: size // 2]] = values[: size // 2] * 1.5  # some q above p: clamped
            wide = sparse_row(torch.where(torch.rand(vocab, generator=generator) < 0.5, q, 0))
            for q_row in (None, q.numpy(), sparse_row(q), wide, _as_lists(sparse_row(q))):
                want = arrays.residual(token, q_row)
                got = lists.residual(token, q_row)
                assert np.array_equal(got.values, want.values), (size, trial)
                assert np.array_equal(got.support, want.support)
                assert got.mass() == want.mass()
            for u in torch.rand(20, generator=generator, dtype=torch.float64).tolist():
                assert lists.draw(u) == arrays.draw(u)
            ids = torch.randperm(vocab, generator=generator)[:30].sort().values.numpy()
            assert np.array_equal(lists.at(ids), arrays.at(ids))
            moved_ids = torch.randperm(4 * vocab, generator=generator)[:vocab].numpy()
            moved = lists.on_ids(moved_ids, moved_ids.tolist())
            want = arrays.on_ids(moved_ids)
            assert np.array_equal(moved.values, want.values)
            assert np.array_equal(moved.support, want.support)
    p = RowProbs.of_lists([float32(0.3), float32(0.7)], [4, 9])
    q = RowProbs.of_lists([float32(0.1)], [9])
    unrounded = [p.prob(4), p.prob(9) - q.prob(9)]  # float64 differences: not numpy's
    assert p.residual(4, q).values.tolist() != unrounded


def _as_lists(row: RowProbs) -> RowProbs:
    return RowProbs.of_lists(row.values.tolist(), row.support.tolist())


def test_uniforms_drawn_ahead_verify_as_drawn_inside():
    """verify_logits given the uniforms drawn ahead from a generator returns what it
    returns drawing them itself from a generator in the same state, and both generators
    end in the same state; a draw for another γ is refused."""
    generator = torch.Generator().manual_seed(23)
    params = SamplingParams(0.8, top_p=0.95)
    for seed in range(20):
        logits = logits_like_a_model(4, 500, generator)[None]  # [1, 4, vocab]
        tokens = torch.randint(0, 500, (3,), generator=generator).tolist()
        tokens[0] = int(logits[0, 0].argmax())
        inside, ahead = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        want = verify_logits(tokens, None, logits, params, inside)
        drawn = VerifyUniforms.draw(3, ahead)
        got = verify_logits(tokens, None, logits, params, torch.Generator(), uniforms=drawn)
        assert torch.equal(got.tokens, want.tokens), seed
        assert torch.equal(torch.rand(2, generator=inside), torch.rand(2, generator=ahead))
    with pytest.raises(ValueError, match="accept uniforms"):
        short = VerifyUniforms(drawn.accepts[:2], drawn.sample)
        verify_logits(tokens, None, logits, params, torch.Generator(), uniforms=short)


def test_verify_logits_on_the_full_vocabulary_size():
    """A 49,152-entry vocabulary (the default model's): the sparse sampler over a nucleus
    and the dense fallback without top-p."""
    generator = torch.Generator().manual_seed(4)
    for params in (SamplingParams(0.8, top_p=0.95), SamplingParams(1.0)):
        for seed in range(6):
            logits = logits_like_a_model(4, 49152, generator)[None]
            tokens = torch.randint(0, 49152, (3,), generator=generator).tolist()
            tokens[0] = int(logits[0, 0].argmax())
            fast = verify_logits(tokens, None, logits, params, torch.Generator().manual_seed(seed))
            slow = verify(
                torch.tensor([tokens]),
                None,
                logits_to_probs(logits, params),
                torch.Generator().manual_seed(seed),
                validate=False,
            )
            assert torch.equal(fast.tokens, slow.tokens)


def test_verify_logits_rejects_mismatched_shapes():
    logits = torch.zeros(1, 3, 10)
    with pytest.raises(ValueError, match="logits must be"):
        verify_logits([1], None, logits, SamplingParams(1.0), torch.Generator())
    with pytest.raises(ValueError, match="draft_probs must be"):
        verify_logits([1, 2], torch.zeros(1, 2, 9), logits, SamplingParams(1.0), torch.Generator())
    one = RowProbs(np.ones(1, dtype=np.float32), np.array([3]))
    with pytest.raises(ValueError, match="sparse q rows"):
        verify_logits([1, 2], [one], logits, SamplingParams(1.0), torch.Generator())


def test_penalties_follow_the_documented_formulas() -> None:
    """Repetition divides a seen token's positive logit by r and multiplies a negative one
    (prompt and output tokens); frequency and presence subtract f * count + p (output
    tokens only); each row adds its own extra tokens to the output."""
    from speculative.sampling.penalties import Penalties, apply_penalties

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]] * 2)
    penalties = Penalties(presence=0.5, frequency=0.25, repetition=2.0)
    out = apply_penalties(logits, prompt=[1], output=[2, 2], extras=[[], [3]], penalties=penalties)
    expected = torch.tensor(
        [
            [2.0, -2.0, 0.25 - 0.5 - 0.5, 3.0, -2.0],  # token 1: prompt; token 2: twice
            [2.0, -2.0, 0.25 - 0.5 - 0.5, 1.5 - 0.25 - 0.5, -2.0],  # + token 3 once
        ]
    )
    assert torch.allclose(out, expected)
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0]))  # a copy
    assert not Penalties().active and Penalties(repetition=1.1).active
    with pytest.raises(ValueError, match="repetition penalty must be > 0"):
        Penalties(repetition=0)
    # a logit bias, before the penalties: token 3 becomes 3 + 1 = 4, then 4 / 2
    biased = Penalties(repetition=2.0, bias=((3, 1.0), (0, -5.0)))
    out = apply_penalties(logits[:1], prompt=[3], output=[], extras=[[]], penalties=biased)
    assert torch.allclose(out, torch.tensor([[-3.0, -1.0, 0.5, 2.0, -2.0]]))
    with pytest.raises(ValueError, match="biased twice"):
        Penalties(bias=((3, 1.0), (3, 2.0)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        apply_penalties(logits, [], [], [[], []], Penalties(bias=((9, 1.0),)))


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_likeliest():
    """min_p's cut against float64 probability ratios (tokens within 1e-4 of the boundary
    left aside), renormalized; the same distribution from the sparse top-k path."""
    generator = torch.Generator().manual_seed(12)
    logits = logits_like_a_model(6, 3000, generator)
    for min_p in (0.01, 0.1, 0.5):
        params = SamplingParams(temperature=0.9, min_p=min_p)
        probs = logits_to_probs(logits, params)  # [6, vocab]
        exact = torch.softmax(logits.double() / 0.9, dim=-1)
        ratio = exact / exact.max(dim=-1, keepdim=True).values
        clear = (ratio - min_p).abs() > 1e-4
        assert torch.equal((probs > 0)[clear], (ratio >= min_p)[clear])
        kept = torch.where(ratio >= min_p, exact, torch.zeros_like(exact))
        assert torch.allclose(probs.double(), kept / kept.sum(-1, keepdim=True), atol=1e-6)
        assert (probs > 0).sum() < (logits_to_probs(logits, SamplingParams(0.9)) > 0).sum()
        wide = SamplingParams(temperature=0.9, top_k=2999, min_p=min_p)  # the sparse path
        sparse = logits_to_probs(logits, wide)  # the same tokens, renormalized over them
        cut = (probs > 0).sum(-1) < 2999  # rows where the top-k does not cut first
        assert cut.any() and torch.equal(sparse[cut] > 0, probs[cut] > 0)
        assert torch.allclose(sparse[cut], probs[cut], atol=1e-6)
    with pytest.raises(ValueError, match="min_p must be in"):
        SamplingParams(min_p=1.0)


def test_a_growing_penalty_history_penalizes_as_one_built_at_once():
    """A history extended round by round (new tokens, prompt tokens, repeats, with
    applications between that cache its columns) gives the bits of one built from the
    whole output; a history that missed a round does not."""
    from speculative.sampling.penalties import Penalties, PenaltyHistory, apply_penalties

    generator = torch.Generator().manual_seed(13)
    logits = logits_like_a_model(3, 500, generator)
    penalties = Penalties(presence=0.4, frequency=0.3, repetition=1.3)
    prompt = [5, 9, 9, 40]
    rounds = [[7], [9, 7, 100], [5], [300, 300, 7], [41]]
    extras = [[], [7], [7, 2]]
    history, output = PenaltyHistory(prompt, penalties), []
    for tokens in rounds:
        history.extend(tokens)
        output += tokens
        want = apply_penalties(logits, prompt, output, extras, penalties)
        assert torch.equal(history.apply(logits, extras), want)
    missed = PenaltyHistory(prompt, penalties)
    for tokens in rounds[:-2] + rounds[-1:]:
        missed.extend(tokens)
    assert not torch.equal(missed.apply(logits, extras), want)
