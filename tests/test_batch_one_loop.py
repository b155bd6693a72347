"""One loop for one and many rows: tree rows batched on slots, the transformers runtime's
batched verification, and chunked prefill.

Every row is compared, as lists of token ids, with the single-sequence engine
(SpeculativeEngine: a batch of one on the model's own cache) run alone on the same model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from speculative.drafters.base import Drafter
from speculative.drafters.model import DraftModelDrafter
from speculative.drafters.ngram import PromptLookupDrafter
from speculative.drafters.tree import TreeShape
from speculative.engine import BatchEngine, BatchRequest, SpeculativeEngine, StopCriteria
from speculative.engine.tree import TreeRound
from speculative.models.base import RowInput
from speculative.models.hf import HFCausalLM
from speculative.models.native import load_native
from speculative.models.session import SlotPool
from speculative.sampling import SamplingParams
from test_native import VOCAB, _ids, _tiny_llama, require_kernels
from tiny import tiny_llama

GREEDY = SamplingParams(temperature=0)
WARM = SamplingParams(temperature=0.9, top_p=0.95)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_one_loop")
    _tiny_llama(path, layers=2)
    return path


@dataclass(frozen=True)
class Row:
    """One row: prompt, drafter kind, γ, tree shape (None: chains), params, seed, budget."""

    prompt: list[int]
    drafter: str  # "none", "ngram", "model"
    gamma: int
    tree: TreeShape | None
    params: SamplingParams
    seed: int
    max_new_tokens: int


def _prompts() -> list[list[int]]:
    base = _ids(40, 77)[0].tolist()
    loop = base[:5] * 5  # repetitive: the n-gram drafter finds continuations
    return [loop, base[:4], base[10:27], base[3:9], loop[:12]]


def _rows() -> list[Row]:
    p = _prompts()
    static, dynamic = (
        TreeShape("static", branching=(2, 2, 1)),
        TreeShape("dynamic", depth=4, width=2),
    )
    return [
        Row(p[0], "ngram", 4, None, GREEDY, 0, 18),
        Row(p[1], "model", 3, static, GREEDY, 1, 14),
        Row(p[2], "none", 0, None, SamplingParams(temperature=1.0), 2, 10),
        Row(p[3], "model", 2, dynamic, WARM, 3, 12),
        Row(p[4], "model", 3, None, WARM, 4, 16),
    ]


DraftFactory = Callable[[], object]


def _drafter(row: Row, make_draft: DraftFactory, vocab: int) -> Drafter | None:
    if row.drafter == "ngram":
        return PromptLookupDrafter(max_ngram=3)
    if row.drafter == "model":
        drafter = DraftModelDrafter(make_draft(), vocab, "draft")  # type: ignore[arg-type]
        if row.tree is not None:
            drafter.set_tree_shape(row.tree)
        return drafter
    return None


def _request(row: Row, make_draft: DraftFactory, vocab: int) -> BatchRequest:
    drafter = _drafter(row, make_draft, vocab)
    tree = TreeRound(drafter, 6) if row.tree is not None else None  # type: ignore[arg-type]
    return BatchRequest(
        prompt_ids=row.prompt,
        params=row.params,
        stop=StopCriteria(max_new_tokens=row.max_new_tokens),
        generator=torch.Generator().manual_seed(row.seed),
        drafter=drafter,
        gamma=row.gamma,
        tree=tree,
    )


def _alone(target: object, row: Row, make_draft: DraftFactory, vocab: int) -> list[int]:
    request = _request(row, make_draft, vocab)
    engine = SpeculativeEngine(target, request.drafter, request.gamma, request.tree)  # type: ignore[arg-type]
    return engine.generate(row.prompt, row.params, request.stop, request.generator).token_ids


def _check_rows_equal_alone(target: object, make_draft: DraftFactory, vocab: int) -> None:
    rows = _rows()
    engine = BatchEngine(target, max_batch=3)  # type: ignore[arg-type]
    results = engine.run(_request(row, make_draft, vocab) for row in rows)
    for row, result in zip(rows, results, strict=True):
        assert result.token_ids == _alone(target, row, make_draft, vocab), row
        assert len(result.token_ids) == row.max_new_tokens
    tree_rows = [r for row, r in zip(rows, results, strict=True) if row.tree is not None]
    assert all(r.stats.accepted_tokens > 0 for r in tree_rows)  # the trees really verified
    assert engine.target_passes < sum(r.stats.target_calls for r in results)  # shared passes


def test_tree_and_chain_rows_share_native_passes_exactly(folder: Path) -> None:
    """Chain rows and tree rows (static and dynamic shapes, greedy and sampled) in one
    batch on native slots: each row's tokens equal its single-sequence run."""
    require_kernels()
    backend = "kernels"
    target = load_native(folder, max_length=96, backend=backend, max_slots=3)
    _check_rows_equal_alone(
        target, lambda: load_native(folder, "int4", max_length=96, backend=backend), VOCAB
    )


def test_hf_rows_equal_their_single_sequence_runs() -> None:
    """The transformers runtime verifies rows in one padded batch (per-slot caches): the
    same rows (chains and trees) equal the single-sequence engine on the same model."""
    target = HFCausalLM(tiny_llama(0, VOCAB, 2))
    _check_rows_equal_alone(target, lambda: target.to_dtype(torch.bfloat16), VOCAB)


def test_hf_rows_return_the_logits_they_ask_for() -> None:
    """``RowInput.logits_from`` on the transformers runtime: each row's logits are the tail
    of the logits it gets when it asks for all of them."""
    sequences = [_ids(9, 15)[0], _ids(4, 16)[0]]
    outputs = []
    for froms in ((0, 0), (8, 2)):
        model = HFCausalLM(tiny_llama(0, VOCAB, 2))
        slots = [model.acquire_slot() for _ in sequences]
        rows = [RowInput(s, ids, logits_from=n) for s, ids, n in zip(slots, sequences, froms,
                                                                    strict=True)]  # fmt: skip
        outputs.append(model.forward_rows(rows))
    for every, asked, n in zip(*outputs, (8, 2), strict=True):
        assert asked.shape[0] == every.shape[0] - n
        torch.testing.assert_close(asked, every[n:], atol=1e-5, rtol=1e-5)


def test_hf_padded_rows_match_single_forwards_and_catch_a_mask_leak() -> None:
    """Ragged rows with different cache lengths: logits match each sequence run alone
    (to float rounding); a mask that lets rows see the padding does not."""
    model = HFCausalLM(tiny_llama(0, VOCAB, 2))
    sequences = [_ids(11, 5)[0], _ids(3, 6)[0], _ids(17, 7)[0]]
    alone = []
    for ids in sequences:
        model.reset()
        alone.append(model.forward(ids.unsqueeze(0))[0])  # [n, vocab]

    def run_ragged(model: HFCausalLM) -> list[torch.Tensor]:
        slots = [model.acquire_slot() for _ in sequences]
        outputs: list[list[torch.Tensor]] = [[] for _ in sequences]
        fed = [0] * len(sequences)
        chunk = 1
        while any(f < len(s) for f, s in zip(fed, sequences, strict=True)):
            rows, which = [], []
            for i, ids in enumerate(sequences):
                k = min(1 + (chunk + i) % 4, len(ids) - fed[i])
                if k > 0:
                    rows.append(RowInput(slots[i], ids[fed[i] : fed[i] + k]))
                    which.append(i)
                    fed[i] += k
            for i, logits in zip(which, model.forward_rows(rows), strict=True):
                outputs[i].append(logits)
            chunk += 1
        for slot in slots:
            model.release_slot(slot)
        return [torch.cat(o) for o in outputs]

    for expected, got in zip(alone, run_ragged(model), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    leaky = HFCausalLM(tiny_llama(0, VOCAB, 2))
    leaky._rows_mask = lambda rows, lengths, ks, cached, width: None  # type: ignore[method-assign]
    with pytest.raises(AssertionError):
        for expected, got in zip(alone, run_ragged(leaky), strict=True):
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


class RecordingPool(SlotPool):
    """Slots that record, for every pass, each row's slot and token count."""

    def __init__(self, model: object) -> None:
        super().__init__(model)  # type: ignore[arg-type]
        self.passes: list[dict[int, int]] = []

    def forward_rows(self, rows: Sequence[RowInput]) -> list[torch.Tensor]:
        self.passes.append({row.slot: row.input_ids.numel() for row in rows})
        return super().forward_rows(rows)


def _chunked_run(folder: Path, chunk: int | None) -> tuple[list[list[int]], RecordingPool, int]:
    target = load_native(folder, max_length=128, backend="torch", max_slots=3)
    pool = RecordingPool(target)
    engine = BatchEngine(target, max_batch=3, prefill_chunk=chunk, pool=pool)
    rows = _rows()[:2]
    first = [engine.add(_request(r, lambda: None, VOCAB)) for r in (rows[0],)]
    engine.step()
    engine.step()
    long_prompt = _ids(60, 9)[0].tolist()
    late = Row(long_prompt, "ngram", 3, None, GREEDY, 5, 8)
    joined = engine.add(_request(late, lambda: None, VOCAB))
    slot = engine.rows[joined].session.slot  # type: ignore[attr-defined]
    while engine.rows:
        engine.step()
    tokens = [engine.finished[i].token_ids for i in (*first, joined)]
    return tokens, pool, slot


def test_chunked_prefill_splits_a_long_prompt_and_stays_exact(folder: Path) -> None:
    """A 60-token prompt joining a decoding row is prefilled 8 tokens per pass while the
    other row keeps decoding in the same passes; every output equals its run alone and
    its run with the whole prompt in one pass (the negative control of the split)."""
    tokens, pool, slot = _chunked_run(folder, 8)
    whole, whole_pool, whole_slot = _chunked_run(folder, None)
    assert tokens == whole
    target = load_native(folder, max_length=128, backend="torch")
    late = Row(_ids(60, 9)[0].tolist(), "ngram", 3, None, GREEDY, 5, 8)
    assert tokens[1] == _alone(target, late, lambda: None, VOCAB)
    assert tokens[0] == _alone(target, _rows()[0], lambda: None, VOCAB)
    prefill = [p for p in pool.passes if p.get(slot, 0) > 0][: (59 + 7) // 8]
    assert [p[slot] for p in prefill] == [8] * 7 + [3]  # 59 = prompt minus its last token
    assert all(len(p) == 2 for p in prefill)  # the decoding row shared each of those passes
    whole_prefill = [p[whole_slot] for p in whole_pool.passes if whole_slot in p]
    assert whole_prefill[0] == 59  # unchunked: the whole prompt in one pass


def test_single_sequence_engine_chunks_its_prefill_exactly(folder: Path) -> None:
    target = load_native(folder, max_length=128, backend="torch")
    prompt = _ids(50, 3)[0].tolist()
    stop, params = StopCriteria(max_new_tokens=12), SamplingParams(temperature=0.8)

    def run(chunk: int | None) -> tuple[list[int], int]:
        drafter = PromptLookupDrafter(max_ngram=3)
        engine = SpeculativeEngine(target, drafter, 3, prefill_chunk=chunk)
        result = engine.generate(prompt, params, stop, torch.Generator().manual_seed(1))
        return result.token_ids, engine.target.forward_calls

    (chunked, calls), (whole, whole_calls) = run(7), run(None)
    assert chunked == whole
    assert calls - whole_calls == (49 + 6) // 7 - 1  # 7 prefill passes instead of 1


def test_load_aware_needs_a_margin_over_plain_batched_decoding() -> None:
    """A draft predicted to gain 3 % is not taken (its inputs are noisy estimates);
    without the margin it is (the control), and a large gain is taken either way."""
    from speculative.engine.gamma import LoadAwareGamma, RowLoad

    flat = {1: 1.0, 2: 1.0, 8: 1.0}
    marginal = RowLoad(alpha=0.5, max_gamma=1, fed=1, cost=1.5 / 1.03 - 1)  # (1+α)/(1+c)=1.03
    assert LoadAwareGamma(flat).choose([marginal]) == [0]
    assert LoadAwareGamma(flat, margin=0.0).choose([marginal]) == [1]
    assert LoadAwareGamma(flat).choose([RowLoad(alpha=0.8, max_gamma=4)]) == [4]


def test_load_aware_cost_curve_never_falls() -> None:
    """A noisy curve where 3 tokens look cheaper than 2 is read as its running maximum, so
    drafts never look free; the measured points that do rise are kept."""
    from speculative.engine.gamma import LoadAwareGamma

    policy = LoadAwareGamma({1: 1.0, 2: 1.9, 3: 1.0, 4: 1.2, 6: 2.5})
    costs = [policy.cost(n) for n in range(1, 8)]
    assert costs == sorted(costs)
    assert costs[:4] == [1.0, 1.9, 1.9, 1.9] and costs[5] == 2.5
    assert policy.cost(200) > policy.cost(7)  # extended past the last point, and cached


def test_verify_cost_at_reads_measured_points_and_interpolates_between() -> None:
    """A mapping's value at a measured point, linear between two, the first point's below
    it and the last one's past it (flat: extending is the load policy's choice); the same
    with the keys given sorted; a callable as itself; an empty mapping or a value <= 0 is
    an error."""
    from speculative.theory import verify_cost_at

    curve = {8: 3.1, 1: 1.0, 3: 1.4}  # unsorted on purpose
    expected = {0: 1.0, 1: 1.0, 2: 1.2, 3: 1.4, 5: 1.4 + 2 / 5 * 1.7, 8: 3.1, 12: 3.1}
    for k, value in expected.items():
        assert verify_cost_at(curve, k) == pytest.approx(value)
        assert verify_cost_at(curve, k, sorted(curve)) == verify_cost_at(curve, k)
    assert verify_cost_at(lambda k: 0.5 * k, 4) == 2.0
    with pytest.raises(ValueError, match="empty"):
        verify_cost_at({}, 2)
    with pytest.raises(ValueError, match="must be > 0"):
        verify_cost_at({1: 1.0, 3: -1.0}, 3)


def test_load_aware_reads_its_curve_as_verify_cost_at_does() -> None:
    """The policy's curves (their points sorted once) read bitwise as ``verify_cost_at``
    at, between and below measured points, and along the line through the last two past
    the end (the rows curve likewise)."""
    from speculative.engine.gamma import LoadAwareGamma
    from speculative.theory import verify_cost_at

    curve = {16: 5.9, 1: 1.0, 3: 1.4, 2: 1.05, 8: 3.1}  # unsorted on purpose
    rows = {4: 2.5, 1: 1.0}
    policy = LoadAwareGamma(curve, rows_cost=rows)
    for n in range(1, 17):
        assert policy.cost(n) == max(verify_cost_at(curve, m) for m in range(1, n + 1))
    assert policy.cost(20) == 5.9 + (5.9 - 3.1) / (16 - 8) * (20 - 16)
    assert policy.row_cost(3) == verify_cost_at(rows, 3) - policy.cost(3) > 0
    assert policy.row_cost(6) == 2.5 + (2.5 - 1.0) / (4 - 1) * (6 - 4) - policy.cost(6) > 0


def test_load_aware_charges_padding_on_a_padding_runtime() -> None:
    """One well-predicted row among seven poor ones: on total tokens its 8 drafts are
    cheap, but a runtime that pads every row to the longest pays them 8 times over."""
    from speculative.engine.gamma import LoadAwareGamma, RowLoad
    from speculative.models.base import PadsBatchRows

    policy = LoadAwareGamma(lambda n: max(1.0, n / 16))
    rows = [RowLoad(0.95, 8)] + [RowLoad(0.2, 8)] * 7
    assert policy.choose(rows) == [8, 0, 0, 0, 0, 0, 0, 0]
    hf = HFCausalLM(tiny_llama(0, VOCAB, 1))
    assert isinstance(hf, PadsBatchRows) and hf.padded_tokens([3, 1, 2]) == 9
    assert policy.choose(rows, padded=hf.padded_tokens) == [1, 0, 0, 0, 0, 0, 0, 0]
