"""Batched speculative decoding: every row of a batch is exactly its single-sequence run.

Rows differ in prompt length, drafter (none, n-gram, a self-int4 draft model), γ,
sampling parameters, seed and stop criteria; with max_batch below the number of rows,
rows join as others finish (continuous batching). Each row's tokens must equal, as
lists of ids, what SpeculativeEngine generates for that row alone on a fresh model:
bitwise for greedy, the same seeded sample for sampling.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import pytest
import torch

from speculative.drafters.base import Draft, Drafter
from speculative.drafters.model import DraftModelDrafter
from speculative.drafters.ngram import PromptLookupDrafter
from speculative.drafters.tree import DraftTree
from speculative.engine import SpeculativeEngine, StopCriteria
from speculative.engine.batch import BatchEngine, BatchRequest
from speculative.engine.gamma import FixedGamma, LoadAwareGamma, PassTimes, RowLoad
from speculative.models.native import NativeLlama, load_native
from speculative.sampling import SamplingParams
from test_native import VOCAB, _ids, _tiny_llama, require_kernels


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_batch")
    _tiny_llama(path, layers=2)
    return path


def _decode(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids) + " "


@dataclass(frozen=True)
class RowSpec:
    prompt: list[int]
    drafter: str  # "none", "ngram", "self-int4"
    gamma: int
    params: SamplingParams
    seed: int
    stop: StopCriteria


def _specs() -> list[RowSpec]:
    base = _ids(30, 51)[0].tolist()
    loop = base[:6] * 4  # repetitive: the n-gram drafter finds continuations
    greedy, warm = SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9)
    return [
        RowSpec(loop, "ngram", 4, greedy, 0, StopCriteria(max_new_tokens=20)),
        RowSpec(base[:3], "self-int4", 3, warm, 1, StopCriteria(max_new_tokens=16)),
        RowSpec(base[:17], "none", 0, SamplingParams(temperature=1.0), 2, StopCriteria(9)),
        RowSpec(base[5:9], "self-int4", 2, greedy, 3, StopCriteria(14, frozenset({3, 17}))),
        RowSpec(
            loop[:13],
            "ngram",
            5,
            SamplingParams(temperature=0.7, top_k=20),
            4,
            StopCriteria(18, stop_strings=(" w9 ",), decode=_decode),
        ),
        RowSpec(base[20:], "self-int4", 4, SamplingParams(temperature=1.2), 5, StopCriteria(12)),
    ]


def _drafter(kind: str, folder: Path, backend: str) -> Drafter | None:
    if kind == "ngram":
        return PromptLookupDrafter(max_ngram=3)
    if kind == "self-int4":
        draft = load_native(folder, "int4", max_length=96, backend=backend)
        return DraftModelDrafter(draft, VOCAB, "self-int4")
    return None


def _request(spec: RowSpec, folder: Path, backend: str) -> BatchRequest:
    return BatchRequest(
        prompt_ids=spec.prompt,
        params=spec.params,
        stop=spec.stop,
        generator=torch.Generator().manual_seed(spec.seed),
        drafter=_drafter(spec.drafter, folder, backend),
        gamma=spec.gamma,
    )


def _alone(spec: RowSpec, folder: Path, backend: str) -> tuple[list[int], str | None]:
    target = load_native(folder, max_length=96, backend=backend)
    engine = SpeculativeEngine(target, _drafter(spec.drafter, folder, backend), spec.gamma)
    generator = torch.Generator().manual_seed(spec.seed)
    result = engine.generate(spec.prompt, spec.params, spec.stop, generator)
    return result.token_ids, result.finish_reason


def _backend(name: str) -> str:
    if name == "kernels":
        require_kernels()
    return name


@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_every_row_equals_its_single_sequence_run(folder: Path, backend: str) -> None:
    _backend(backend)
    specs = _specs()
    target = load_native(folder, max_length=96, backend=backend, max_slots=3)
    engine = BatchEngine(target, max_batch=3)  # 6 rows through 3 slots: rows join midway
    results = engine.run(_request(spec, folder, backend) for spec in specs)
    reasons = set()
    for spec, result in zip(specs, results, strict=True):
        tokens, reason = _alone(spec, folder, backend)
        assert result.token_ids == tokens, spec
        assert result.finish_reason == reason
        reasons.add(reason)
    assert {"length", "eos"} <= reasons or {"length", "stop"} <= reasons
    assert results[0].stats.accepted_tokens > 0  # the n-gram row really speculated
    assert engine.target_passes < sum(r.stats.target_calls for r in results)  # shared passes
    assert not engine.rows and sorted(target.acquire_slot() for _ in range(3)) == [0, 1, 2]


def test_cancel_frees_the_slot_and_leaves_the_others_exact(folder: Path) -> None:
    backend = _backend("kernels")
    specs = _specs()[:3]
    target = load_native(folder, max_length=96, backend=backend, max_slots=3)
    engine = BatchEngine(target, max_batch=3)
    ids = [engine.add(_request(spec, folder, backend)) for spec in specs]
    for _ in range(2):
        engine.step()
    cancelled = engine.cancel(ids[1])
    assert cancelled.finish_reason == "cancelled"
    late = _specs()[3]
    ids.append(engine.add(_request(late, folder, backend)))  # takes the freed slot
    while engine.rows:
        engine.step()
    for i, spec in zip([ids[0], ids[2], ids[3]], [specs[0], specs[2], late], strict=True):
        assert engine.finished[i].token_ids == _alone(spec, folder, backend)[0]
    alone = _alone(specs[1], folder, backend)[0]
    assert cancelled.token_ids == alone[: len(cancelled.token_ids)]


def test_swapped_slots_are_caught(folder: Path) -> None:
    """Negative control: two rows whose cache slots get swapped midway no longer match
    their single-sequence runs (the comparison above would catch a slot mix-up)."""
    backend = _backend("kernels")
    greedy = SamplingParams(temperature=0)
    base = _ids(30, 61)[0].tolist()
    specs = [
        RowSpec(base[:9], "none", 0, greedy, 0, StopCriteria(max_new_tokens=12)),
        RowSpec(base[9:20], "none", 0, greedy, 0, StopCriteria(max_new_tokens=12)),
    ]
    target = load_native(folder, max_length=96, backend=backend)
    engine = BatchEngine(target, max_batch=2)
    ids = [engine.add(_request(spec, folder, backend)) for spec in specs]
    for _ in range(3):
        engine.step()
    first, second = engine.rows[ids[0]].session, engine.rows[ids[1]].session
    first.slot, second.slot = second.slot, first.slot
    while engine.rows:
        engine.step()
    outputs = [engine.finished[i].token_ids for i in ids]
    assert outputs != [_alone(spec, folder, backend)[0] for spec in specs]


def test_load_aware_gamma_keeps_greedy_rows_exact(folder: Path) -> None:
    """γ per row chosen by the load policy changes only the speed of greedy rows."""
    backend = _backend("kernels")
    specs = [s for s in _specs() if s.params.greedy]
    target = load_native(folder, max_length=96, backend=backend)
    load = LoadAwareGamma({1: 1.0, 4: 1.05, 8: 1.6, 16: 3.2})
    engine = BatchEngine(target, max_batch=4, load=load)
    results = engine.run(_request(spec, folder, backend) for spec in specs)
    for spec, result in zip(specs, results, strict=True):
        assert result.token_ids == _alone(spec, folder, backend)[0]


class _ChoosesItsLength(PromptLookupDrafter):
    """An n-gram drafter that says it picks its own draft length (``ChoosesDraftLength``):
    it records the curve it is given and the γ of every propose call."""

    def __init__(self) -> None:
        super().__init__()
        self.curve: dict[int, float] | None = None
        self.asked: list[int] = []

    def use_verify_cost(self, verify_cost: dict[int, float]) -> None:
        self.curve = dict(verify_cost)

    def propose(self, context, gamma, params, generator):
        self.asked.append(gamma)
        return super().propose(context, gamma, params, generator)


def test_an_engine_sizes_the_cache_for_its_batch_at_once(folder: Path, monkeypatch) -> None:
    """The engine holds room for max_batch rows from the start (one allocation): rows
    joining one by one reallocate nothing, and their tokens are what they were. Control:
    acquiring slots one by one without the engine regrows the cache."""
    single = load_native(folder, max_length=96, backend="torch")
    greedy, stop = SamplingParams(temperature=0), StopCriteria(max_new_tokens=6)
    prompts = [_ids(30 + i, 51)[0].tolist()[: 5 + i] for i in range(4)]
    alone = [
        SpeculativeEngine(single, None).generate(p, greedy, stop, torch.Generator()).token_ids
        for p in prompts
    ]
    target = load_native(folder, max_length=96, backend="torch", max_slots=4)
    sizes: list[int] = []
    allocate = type(target.decoder).allocate

    def counted(self, batch):
        sizes.append(batch)
        return allocate(self, batch)

    monkeypatch.setattr(type(target.decoder), "allocate", counted)
    engine = BatchEngine(target, max_batch=4)
    assert sizes == [4]
    requests = [BatchRequest(p, greedy, stop, torch.Generator(), None, 0) for p in prompts]
    assert [r.token_ids for r in engine.run(requests)] == alone
    assert sizes == [4]  # nothing reallocated while the rows joined
    fresh = load_native(folder, max_length=96, backend="torch", max_slots=4)
    sizes.clear()
    for _ in range(4):
        fresh.acquire_slot()
    assert len(sizes) > 1  # one by one, the cache grew more than once


class _SlowLookup(PromptLookupDrafter):
    """An n-gram drafter whose every propose call takes at least ``pause`` seconds."""

    def __init__(self, pause: float) -> None:
        super().__init__()
        self.pause, self.calls = pause, 0

    def propose(self, context, gamma, params, generator):
        self.calls += 1
        time.sleep(self.pause)
        return super().propose(context, gamma, params, generator)


def test_draft_seconds_count_the_drafters_time_and_only_its_rows(folder: Path) -> None:
    """A row's ``draft_seconds`` holds its drafter's propose calls (every call's pause at
    least, within the row's own time); a plain row beside it is charged none."""
    target = load_native(folder, max_length=96, backend="torch")
    prompt = _ids(30, 51)[0].tolist()[:6] * 4
    greedy, pause = SamplingParams(temperature=0), 0.003
    slow = _SlowLookup(pause)
    stop = StopCriteria(max_new_tokens=12)
    requests = [
        BatchRequest(prompt, greedy, stop, torch.Generator(), slow, 3),
        BatchRequest(prompt[:9], greedy, stop, torch.Generator(), None, 0),
    ]
    drafted, plain = (r.stats for r in BatchEngine(target, max_batch=2).run(requests))
    assert slow.calls > 0 and drafted.drafted_tokens > 0
    assert slow.calls * pause <= drafted.draft_seconds < drafted.seconds
    assert plain.draft_seconds == 0.0 and plain.drafted_tokens == 0


def test_load_aware_lets_a_drafter_alone_in_the_pass_choose_its_length(folder: Path) -> None:
    """Alone in the pass, a drafter that picks its own length gets the row's γ as its cap
    (and the policy's measured K(k)/T(1) as its prior), as a single sequence does with
    --gamma auto; beside another row, the load policy decides (here, on a curve where a
    token costs a step: no drafts). Greedy rows stay exact either way."""
    target = load_native(folder, max_length=96, backend="torch")
    steep = lambda n: float(n)  # noqa: E731
    prompt = _ids(30, 51)[0].tolist()[:6] * 4  # repetitive: the lookup finds matches
    greedy = SamplingParams(temperature=0)
    plain = SpeculativeEngine(target, None).generate(
        prompt, greedy, StopCriteria(max_new_tokens=12), torch.Generator()
    )

    def run(rows: int) -> list[_ChoosesItsLength]:
        drafters = [_ChoosesItsLength() for _ in range(rows)]
        engine = BatchEngine(target, max_batch=rows, load=LoadAwareGamma(steep))
        requests = [
            BatchRequest(prompt, greedy, StopCriteria(max_new_tokens=12), torch.Generator(), d, 4)
            for d in drafters
        ]
        for result in engine.run(requests):
            assert result.token_ids == plain.token_ids
        return drafters

    (alone,) = run(1)
    assert alone.curve == {k: float(k) for k in range(1, 10)}
    assert alone.asked and set(alone.asked) == {4}
    assert all(not d.asked for d in run(2))  # the load policy's γ: 0 on this curve


def test_situation_acceptance_pools_rows_per_situation() -> None:
    """Per situation and draft position: long matches, all kept, rate near 1 at every
    position; 1-token matches, whose first draft always fails, near 0 at the first
    position and, never reached after it, the first position's estimate after it; a
    lookup that found nothing counts as a first draft not kept; an unseen situation
    gives the row's own rates; the best rates bound every situation's."""
    from speculative.engine.batch import ALPHA_PRIOR, POSITIONS, SituationAcceptance

    shared = SituationAcceptance(decay=1.0)
    own = (0.5,) * POSITIONS
    assert shared.alphas(("ngram", 8), own) == own  # unseen: the row's own
    for _ in range(10):
        shared.record(("ngram", 8), drafted=6, num_accepted=6)  # long matches: all kept
        shared.record(("ngram", 1), drafted=4, num_accepted=0)  # 1-token: first rejected
    shared.record(("ngram", 1), drafted=0, num_accepted=0)  # none asked: nothing learnt
    long, short = shared.alphas(("ngram", 8), own), shared.alphas(("ngram", 1), own)
    assert min(long[:6]) > 0.9 and long[6] == long[5]  # position 7: never reached
    assert short[0] == pytest.approx(ALPHA_PRIOR * 2 / 12)  # 0 of 10 + the prior
    assert short[1:] == (short[0],) * (POSITIONS - 1)  # unreached: the one before
    assert shared.counts[("ngram", 1)].reached[:2] == [10, 0]
    for _ in range(4):  # asked for 3 drafts, the lookup found no match: nothing emitted
        shared.record(("ngram", 0), drafted=0, num_accepted=0, asked=3)
    assert shared.counts[("ngram", 0)].reached[:2] == [4.0, 0.0]
    assert shared.alphas(("ngram", 0), own)[0] == pytest.approx(ALPHA_PRIOR * 2 / 6)
    best = shared.best_alphas("ngram", own)
    assert best == tuple(map(max, long, own))
    shared.record(("ngram", 1), drafted=4, num_accepted=4)  # a record refreshes the caches
    assert shared.alphas(("ngram", 1), own)[0] > short[0]


def test_load_aware_values_a_copy_by_its_acceptance_per_position() -> None:
    """A copying drafter's first token is often wrong and the rest then right (n-gram
    rows on the bench's prompts: 0.48, 0.87, 0.92, 0.83 per position): with its rates
    per position the policy drafts six tokens of it; one α of 0.48 for every position
    would stop after two drafts."""
    curve = {1: 1.0, 9: 1.8}  # each token 0.1 of a step
    copy = RowLoad(alpha=0.48, max_gamma=8, alphas=(0.48, 0.87, 0.92, 0.83))
    flat = RowLoad(alpha=0.48, max_gamma=8)
    load = LoadAwareGamma(curve)
    assert load.choose([copy]) == [6] and load.choose([flat]) == [2]
    assert copy.rate(7) == 0.83 and flat.rate(7) == 0.48
    assert copy.gains() == pytest.approx(
        sum(0.48 * 0.87 * 0.92 * 0.83**k for k in range(6)) + 0.48 + 0.48 * 0.87
    )


def test_load_aware_rows_draft_for_their_situation_and_stay_exact(folder: Path) -> None:
    """Load-aware n-gram rows: each round's α is the pooled estimate of the match-length
    class the row's drafter is in, learnt across rows; greedy rows stay exact."""
    backend = _backend("kernels")
    seen: list[float] = []

    class Recording(LoadAwareGamma):
        def choose(self, rows, extra_tokens=0, padded=None, extra_rows=0):
            seen.extend(r.alpha for r in rows)
            return super().choose(rows, extra_tokens, padded, extra_rows)

    specs = [s for s in _specs() if s.params.greedy and s.drafter == "ngram"] * 3
    target = load_native(folder, max_length=96, backend=backend)
    engine = BatchEngine(target, max_batch=2, load=Recording({1: 1.0, 4: 1.05, 8: 1.6}))
    results = engine.run(_request(spec, folder, backend) for spec in specs)
    for spec, result in zip(specs, results, strict=True):
        assert result.token_ids == _alone(spec, folder, backend)[0]
    keys = set(engine.situations.counts)  # 0: no match (asked, nothing drafted)
    assert keys and all(name == "ngram" and cls in (0, 1, 2, 3, 4, 8) for name, cls in keys)
    assert len(set(seen)) > 2  # the α follows the situations, not one running value


def test_load_aware_rounds_count_joining_rows_as_rows_of_the_pass(folder: Path) -> None:
    """A row that joins while another decodes feeds its prompt in the same pass: the
    policy is told its tokens and that it is one more row."""
    backend = _backend("kernels")
    asked: list[tuple[int, int, int]] = []  # (decoding rows, extra rows, extra tokens)

    class Recording(LoadAwareGamma):
        def choose(self, rows, extra_tokens=0, padded=None, extra_rows=0):
            asked.append((len(rows), extra_rows, extra_tokens))
            return super().choose(rows, extra_tokens, padded, extra_rows)

    spec = next(s for s in _specs() if s.params.greedy and s.drafter == "ngram")
    base = _ids(30, 51)[0].tolist()
    joiners = [replace(spec, prompt=base[18:24]), replace(spec, prompt=base[24:30])]
    target = load_native(folder, max_length=96, backend=backend)
    engine = BatchEngine(target, max_batch=3, load=Recording({1: 1.0, 8: 1.0, 16: 2.0}))
    engine.add(_request(spec, folder, backend))
    engine.step()  # the first row's prefill pass
    engine.step()
    asked.clear()
    for joiner in joiners:
        engine.add(_request(joiner, folder, backend))
    engine.step()
    assert asked and all(a == (1, 2, 5 + 5) for a in asked)  # all but each last token


def test_load_aware_policy_is_told_every_pass_the_engine_ran(folder: Path) -> None:
    """The engine reports each pass to the policy as the rows saw it: how many rows, how
    many tokens (prefill chunks of joining rows included) and seconds timed around the
    pool's own call; rows stay exact."""
    import time

    from speculative.models.session import SlotPool

    backend = _backend("kernels")
    ran: list[tuple[int, int, float]] = []
    told: list[tuple[int, int, float]] = []

    class TimedPool(SlotPool):
        def forward_rows(self, rows):
            started = time.perf_counter()
            outputs = super().forward_rows(rows)
            seconds = time.perf_counter() - started
            ran.append((len(rows), sum(r.input_ids.numel() for r in rows), seconds))
            return outputs

    class Recording(LoadAwareGamma):
        def observe(self, rows, tokens, seconds):
            told.append((rows, tokens, seconds))
            super().observe(rows, tokens, seconds)

    specs = [s for s in _specs() if s.params.greedy]
    target = load_native(folder, max_length=96, backend=backend, max_slots=2)
    load = Recording({1: 1.0, 4: 1.05, 8: 1.6})
    engine = BatchEngine(target, max_batch=2, load=load, prefill_chunk=5, pool=TimedPool(target))
    results = engine.run(_request(spec, folder, backend) for spec in specs)
    for spec, result in zip(specs, results, strict=True):
        assert result.token_ids == _alone(spec, folder, backend)[0]
    assert [t[:2] for t in told] == [r[:2] for r in ran] and len(told) == engine.target_passes
    assert all(t[2] >= r[2] for t, r in zip(told, ran, strict=True))  # timed around it
    assert {r for r, _, _ in told} == {1, 2} and any(n > 2 * r for r, n, _ in told)
    kept = {(r, n) for r, n, _ in told if n <= 16 * r}  # prefill-sized passes: not kept
    assert kept == load.times.shapes()


def test_the_pass_log_holds_every_pass_as_the_model_ran_it(folder: Path) -> None:
    """``pass_log`` (kept when set to a list) has one entry per pass, each row's (positions
    its slot held before the pass, tokens fed) as the model saw them, prefill chunks of
    joining rows and drafted rows included; without a list nothing is kept."""
    from speculative.models.session import SlotPool

    backend = _backend("kernels")
    seen: list[tuple[tuple[int, int], ...]] = []

    class ShapePool(SlotPool):
        def forward_rows(self, rows):
            seen.append(tuple((self.model.slot_length(r.slot), r.input_ids.numel()) for r in rows))
            return super().forward_rows(rows)

    specs = [s for s in _specs() if s.params.greedy]
    target = load_native(folder, max_length=96, backend=backend, max_slots=2)
    engine = BatchEngine(target, max_batch=2, prefill_chunk=5, pool=ShapePool(target))
    engine.pass_log = []
    engine.run(_request(spec, folder, backend) for spec in specs)
    assert [shape.rows for shape in engine.pass_log] == seen
    assert len(seen) == engine.target_passes
    assert any(k > 1 and cached > 0 for rows in seen for cached, k in rows)  # drafts scored
    assert all(shape.seconds > 0 for shape in engine.pass_log)
    quiet = BatchEngine(target, max_batch=2)
    quiet.run(_request(spec, folder, backend) for spec in specs[:1])
    assert quiet.pass_log is None


@pytest.mark.parametrize("draining", [True, False])
def test_a_draining_batch_drafts_only_for_its_rows_furthest_from_their_end(
    folder: Path, draining: bool
) -> None:
    """While nothing waits to join, only the rows with the most tokens left are offered
    their γ (a row ahead would end sooner without the batch ending sooner); rows stay
    exact. The control (not draining) offers a row ahead its γ too. The policy drafts
    what it is offered, so the passes' measured times cannot change the offers (with
    the policy's own choice, a run that chose no drafts skipped its next offers)."""
    backend = _backend("kernels")
    offered: list[list[int]] = []

    class Recording(LoadAwareGamma):
        def choose(self, rows, extra_tokens=0, padded=None, extra_rows=0):
            offered.append([r.max_gamma for r in rows])
            return offered[-1]

    base = _specs()[0]  # greedy n-gram rows on repetitive prompts: drafts get accepted
    specs = [base, replace(base, prompt=base.prompt[:9]), replace(base, prompt=base.prompt[3:])]
    target = load_native(folder, max_length=96, backend=backend, max_slots=3)
    engine = BatchEngine(target, max_batch=3, load=Recording({1: 1.0, 16: 1.0}))
    ids = [engine.add(_request(spec, folder, backend)) for spec in specs]
    engine.draining = draining
    ahead_offered = False
    while engine.rows:
        left = [
            spec.stop.max_new_tokens - len(engine.rows[i].state.generated)
            for i, spec in zip(ids, specs, strict=True)
            if i in engine.rows and engine.rows[i].decoding
        ]
        count = len(offered)
        engine.step()
        for gammas in offered[count:]:
            if len(gammas) == len(left):
                ahead = [g for g, rest in zip(gammas, left, strict=True) if rest < max(left)]
                ahead_offered |= any(ahead)
    for spec, i in zip(specs, ids, strict=True):
        assert engine.finished[i].token_ids == _alone(spec, folder, backend)[0]
    assert ahead_offered is not draining


def test_load_aware_rows_look_situations_up_only_when_a_draft_can_pay(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where even each row's most optimistic α drafts nothing (every extra token costs a
    full step), no row's n-gram situation is looked up and rows stay exact; where drafts
    ride free (a flat curve), they are looked up every round (the control)."""
    from speculative.drafters.ngram import PromptLookupDrafter

    backend = _backend("kernels")
    lookups = []
    situation = PromptLookupDrafter.draft_situation

    def counted(self, context):
        lookups.append(len(context))
        return situation(self, context)

    monkeypatch.setattr(PromptLookupDrafter, "draft_situation", counted)
    specs = [s for s in _specs() if s.params.greedy and s.drafter == "ngram"] * 2
    target = load_native(folder, max_length=96, backend=backend)
    for curve, looked_up in ((lambda n: float(n), False), ({1: 1.0, 16: 1.0, 32: 2.0}, True)):
        lookups.clear()
        engine = BatchEngine(target, max_batch=2, load=LoadAwareGamma(curve))
        results = engine.run(_request(spec, folder, backend) for spec in specs)
        for spec, result in zip(specs, results, strict=True):
            assert result.token_ids == _alone(spec, folder, backend)[0]
        assert bool(lookups) == looked_up
        assert bool(sum(r.stats.drafted_tokens for r in results)) == looked_up


def test_hopeless_rounds_skip_the_policy_until_the_batch_changes(folder: Path) -> None:
    """Where even the most optimistic acceptance drafts nothing, the next rounds with as
    many rows decode plain without asking the policy: it is asked in at most one round of
    ``HopelessRounds.rounds + 1``, fewer as the verdict repeats (each skip twice the
    last), again at once when a row joins or leaves, and rows stay exact. The control
    (drafts that ride free) is asked every round. One row skips likewise after a choice
    of nothing when its α cannot move before it drafts (a draft model's); an n-gram row,
    whose α follows its context, is asked every round."""
    from speculative.engine.batch import HopelessRounds

    skips = HopelessRounds(rounds=2)
    skips.start(rows=3)
    assert [skips.skip(3), skips.skip(3), skips.skip(3)] == [True, True, False]
    skips.start(rows=3)  # nothing again, right after a skip: a skip twice as long
    assert [skips.skip(3) for _ in range(5)] == [True] * 4 + [False]
    skips.drafted()
    skips.start(rows=3)  # a choice drafted in between: back to 2
    assert [skips.skip(3) for _ in range(3)] == [True, True, False]
    skips.start(rows=3)
    assert not skips.skip(2) and not skips.skip(3)  # a row left: ask again
    skips.start(rows=3)
    assert [skips.skip(3) for _ in range(3)] == [True, True, False]  # and start over

    backend = _backend("kernels")
    asked: list[int] = []

    class Counting(LoadAwareGamma):
        def __init__(self, curve) -> None:  # priced by the curve alone, not by pass times
            super().__init__(curve, times=PassTimes(min_count=10**9))

        def choose(self, rows, extra_tokens=0, padded=None, extra_rows=0):
            asked.append(len(rows))
            return super().choose(rows, extra_tokens, padded, extra_rows)

    class OwnGamma(FixedGamma):  # a row's own γ policy, counting what it is asked and told
        def __init__(self) -> None:
            super().__init__(3)
            self.asked = self.told = 0

        def next_gamma(self) -> int:
            self.asked += 1
            return super().next_gamma()

        def update(self, drafted: int, num_accepted: int) -> None:
            self.told += 1

    class CurveOnly(BatchEngine):
        """Drafting priced free, so that each round's choice follows the curve alone, not
        this machine's timings of the drafters (one slow propose call, a garbage
        collection, once priced a round's drafts above a flat curve's gain)."""

        def _draft_costs(self, row, load) -> tuple[float, float]:
            return 0.0, 0.0

    spec = next(s for s in _specs() if s.params.greedy and s.drafter == "ngram")
    target = load_native(folder, max_length=96, backend=backend)
    for curve, every_round in ((lambda n: float(n), False), ({1: 1.0, 32: 1.0}, True)):
        asked.clear()
        engine = CurveOnly(target, max_batch=2, load=Counting(curve))
        requests = [replace(_request(spec, folder, backend), gamma=OwnGamma()) for _ in range(2)]
        results = engine.run(requests)
        assert [r.token_ids for r in results] == [_alone(spec, folder, backend)[0]] * 2
        rounds = engine.target_passes - 1  # two rows decoding in every pass but the first
        own = [cast(OwnGamma, request.gamma) for request in requests]
        if every_round:
            assert len(asked) == 2 * rounds  # the optimistic check, then the choice
            assert [(g.asked, g.told) for g in own] == [(rounds, rounds)] * 2
        else:
            assert 0 < len(asked) <= rounds // 3 + 1
            # the rows' own policies are asked and told only the rounds the load policy
            # was asked in (a skipped round's γ 0 was the load's verdict, not theirs)
            assert all(g.asked == g.told == len(asked) for g in own)

    # one row: where its drafter says no situation (a draft model: its α cannot move
    # until it drafts), a choice of nothing skips as well; an n-gram row, whose α follows
    # its context, is asked every round
    model_spec = next(s for s in _specs() if s.drafter == "self-int4" and s.params.greedy)
    for one, curve, every_round in ((model_spec, lambda n: float(n), False),
                                    (model_spec, {1: 1.0, 32: 1.0}, True),
                                    (spec, lambda n: float(n), True)):  # fmt: skip
        asked.clear()
        engine = CurveOnly(target, max_batch=1, load=Counting(curve))
        (result,) = engine.run([_request(one, folder, backend)])
        assert result.token_ids == _alone(one, folder, backend)[0]
        rounds = engine.target_passes - 1
        if every_round:
            assert len(asked) == rounds
        else:
            assert 0 < len(asked) <= rounds // 3 + 1


def test_rows_kept_plain_do_not_price_their_drafter(folder: Path) -> None:
    """A row's per-call drafting cost is measured only in rounds that asked its drafter:
    the rounds the load policy keeps it plain (a request row alone, microseconds) must
    not pull the n-gram lookup's price down. The control, where drafts ride free, does
    ask the drafter, and measures it."""
    backend = _backend("kernels")
    spec = next(s for s in _specs() if s.params.greedy and s.drafter == "ngram")
    target = load_native(folder, max_length=96, backend=backend)
    for curve, drafts in ((lambda n: float(n), False), ({1: 1.0, 32: 1.0}, True)):
        engine = BatchEngine(target, max_batch=2, load=LoadAwareGamma(curve))
        ids = [engine.add(_request(spec, folder, backend)) for _ in range(2)]
        for _ in range(4):
            engine.step()
        rows = [engine.rows[i] for i in ids]
        assert all((row.propose_seconds is not None) == drafts for row in rows)
        for i in ids:
            engine.cancel(i)


def test_load_aware_gamma_shrinks_as_the_batch_grows() -> None:
    """Flat verify cost up to 8 tokens, linear past it: the policy speculates while drafts
    ride in the flat part and backs off to plain decoding when the batch fills it."""
    load = LoadAwareGamma(lambda n: max(1.0, n / 8))
    chosen = {b: load.choose([RowLoad(alpha=0.7, max_gamma=6)] * b) for b in (1, 2, 4, 8, 16)}
    totals = [sum(chosen[b]) / b for b in (1, 2, 4, 8, 16)]
    assert totals == sorted(totals, reverse=True)  # mean γ falls with B
    assert sum(chosen[1]) >= 4 and sum(chosen[16]) == 0
    assert load.choose([RowLoad(alpha=0.0, max_gamma=6)]) == [0]  # hopeless drafts: none
    assert load.choose([RowLoad(0.9, 6), RowLoad(0.2, 6)])[0] > 0  # the likely row drafts
    measured = LoadAwareGamma({1: 1.0, 4: 1.15, 8: 1.5, 16: 1.9, 32: 3.0, 64: 5.5})
    means = [sum(measured.choose([RowLoad(0.8, 8)] * b)) / b for b in (1, 4, 16, 64)]
    assert means == sorted(means, reverse=True) and means[-1] == 0  # past 64: extrapolated


def test_load_aware_gamma_prices_a_pass_by_its_rows_and_its_tokens() -> None:
    """T(r, n) = K(n) + R(r) − K(r): one row's drafts ride in the flat part of K even where
    every extra row costs half a step. Pricing every token as a row (the rows curve as
    the only curve, what a single curve in tokens does at high load) drafts nothing; a
    steep K drafts nothing either; at one row the pass costs K alone."""
    tokens = lambda n: max(1.0, n / 8)  # noqa: E731  K: flat up to 8 tokens
    rows = lambda r: 1.0 + 0.5 * (r - 1)  # noqa: E731  R: each row half a step
    load = LoadAwareGamma(tokens, rows_cost=rows)
    four = [RowLoad(alpha=0.7, max_gamma=6)] * 4
    assert load.pass_cost(1, 6) == load.cost(6) == 1.0
    assert load.pass_cost(4, 8) == pytest.approx(2.5) and load.pass_cost(4, 16) == 3.5
    assert sum(load.choose(four)) >= 4  # the drafts fit in K's flat part
    assert sum(LoadAwareGamma(rows).choose(four)) == 0  # tokens priced as rows: none
    steep = LoadAwareGamma(lambda n: float(n), rows_cost=rows)
    assert sum(steep.choose(four)) == 0
    noisy = LoadAwareGamma(tokens, rows_cost=lambda r: 0.5)  # rows "cheaper" than tokens
    assert noisy.row_cost(4) == 0.0 and noisy.pass_cost(4, 4) == 1.0


def test_load_aware_prices_passes_as_the_engine_ran_them() -> None:
    """Observed passes correct the start-up curves both ways. A flat curve makes four
    rows' drafts look free; a pass of 5 tokens over 4 rows seen to cost 1.3× the plain
    pass is priced so, and every larger one at least so; once the larger passes are seen
    to cost what they do, the drafts stop. A steep
    curve (K(2) = 2) stops one row's drafts; seen passes of 2 and 3 tokens at 1.05× and
    1.1× bring them back. Prices never fall as tokens are added, fewer than
    ``PassTimes.min_count`` passes of a shape are not trusted, and prefill-sized passes
    are left to the model."""
    four = [RowLoad(alpha=0.3, max_gamma=4)] * 4
    flat = LoadAwareGamma({1: 1.0, 16: 1.0}, rows_cost={1: 1.0, 4: 1.2})
    assert sum(flat.choose(four)) > 0
    for _ in range(3):
        flat.observe(4, 4, 0.010)
        flat.observe(4, 5, 0.013)
    assert flat.pass_cost(4, 5) / flat.pass_cost(4, 4) == pytest.approx(1.3)
    assert flat.pass_cost(4, 9) == pytest.approx(flat.pass_cost(4, 5))  # model adds nothing
    assert flat.pass_cost(3, 5) == flat.model_cost(3, 5)  # another row count: the model
    assert sum(flat.choose(four)) > 0  # 16 drafts still look free past 5 tokens
    for _ in range(3):  # each token beyond the rows' own costs 0.3 of a plain pass
        for n in (6, 8, 12, 20):
            flat.observe(4, n, 0.010 * (1 + 0.3 * (n - 4)))
    assert flat.choose(four) == [0, 0, 0, 0]
    assert flat.pass_cost(4, 5) / flat.pass_cost(4, 4) == pytest.approx(1.3)
    for _ in range(flat.refresh):  # the passes of 5 tokens got dearer: priced so
        flat.observe(4, 5, 0.020)  # once ``refresh`` passes of 4 rows came in
    assert flat.pass_cost(4, 5) / flat.pass_cost(4, 4) == pytest.approx(2.0)

    one = [RowLoad(alpha=0.8, max_gamma=4)]
    steep = LoadAwareGamma({1: 1.0, 2: 2.0, 8: 8.0})
    assert steep.choose(one) == [0]
    for i, seconds in enumerate((0.010, 0.0105, 0.011, 0.0104, 0.0106)):
        steep.observe(1, 1, seconds)
        steep.observe(1, 2, seconds * 1.05)
        steep.observe(1, 3, seconds * 1.02)  # cheaper than a smaller shape (noise)
        if i + 1 < steep.times.min_count:  # too few passes of each shape: not trusted
            assert steep.choose(one) == [0]
    assert steep.pass_cost(1, 2) == pytest.approx(1.05)
    assert steep.pass_cost(1, 3) == pytest.approx(1.05)  # priced as the smaller one
    assert steep.pass_cost(1, 4) == pytest.approx(1.02 + 4.0 - 3.0)  # + the model's step
    assert steep.choose(one) == [2]
    steep.observe(1, 40, 1.0)  # prefill-sized: 40 tokens for one row
    assert 40 not in steep.times.medians(1)


def test_observed_prices_are_the_running_maximum_of_the_nearest_observation() -> None:
    """Against a slow twin: from the smallest observed shape m₀ on, T(r, n) is the running
    maximum over n' <= n of (what the nearest observed m <= n' measured, scaled so that
    m₀ costs what the model says, plus the model's increment from m to n')."""
    import functools
    import random

    rng = random.Random(5)
    for _ in range(200):
        load = LoadAwareGamma({1: 1.0, 4: rng.uniform(1.0, 1.5), 32: rng.uniform(2.0, 6.0)})
        rows = rng.randint(1, 4)
        for _ in range(rng.randint(0, 40)):
            load.observe(rows, rows + rng.randint(0, 20), rng.uniform(0.01, 0.03))
        medians = load.times.medians(rows)
        model = functools.partial(load.model_cost, rows)
        for n in range(1, 40):
            if len(medians) < 2 or n < min(medians):
                expected = model(n)
            else:
                first = min(medians)
                scale = model(first) / medians[first]
                expected = max(
                    medians[m] * scale + model(k) - model(m)
                    for k in range(first, n + 1)
                    for m in [max(m for m in medians if m <= k)]
                )
            assert load.pass_cost(rows, n) == pytest.approx(expected)


def _choose_reference(load, rows, extra_tokens=0, padded=None, extra_rows=0) -> list[int]:
    """LoadAwareGamma.choose as first written: every one of the Σ max γ draft additions
    walked, the row to draft found by a scan over all rows."""
    gammas = [0] * len(rows)
    tokens = float(len(rows))
    lengths = [r.fed for r in rows]
    width = len(rows) + extra_rows

    def pass_cost() -> float:
        if padded is None:
            return load.pass_cost(width, sum(lengths) + extra_tokens)
        return load.pass_cost(width, padded([*lengths, extra_tokens] if extra_tokens else lengths))

    drafting = 0.0
    best, best_rate = list(gammas), tokens / pass_cost() * (1 + load.margin)

    def kept(row: RowLoad, position: int) -> float:
        rates = row.alphas or (row.alpha,)
        return rates[min(position, len(rates) - 1)]

    gains = [(kept(r, 0) if r.max_gamma > 0 else -1.0) for r in rows]
    for _ in range(sum(r.max_gamma for r in rows)):
        i = max(range(len(rows)), key=gains.__getitem__)
        tokens, drafting = tokens + gains[i], drafting + rows[i].cost
        lengths[i] += 1
        if gammas[i] == 0:
            drafting += rows[i].call_cost
        gammas[i] += 1
        gains[i] = gains[i] * kept(rows[i], gammas[i]) if gammas[i] < rows[i].max_gamma else -1.0
        rate = tokens / (pass_cost() + drafting)
        if rate > best_rate:
            best, best_rate = list(gammas), rate
    return best


def test_load_aware_choice_equals_the_full_walk_and_stops_early() -> None:
    """The policy's choice (drafts taken from a heap, stopped once every gain left cannot
    beat the best rate at the round's current cost) equals the full walk's on random
    batches: ties, α of 0 and 1, acceptance per position, rows that cannot draft, zero
    costs, noisy curves, joining rows, padded passes and prices corrected by observed
    passes. The stop is
    what makes it cheap: on a loaded batch where drafts do not pay it prices a few
    passes, not one per draft the rows could add."""
    import random

    rng = random.Random(7)
    for trial in range(400):
        points = sorted(rng.sample(range(2, 200), rng.randint(1, 6)))
        curve = {1: 1.0, **{n: 1.0 + rng.uniform(0.0, 0.12) * n for n in points}}
        rows_curve = {r: 1.0 + rng.uniform(0.0, 0.4) * (r - 1) for r in range(1, 25)}
        load = LoadAwareGamma(
            curve, margin=rng.choice([0.0, 0.05]), rows_cost=rng.choice([None, rows_curve])
        )
        for _ in range(rng.choice([0, 30])):  # passes the engine ran, some under the model
            width = rng.randint(1, 20)
            load.observe(width, width + rng.randint(0, 12), rng.uniform(0.005, 0.02))
        rows = [
            RowLoad(
                alpha=rng.choice([0.0, 0.3, 0.5, 0.5, 0.8, 1.0, rng.random()]),
                max_gamma=rng.choice([0, 1, 3, 8]),
                fed=rng.choice([1, 1, 2]),
                cost=rng.choice([0.0, 0.005, rng.uniform(0.0, 0.3)]),
                call_cost=rng.choice([0.0, 0.01]),
                alphas=rng.choice([(), tuple(rng.random() for _ in range(rng.randint(1, 8)))]),
            )
            for _ in range(rng.randint(1, 20))
        ]
        extra = rng.choice([(0, 0), (1, 7), (2, 30)])
        padded = rng.choice([None, lambda lengths: len(lengths) * max(lengths)])
        expected = _choose_reference(load, rows, extra[1], padded, extra[0])
        assert load.choose(rows, extra[1], padded, extra[0]) == expected, trial
    priced: list[int] = []

    def counted(lengths) -> int:
        priced.append(1)
        return sum(lengths)

    steep = LoadAwareGamma({1: 1.0, 8: 1.8, 16: 3.2, 64: 11.0}, rows_cost={1: 1.0, 16: 4.0})
    loaded = [RowLoad(alpha=0.5, max_gamma=8)] * 16
    assert steep.choose(loaded, padded=counted) == [0] * 16
    assert len(priced) < 40  # against 1 + 128 for the full walk
    assert _choose_reference(steep, loaded, padded=counted) == [0] * 16
    assert len(priced) > 128


def test_engine_refuses_a_model_without_slots(folder: Path) -> None:
    import numpy as np

    from speculative.models.markov import MarkovLM, stochastic_matrix

    markov = MarkovLM(stochastic_matrix(np.random.default_rng(0), 5, 1.0))
    with pytest.raises(ValueError, match="cannot hold several sequences"):
        BatchEngine(markov)
    assert BatchEngine(markov, max_batch=1).max_batch == 1  # a batch of one on its own cache
    target: NativeLlama = load_native(folder, max_length=32, backend="torch", max_slots=1)
    engine = BatchEngine(target, max_batch=2)
    spec = _specs()[2]
    engine.add(_request(spec, Path(), "torch"))
    with pytest.raises(ValueError, match="no free cache slot"):
        engine.add(_request(spec, Path(), "torch"))
    assert len(engine.rows) == 1


def test_interleaved_streams_on_one_target_raise_instead_of_corrupting() -> None:
    """Two streams interleaved on one target: the older one, whose cache the newer one
    reset, raises on its next round; the newer one is exactly a fresh generation, and an
    abandoned stream does not block the next."""
    from speculative.drafters.ngram import PromptLookupDrafter
    from speculative.pipeline import Speculator
    from tiny import tiny_loaded

    loaded = tiny_loaded(seed=3)
    kwargs = {"max_new_tokens": 12, "chat": False}
    speculator = Speculator(loaded, PromptLookupDrafter(), gamma=3)
    other = Speculator(loaded, None)
    expected = other.generate("the cat sat on the mat", **kwargs).token_ids
    first = iter(speculator.stream("the dog ran", **kwargs))
    next(first)
    second = other.stream("the cat sat on the mat", **kwargs)
    assert [t for r in second for t in r.tokens] == expected
    with pytest.raises(RuntimeError, match="another stream"):
        next(first)
    abandoned = iter(speculator.stream("the dog ran", **kwargs))
    next(abandoned)
    assert speculator.generate("the cat sat on the mat", **kwargs).token_ids == expected


def test_a_speculators_next_generation_reuses_the_cached_common_prefix(tmp_path: Path) -> None:
    """A conversation's second turn (its prompt: the first turn's prompt and answer,
    then more) feeds only the tokens after what the cache holds, and its tokens and
    log-probabilities are bit for bit a fresh speculator's; a new γ starts a new engine
    (and cache)."""
    from speculative.drafters.ngram import PromptLookupDrafter
    from speculative.pipeline import Speculator
    from speculative.targets import load_target
    from tiny import save_tiny

    folder = save_tiny(tmp_path, seed=3, layers=2)
    kwargs = {"max_new_tokens": 12, "chat": False, "logprobs": 0}
    speculator = Speculator(load_target(str(folder), "native"), PromptLookupDrafter(), 3)
    fed: list[int] = []  # tokens of each forward (every single-sequence pass comes here)
    lm = speculator.target.lm
    forward_from = lm.forward_from

    def counting(input_ids, *args, **kw):
        fed.append(input_ids.shape[-1])
        return forward_from(input_ids, *args, **kw)

    lm.forward_from = counting
    first = speculator.generate("the cat sat on the mat", **kwargs)
    second_prompt = "the cat sat on the mat" + first.text + " and the dog ran"
    fed.clear()
    second = speculator.generate(second_prompt, **kwargs)
    prompt_ids = speculator.target.tokenizer(second_prompt)["input_ids"]
    first_ids = speculator.target.tokenizer("the cat sat on the mat")["input_ids"]
    assert 0 < fed[0] <= len(prompt_ids) - len(first_ids)  # only what the cache lacked
    fresh = Speculator(load_target(str(folder), "native"), PromptLookupDrafter(), 3)
    alone = fresh.generate(second_prompt, **kwargs)
    assert second.token_ids == alone.token_ids
    assert [e.logprob for e in second.logprobs] == [e.logprob for e in alone.logprobs]
    kept = speculator.engine()
    speculator.gamma = 2
    assert speculator.engine() is not kept and speculator.engine() is speculator.engine()


@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_an_engines_next_generation_recomputes_what_a_tree_wrote(
    folder: Path, backend: str
) -> None:
    """With token trees, an engine's next generation (its prompt: the last one's prompt
    and output, then more) reuses only the cached positions chain passes computed; those
    a tree pass wrote are computed again (on the PyTorch decoder their keys and values
    differ from a chain pass's in the last bits), so its prompt's keys and values, and its
    tokens, are bit for bit a fresh engine's on both decoders."""
    from speculative.engine.tree import make_tree_round

    _backend(backend)
    prompt = _ids(40, 81)[0].tolist()[:24]
    params = SamplingParams(temperature=0.8, top_p=0.9)

    def engine() -> SpeculativeEngine:
        drafter = _drafter("self-int4", folder, backend)
        tree = make_tree_round("static", drafter, 4)
        return SpeculativeEngine(load_native(folder, max_length=96, backend=backend),
                                 drafter, 3, tree)  # fmt: skip

    def run(on: SpeculativeEngine, ids: list[int]):
        return on.generate(ids, params, StopCriteria(10), torch.Generator().manual_seed(7))

    def prompt_positions(on: SpeculativeEngine) -> list[torch.Tensor]:
        decoder = cast(NativeLlama, on.target.model).decoder
        n = len(follow) - 1  # keys and values of the prompt's positions
        return [cache.narrow(cache.dim() - 2, 0, n) for cache in (decoder.k_cache,
                                                                  decoder.v_cache)]  # fmt: skip

    warm, fresh = engine(), engine()
    first = run(warm, prompt)
    assert any(r.num_accepted for r in first.rounds)  # a tree path was kept
    follow = [*prompt, *first.token_ids, *prompt[:5]]
    second, alone = run(warm, follow), run(fresh, follow)
    assert second.token_ids == alone.token_ids
    assert len(prompt) - 1 <= second.stats.cached_prompt_tokens < len(prompt) + 9
    for kept, computed in zip(prompt_positions(warm), prompt_positions(fresh), strict=True):
        assert torch.equal(kept, computed)  # (reused, the tree's differ on the PyTorch decoder)


@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_engines_taking_turns_on_one_target_each_stay_exact(folder: Path, backend: str) -> None:
    """Two single-sequence engines on one target, used one after the other: each
    generation is exactly its run alone, though the other engine wrote the cache in
    between (prompts with a shared opening, which a stale session would reuse)."""
    _backend(backend)
    specs = [replace(spec, drafter="none", gamma=0) for spec in _shared_prompt_specs()]
    alone = [_alone(spec, folder, backend)[0] for spec in specs]
    target = load_native(folder, max_length=96, backend=backend)
    engines = [SpeculativeEngine(target, None, 0), SpeculativeEngine(target, None, 0)]
    for turn in range(2):
        for i, spec in enumerate(specs):
            engine = engines[(i + turn) % 2]
            generator = torch.Generator().manual_seed(spec.seed)
            result = engine.generate(spec.prompt, spec.params, spec.stop, generator)
            assert result.token_ids == alone[i], (turn, i)


@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_batch_engines_taking_turns_on_one_target_each_stay_exact(
    folder: Path, backend: str
) -> None:
    """Two batched engines on one target, one after the other, through the same cache
    slots: a finished row's retained prompt is shared only while the slot still holds it,
    not after the other engine's rows wrote it (each row equals its run alone)."""
    _backend(backend)
    ours = [replace(spec, drafter="none", gamma=0) for spec in _shared_prompt_specs()]
    theirs = [replace(spec, prompt=spec.prompt[::-1]) for spec in ours]  # another opening
    target = load_native(folder, max_length=96, backend=backend, max_slots=1)
    engines = [BatchEngine(target, max_batch=1), BatchEngine(target, max_batch=1)]
    for mine, other in zip(ours, theirs, strict=True):
        for engine, spec in zip(engines, (mine, other), strict=True):
            (result,) = engine.run([_request(spec, folder, backend)])
            assert result.token_ids == _alone(spec, folder, backend)[0]


def test_cli_batch_generate_matches_single_runs_and_resumes(tmp_path: Path, capsys) -> None:
    import json

    from speculative.pipeline import Speculator
    from test_cli import run_cli
    from tiny import save_tiny

    folder = save_tiny(tmp_path / "tiny", seed=2, layers=2)
    records = [
        {"prompt": "the cat sat on the mat and the cat", "max_new_tokens": 12},
        {"prompt": "a dog ran", "temperature": 0.9, "seed": 4, "max_new_tokens": 9},
        {"messages": [{"role": "user", "content": "red blue red blue"}], "stop": ["end"]},
        {"prompt": "it was big", "temperature": 1.0, "top_p": 0.8, "seed": 1},
        {"prompt": "then the rug", "repetition_penalty": 1.5, "presence_penalty": 0.5},
    ]
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    argv = ["generate", "--target", str(folder), "--runtime", "native", "--no-chat"]
    argv += ["--prompts", str(prompts), "--out", str(out), "--batch-size", "2", "--json"]
    argv += ["--max-new-tokens", "10", "--draft", "ngram", "--gamma", "3"]
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert json.loads(stdout.strip().splitlines()[-1])["rows"] == 5
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["index"] for line in lines] == list(range(5))
    single = Speculator.load(str(folder), "ngram", 3, "native")
    for record, line in zip(records, lines, strict=True):
        content = record.get("prompt") or record["messages"][0]["content"]
        expected = single.generate(
            content,
            chat=False,
            max_new_tokens=record.get("max_new_tokens", 10),
            temperature=record.get("temperature", 0.0),
            top_p=record.get("top_p", 1.0),
            seed=record.get("seed", 0),
            stop=record.get("stop", ()),
            repetition_penalty=record.get("repetition_penalty", 1.0),
            presence_penalty=record.get("presence_penalty", 0.0),
        )
        assert line["token_ids"] == expected.token_ids
        assert line["text"] == expected.text and line["finish_reason"] == expected.finish_reason
    kept = out.read_text().splitlines()
    out.write_text("\n".join(kept[:3]) + "\n" + kept[3][:20])  # a crash mid-line
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert json.loads(stdout.strip().splitlines()[-1])["rows"] == 2
    resumed = [json.loads(x) for x in out.read_text().splitlines() if x.endswith("}")]
    assert [x["token_ids"] for x in resumed] == [x["token_ids"] for x in lines]


def test_mixed_workload_with_cancellations_leaks_no_slot(folder: Path) -> None:
    """16 requests through 4 slots: mixed prompt lengths, drafters, temperatures and stops,
    every fifth cancelled after its second round. All rows end, the slots all come back,
    and every row that was not cancelled equals its single-sequence run."""
    backend = _backend("kernels")
    words = _ids(60, 71)[0].tolist()
    kinds = ("none", "ngram")
    specs = [
        RowSpec(
            (words[i : i + 3 + i % 7] * 2)[: 4 + i % 9],
            kinds[i % 2],
            1 + i % 5,
            SamplingParams(temperature=(0.0, 0.7, 1.0)[i % 3], top_p=(1.0, 0.9)[i % 2]),
            i,
            StopCriteria(4 + i % 11, frozenset({5 + i % 3})),
        )
        for i in range(16)
    ]
    target = load_native(folder, max_length=96, backend=backend, max_slots=4)
    engine = BatchEngine(target, max_batch=4)
    queue, ids, rounds = list(enumerate(specs)), {}, {}
    while queue or engine.rows:
        while queue and len(engine.rows) < 4:
            index, spec = queue.pop(0)
            ids[engine.add(_request(spec, folder, backend))] = index
        for row_id in engine.step():
            rounds[row_id] = rounds.get(row_id, 0) + 1
            if ids[row_id] % 5 == 0 and rounds[row_id] == 2 and row_id in engine.rows:
                engine.cancel(row_id)
    assert len(engine.finished) == 16
    reasons = [r.finish_reason for r in engine.finished.values()]
    assert reasons.count("cancelled") >= 2 and "eos" in reasons and "length" in reasons
    assert sorted(target.acquire_slot() for _ in range(4)) == [0, 1, 2, 3]
    for row_id, index in ids.items():
        result, alone = engine.finished[row_id], _alone(specs[index], folder, backend)[0]
        if result.finish_reason == "cancelled":
            assert result.token_ids == alone[: len(result.token_ids)]
        else:
            assert result.token_ids == alone


def _shared_prompt_specs() -> list[RowSpec]:
    """Rows whose prompts open with the same 20 tokens (a system prompt), then differ."""
    base = _ids(40, 71)[0].tolist()
    system, greedy = base[:20], SamplingParams(temperature=0)
    warm = SamplingParams(temperature=0.9, top_p=0.95)
    tails = [base[20:24], base[24:27], base[27:33], base[33:35], base[20:24]]
    kinds = [("ngram", 3, greedy), ("none", 0, warm), ("self-int4", 2, warm),
             ("ngram", 4, warm), ("self-int4", 3, greedy)]  # fmt: skip
    lengths = [14, 5, 9, 12, 6]  # rows end at different rounds: a live row holds the prompt
    return [
        RowSpec(system + tail, kind, gamma, params, seed, StopCriteria(max_new_tokens=n))
        for seed, (tail, (kind, gamma, params), n) in enumerate(zip(tails, kinds, lengths,
                                                                    strict=True))
    ]  # fmt: skip


def _fed_tokens(target: NativeLlama, monkeypatch) -> list[int]:
    """Counts the tokens of every target pass (prompt chunks and rounds)."""
    fed: list[int] = []
    original = target.forward_rows

    def counting(rows):
        fed.append(sum(row.input_ids.numel() for row in rows))
        return original(rows)

    monkeypatch.setattr(target, "forward_rows", counting)
    return fed


@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_rows_sharing_a_prompt_prefix_copy_it_and_stay_exact(
    folder: Path, backend: str, monkeypatch
) -> None:
    """A row that joins while another row holds the same prompt opening copies those
    cache positions instead of prefilling them (SharesSlotPrefix), and every row is still
    exactly its single-sequence run; fewer tokens go through the passes. Negative control:
    a copy that only claims the positions (no keys or values moved) changes the rows that
    adopted them."""
    _backend(backend)
    specs = _shared_prompt_specs()

    def run(model: NativeLlama) -> tuple[list[list[int]], int]:
        fed = _fed_tokens(model, monkeypatch)
        engine = BatchEngine(model, max_batch=2)  # later rows join while others are live
        results = engine.run(_request(spec, folder, backend) for spec in specs)
        return [r.token_ids for r in results], sum(fed)

    shared, fed_shared = run(load_native(folder, max_length=96, backend=backend, max_slots=2))
    alone = [_alone(spec, folder, backend)[0] for spec in specs]
    assert shared == alone
    unshared_model = load_native(folder, max_length=96, backend=backend, max_slots=2)
    unshared_model.__class__ = _NoPrefixSharing
    unshared, fed_unshared = run(unshared_model)
    assert unshared == alone
    assert fed_shared <= fed_unshared - 3 * 20  # rows 3-5 started from the 20 shared positions
    broken = load_native(folder, max_length=96, backend=backend, max_slots=2)
    broken.__class__ = _ClaimsPrefixOnly
    outputs, _ = run(broken)
    assert outputs[0] == alone[0]  # the first row prefilled itself
    assert outputs != alone


def test_rows_after_finished_rows_reuse_their_retained_prompt(folder: Path, monkeypatch) -> None:
    """Rows that run in lockstep (the same prompt and length: `check`'s batches) leave
    together; the next rows start from the prompt positions their finished slots still
    hold, and stay exact. A single-sequence pass on the model ends the retention."""
    backend = _backend("kernels")
    prompt, warm = _ids(40, 81)[0].tolist()[:24], SamplingParams(temperature=1.0)
    specs = [RowSpec(prompt, "ngram", 2, warm, seed, StopCriteria(6)) for seed in range(6)]
    alone = [_alone(spec, folder, backend)[0] for spec in specs]
    fed = {}
    for name, cls in (("shared", NativeLlama), ("unshared", _NoPrefixSharing)):
        model = load_native(folder, max_length=96, backend=backend, max_slots=2)
        model.__class__ = cls
        counts = _fed_tokens(model, monkeypatch)
        engine = BatchEngine(model, max_batch=2)
        results = engine.run(_request(spec, folder, backend) for spec in specs)
        assert [r.token_ids for r in results] == alone
        fed[name] = sum(counts)
    assert fed["shared"] == fed["unshared"] - 4 * 23  # rows 3-6: 23 prompt positions kept
    holder = model.holder(0)
    assert model.retained(0, holder) > 0 and model.forward(torch.tensor([[1]])) is not None
    assert model.retained(0, holder) == 0


@pytest.mark.parametrize("backend", ["kernels", "torch"])
@pytest.mark.parametrize("tree", ["off", "static"])
def test_a_conversations_next_turn_starts_from_the_last_turns_reply(
    folder: Path, backend: str, tree: str
) -> None:
    """A row whose prompt is a finished row's prompt, its reply and more (a chat's next
    turn) starts from every position of them the finished row's chain passes computed,
    its reply's included, and is exactly its single-sequence run (greedy and sampled).
    Positions a tree pass wrote are computed again (their attention ran over other
    cache slots). Negative control: a copy that claims the positions without their keys
    and values changes the next turn."""
    from speculative.engine.tree import make_tree_round

    _backend(backend)
    prompt = _ids(40, 81)[0].tolist()[:24]
    params = SamplingParams(temperature=0.8, top_p=0.9)

    def request(ids: list[int], seed: int) -> BatchRequest:
        drafter = _drafter("self-int4", folder, backend)  # (drafts the target mostly keeps)
        tree_round = make_tree_round(tree, drafter, 4) if tree != "off" else None
        return BatchRequest(ids, params, StopCriteria(10), torch.Generator().manual_seed(seed),
                            drafter, 3, tree=tree_round)  # fmt: skip

    def turns(cls: type[NativeLlama]) -> tuple[list[int], list[int], int]:
        model = load_native(folder, max_length=96, backend=backend, max_slots=2)
        model.__class__ = cls
        engine = BatchEngine(model, max_batch=2)
        (first,) = engine.run([request(prompt, 1)])
        follow = [*prompt, *first.token_ids, *prompt[:5]]
        (then,) = engine.run([request(follow, 2)])
        return first.token_ids, then.token_ids, then.stats.cached_prompt_tokens

    reply, next_turn, cached = turns(NativeLlama)
    follow = [*prompt, *reply, *prompt[:5]]
    alone_request = request(follow, 2)
    alone = SpeculativeEngine(
        load_native(folder, max_length=96, backend=backend), alone_request.drafter, 3,
        alone_request.tree,
    ).generate(follow, params, StopCriteria(10), alone_request.generator)  # fmt: skip
    assert next_turn == alone.token_ids
    held = len(prompt) + len(reply) - 1  # (the last reply token was never fed)
    if tree == "off":
        assert cached >= held  # the reply's positions too, not only the prompt's
    else:
        assert len(prompt) - 1 <= cached < held  # up to where the first tree path was kept
    _reply, broken, _ = turns(_ClaimsPrefixOnly)
    assert broken != alone.token_ids


def test_finished_conversations_stay_in_free_slots_until_least_recently_used(
    folder: Path,
) -> None:
    """Rows take free slots that retain nothing before those that do, and among those
    the one released longest ago: a conversation's next turn still finds its last turn's
    prompt and reply after other rows came and went, while free slots were left; with
    more conversations than slots, the least recently finished one is computed again.
    Each row stays exactly its single run. Negative control: taking the lowest free slot
    (the old way) writes over the first conversation at once."""
    backend = _backend("kernels")
    greedy = SamplingParams(temperature=0)
    openings = [_ids(16, 81 + i)[0].tolist() for i in range(3)]

    def request(ids: list[int]) -> BatchRequest:
        return BatchRequest(ids, greedy, StopCriteria(8), torch.Generator(), None, 0)

    def conversations(
        cls: type[NativeLlama], slots: int, order: Sequence[int] = (0, 1, 2)
    ) -> list[tuple[int, int]]:
        """(cached, held) of each conversation's next turn (in ``order``), after all
        first turns."""
        model = load_native(folder, max_length=96, backend=backend)
        model.__class__ = cls
        model.reserve_slots(slots)  # (the slots rows may finish in: a server's cache slots)
        engine = BatchEngine(model, max_batch=1)
        follows = []
        for opening in openings:  # one first turn after another
            (first,) = engine.run([request(opening)])
            follows.append([*opening, *first.token_ids, *opening[:3]])
        out = []
        for follow in [follows[i] for i in order]:
            (then,) = engine.run([request(follow)])
            alone = SpeculativeEngine(load_native(folder, max_length=96, backend=backend),
                                      None, 0).generate(follow, greedy, StopCriteria(8),
                                                        torch.Generator())  # fmt: skip
            assert then.token_ids == alone.token_ids
            out.append((then.stats.cached_prompt_tokens, len(follow) - 4))
        return out

    # three slots: every conversation's next turn starts from its prompt and reply
    assert all(cached >= held for cached, held in conversations(NativeLlama, 3))
    # two slots: the third first turn took the first's slot (released longest ago) and
    # the second's stayed
    (second, held), (first, _), _third = conversations(NativeLlama, 2, order=(1, 0, 2))
    assert second >= held and first < held
    lowest = conversations(_LowestFreeSlot, 3)
    assert lowest[0][0] < lowest[0][1]  # the second conversation wrote over the first


class _LowestFreeSlot(NativeLlama):
    def acquire_slot(self) -> int:
        """The lowest free slot, whatever it retains."""
        for slot in range(self._max_slots):
            try:
                self.reacquire_slot(slot)
                return slot
            except ValueError:
                continue
        raise ValueError("no free cache slot")


class _NoPrefixSharing(NativeLlama):
    copy_slot_prefix = None  # not a SharesSlotPrefix: every row prefills its own prompt


class _ClaimsPrefixOnly(NativeLlama):
    def copy_slot_prefix(self, source: int, target: int, length: int) -> None:
        """Claims the positions without their keys and values (the slot zeroed: a reused
        slot may still hold the same prompt from its last row)."""
        for cache in (self.decoder.k_cache, self.decoder.v_cache):
            cache.narrow(self.decoder.slot_dim, target, 1).zero_()
        self._slot_lengths[target] = length


@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_a_drafter_that_imports_the_prompt_cache_takes_its_rows_slot(
    folder: Path, backend: str, monkeypatch
) -> None:
    """A draft model that follows the target's cache instead of feeding its own passes
    (``follow_target``: the target at another precision) imports the prompt and then each
    round's positions from its row's cache slot in a batch as from the single sequence
    alone: each sampled row equals its single-sequence run, and the drafter runs no
    prefill of its own. Negative control: a drafter that feeds itself drafts from other
    keys and values (int4 where the target cached fp32) and gives other samples."""
    _backend(backend)
    base = _ids(60, 90)[0].tolist()
    warm = SamplingParams(temperature=1.0)
    prompts = (base[:20], base[5:33], base[35:52])

    def drafter(shared: bool) -> DraftModelDrafter:
        draft = load_native(folder, "int4", max_length=96, backend=backend)
        return DraftModelDrafter(draft, VOCAB, "self-int4", follow_target=shared)

    def batched(shared: bool) -> list[list[int]]:
        target = load_native(folder, max_length=96, backend=backend, max_slots=3)
        requests = [
            BatchRequest(p, warm, StopCriteria(14), torch.Generator().manual_seed(i),
                         drafter(shared), 3)
            for i, p in enumerate(prompts)
        ]  # fmt: skip
        return [r.token_ids for r in BatchEngine(target, max_batch=3).run(requests)]

    alone = []
    for i, prompt in enumerate(prompts):
        engine = SpeculativeEngine(load_native(folder, max_length=96, backend=backend),
                                   drafter(True), 3)  # fmt: skip
        generator = torch.Generator().manual_seed(i)
        alone.append(engine.generate(prompt, warm, StopCriteria(14), generator).token_ids)
    imports = []
    original = NativeLlama.import_cache

    def recorded(self, source, length, source_slot=None, slot=None, start=0):
        done = original(self, source, length, source_slot, slot, start)
        imports.append((source_slot, length, start, done))
        return done

    monkeypatch.setattr(NativeLlama, "import_cache", recorded)
    assert batched(True) == alone
    prompt_imports = sorted((s, n, done) for s, n, start, done in imports if start == 0)
    assert prompt_imports == sorted((slot, len(p) - 1, True) for slot, p in enumerate(prompts))
    assert all(done for *_, done in imports) and len(imports) > len(prompts)  # each round's
    assert batched(False) != alone


def _rotated(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each output replaced by the next one of the same shape (a pass that mixes rows up)."""
    out = list(outputs)
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, o in enumerate(outputs):
        by_shape.setdefault(tuple(o.shape), []).append(i)
    for same in by_shape.values():
        for a, b in zip(same, same[1:] + same[:1], strict=True):
            out[a] = outputs[b]
    return out


@pytest.mark.parametrize(
    "kind, tree",
    [("self-int4", "off"), ("self-exit:1", "off"), ("self-int4", "static"),
     ("self-exit:1", "dynamic")],
)  # fmt: skip
def test_rows_of_one_draft_model_draft_in_shared_passes(
    tmp_path: Path, kind: str, tree: str, monkeypatch
) -> None:
    """The registry builds a self-drafter's model once per target; each drafter holds a
    cache slot of it (freed with the drafter), so the rows of a batch draft in one pass
    per draft position (chains) or per tree level (trees) instead of one forward per row.
    Each row's tokens, drafts, acceptances and draft-call counts are still exactly those
    it gets alone. Control: a shared pass that hands the rows each other's logits changes
    the drafts (and stays lossless)."""
    import gc

    from speculative.drafters import model as model_drafters
    from speculative.drafters.registry import build_drafter
    from speculative.engine.tree import make_tree_round
    from speculative.exactness.tiny import tiny_target_folder
    from speculative.targets import load_target

    target = load_target(str(tiny_target_folder(tmp_path)), "native", "fp32")  # 2 layers
    first, second = (build_drafter(kind, target) for _ in range(2))
    draft = first.row_group()
    assert draft is not None and draft is second.row_group()
    del first, second
    gc.collect()
    assert draft.acquire_slot() == 0  # the two drafters' slots were freed with them
    draft.release_slot(0)
    prompts = ([2, 4, 6, 8, 2, 4, 6], [3, 5, 7, 9, 3, 5, 11], [1, 2, 3] * 4)
    params = (SamplingParams(temperature=0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.8, top_p=0.9))  # fmt: skip

    def requests() -> list[BatchRequest]:
        out = []
        for i, (p, q) in enumerate(zip(prompts, params, strict=True)):
            drafter = build_drafter(kind, target)
            out.append(
                BatchRequest(
                    p,
                    q,
                    StopCriteria(16),
                    torch.Generator().manual_seed(i),
                    drafter,
                    3,
                    tree=make_tree_round(tree, drafter, 4),
                )
            )
        return out  # fmt: skip

    alone = [
        SpeculativeEngine(target.lm, r.drafter, 3, r.tree).generate(
            r.prompt_ids, r.params, r.stop, r.generator
        )
        for r in requests()
    ]
    widths: list[int] = []
    original = model_drafters._draft_pass_for

    def counted(sessions, passes):
        widths.append(len(passes))
        return original(sessions, passes)

    own = lambda r: (r.token_ids, r.stats.drafted_tokens, r.stats.accepted_tokens,  # noqa: E731
                     r.stats.positions.accepted, r.stats.draft_calls)  # fmt: skip
    with monkeypatch.context() as patch:
        patch.setattr(model_drafters, "_draft_pass_for", counted)
        together = BatchEngine(target.lm, max_batch=3).run(requests())
    assert max(widths) == 3 and sum(w > 1 for w in widths) >= len(widths) // 2
    assert [own(r) for r in together] == [own(r) for r in alone]
    monkeypatch.setattr(model_drafters, "_draft_pass_for", lambda *a: _rotated(original(*a)))
    swapped = BatchEngine(target.lm, max_batch=3).run(requests())
    assert [own(r)[1:] for r in swapped] != [own(r)[1:] for r in together]
    assert swapped[0].token_ids == together[0].token_ids  # still lossless (greedy row)


@pytest.mark.parametrize("tree", ["off", "dynamic"])
def test_an_early_exit_drafter_follows_the_targets_cache(
    tmp_path: Path, tree: str, monkeypatch
) -> None:
    """An early exit's drafter (self-exit) copies the committed positions it lacks from
    the target's cache (its layers' keys and values, bitwise what it would compute: the
    second layer's depend on the first's attention, verified as trees or chains) instead
    of feeding them through its own passes. Each row, in a batch and alone, gets exactly
    the tokens, drafts, acceptances and draft calls of a drafter that catches up by
    itself, while no draft pass feeds a committed token besides the last (chains: one
    token a row; the other drafter's first pass feeds the whole prompt). Control: copying
    another row's keys and values changes the drafts (and stays lossless)."""
    from speculative.engine.tree import make_tree_round

    require_kernels()
    _tiny_llama(tmp_path, layers=3)
    target = load_native(tmp_path, max_length=96, max_slots=4)
    draft = target.early_exit(2)  # shared by every row's drafter, as the registry does
    base = _ids(40, 23)[0].tolist()
    prompts = (base[:7], base[10:17] * 2, base[25:37])
    params = (SamplingParams(temperature=0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.8, top_p=0.9))  # fmt: skip

    def requests(follow: bool) -> list[BatchRequest]:
        out = []
        for i, (p, q) in enumerate(zip(prompts, params, strict=True)):
            drafter = DraftModelDrafter(draft, VOCAB, "self-exit:2", follow_target=follow)
            generator = torch.Generator().manual_seed(i)
            tree_round = make_tree_round(tree, drafter, 4)
            out.append(BatchRequest(p, q, StopCriteria(16), generator, drafter, 3, tree=tree_round))
        return out

    fed: list[int] = []
    original = draft.forward_rows

    def counted(rows):
        fed.extend(row.logits_from + 1 for row in rows)  # the committed tokens fed
        return original(rows)

    monkeypatch.setattr(draft, "forward_rows", counted)
    own = lambda r: (r.token_ids, r.stats.drafted_tokens, r.stats.accepted_tokens,  # noqa: E731
                     r.stats.positions.accepted, r.stats.draft_calls)  # fmt: skip
    results, most_fed = {}, {}
    for follow in (True, False):
        fed.clear()
        batched = BatchEngine(target, max_batch=3).run(requests(follow))
        results[follow] = [own(r) for r in batched]
        most_fed[follow] = max(fed)
    alone = [
        own(SpeculativeEngine(target, r.drafter, 3, r.tree).generate(
            r.prompt_ids, r.params, r.stop, r.generator))
        for r in requests(True)
    ]  # fmt: skip
    assert results[True] == results[False] == alone
    assert most_fed[True] == 1 and most_fed[False] >= len(prompts[0]) - 1

    copy = NativeLlama.import_cache

    def elsewhere(self, source, length, source_slot=None, slot=None, start=0):
        moved = None if source_slot is None else (source_slot + 1) % 3  # another row's
        return copy(self, source, length, moved, slot, start)

    monkeypatch.setattr(NativeLlama, "import_cache", elsewhere)
    swapped = [own(r) for r in BatchEngine(target, max_batch=3).run(requests(True))]
    assert [s[1:] for s in swapped] != [r[1:] for r in results[True]]
    assert swapped[0][0] == results[True][0][0]  # still lossless (greedy row)


def test_the_load_policy_prices_a_lagging_drafters_catch_up(tmp_path: Path) -> None:
    """A drafter whose cache lags the sequence (``ReportsDraftCost.draft_backlog``) must
    feed the missing positions before it drafts: the load policy prices that catch-up as
    a pass that many tokens longer at the drafter's c (spread over a few rounds). With a
    verify cost flat up to 8 tokens and steep after, drafting pays for an early exit that
    follows the target's cache (no backlog) and does not for the same drafter that would
    first feed its whole 41-token prompt; both emit the target's own greedy tokens."""
    require_kernels()
    _tiny_llama(tmp_path, layers=3)
    target = load_native(tmp_path, max_length=96, max_slots=2)
    draft = target.early_exit(2)
    prompt = _ids(41, 29)[0].tolist()
    drafted, tokens = {}, {}
    for follow in (True, False):
        drafter = DraftModelDrafter(draft, VOCAB, "self-exit:2", follow_target=follow)
        load = LoadAwareGamma(lambda n: 1.0 if n <= 8 else float(n))
        request = BatchRequest(prompt, SamplingParams(temperature=0), StopCriteria(12),
                               torch.Generator(), drafter, 4, draft_cost=0.1)  # fmt: skip
        (result,) = BatchEngine(target, max_batch=1, load=load).run([request])
        drafted[follow], tokens[follow] = result.stats.drafted_tokens, result.token_ids
    assert drafted[True] > 0 and drafted[False] == 0
    assert tokens[True] == tokens[False]


def test_logprobs_are_the_target_distribution_of_each_emitted_token(folder: Path) -> None:
    """Rows that ask for log-probabilities get, for every emitted token (accepted,
    recovered, bonus, a tree path's, plain), its log-softmax under the target's logits at
    its position, recomputed here by one forward over prompt + output, and the likeliest
    alternatives there; the tokens are those of the same rows without them."""
    from speculative.engine.tree import make_tree_round

    backend = _backend("kernels")
    specs = _specs()
    target = load_native(folder, max_length=96, backend=backend, max_slots=3)

    def requests(logprobs: int | None) -> list[BatchRequest]:
        out = [replace(_request(spec, folder, backend), logprobs=logprobs) for spec in specs]
        tree_drafter = PromptLookupDrafter(max_ngram=3)  # a tree row: the path's rows
        tree = make_tree_round("static", tree_drafter, 4)
        loop = specs[0].prompt
        greedy = SamplingParams(temperature=0)
        row = BatchRequest(loop, greedy, StopCriteria(16), torch.Generator(), tree_drafter, 3)
        out.append(replace(row, tree=tree, logprobs=logprobs))
        return out

    results = BatchEngine(target, max_batch=3).run(requests(3))
    plain = BatchEngine(target, max_batch=3).run(requests(None))
    reference = load_native(folder, max_length=96, backend=backend)
    kinds = set()
    for request, result, without in zip(requests(3), results, plain, strict=True):
        assert result.token_ids == without.token_ids and without.logprobs is None
        entries = result.logprobs
        assert entries is not None and [e.token for e in entries] == result.token_ids
        prompt = list(request.prompt_ids)
        sequence = torch.tensor([prompt + result.token_ids])
        reference.reset()
        expected = torch.log_softmax(reference.forward(sequence)[0].float(), dim=-1)  # [n, V]
        for i, entry in enumerate(entries):
            row = expected[len(prompt) - 1 + i]  # the position that predicted token i
            assert abs(entry.logprob - row[entry.token].item()) < 1e-4, (i, request)
            values, ids = row.topk(3)
            assert [t for t, _ in entry.top] == ids.tolist()
            assert torch.allclose(torch.tensor([v for _, v in entry.top]), values, atol=1e-4)
            if request.params.greedy:
                assert entry.top[0][0] == entry.token
        for round_ in result.rounds:
            kinds.add("accepted" if round_.num_accepted else "plain")
            kinds.add("tree" if request.tree is not None and round_.drafted else "chain")
    assert kinds == {"accepted", "plain", "tree", "chain"}


def _prompt_reference(folder: Path, backend: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: the target's log-softmax after each prompt prefix (row j
    predicts prompt[j + 1]), from one forward over the prompt on a fresh model."""
    reference = load_native(folder, max_length=96, backend=backend)
    logits = reference.forward(torch.tensor([prompt]))[0, :-1]  # [n - 1, vocab]
    return torch.log_softmax(logits.float(), dim=-1)


def _assert_prompt_entries(entries, prompt: list[int], expected: torch.Tensor) -> None:
    assert entries is not None and [e.token for e in entries] == prompt[1:]
    for entry, row in zip(entries, expected, strict=True):
        assert abs(entry.logprob - row[entry.token].item()) < 1e-4
        values, ids = row.topk(2)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert torch.allclose(torch.tensor([v for _, v in entry.top]), values, atol=1e-4)


@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_prompt_logprobs_score_every_prompt_token(folder: Path, backend: str) -> None:
    """Rows that ask for the prompt's log-probabilities get one per prompt token after the
    first, its log-softmax after the tokens before it (one reference forward over the
    prompt), and the likeliest alternatives there: through chunked prefill, beside a row
    whose cache already holds the prompt (a row that shared that prefix would have no
    logits for it), with a drafter, and with max_new_tokens 0 (the prompt scored, nothing
    generated). The generated tokens are those of the same rows without them."""
    _backend(backend)
    prompt = _ids(30, 51)[0].tolist()[:23]
    expected = _prompt_reference(folder, backend, prompt)
    target = load_native(folder, max_length=96, backend=backend, max_slots=5)
    engine = BatchEngine(target, max_batch=5, prefill_chunk=5)

    def row(scored: bool, new: int = 10, drafter: Drafter | None = None) -> BatchRequest:
        greedy, stop = SamplingParams(temperature=0), StopCriteria(new)
        return BatchRequest(prompt, greedy, stop, torch.Generator(), drafter, 3,
                            prompt_logprobs=2 if scored else None)  # fmt: skip

    donor = engine.add(row(False, 40))
    while len(engine.rows[donor].session.cached) < len(prompt):
        engine.step()  # the donor's cache holds the whole prompt (and more)
    probe = engine.pool.open(prompt=prompt)
    assert len(probe.cached) > 0  # a row that did not score its prompt would share it
    probe.release()
    rows = [row(True), row(True, 0), row(True, drafter=PromptLookupDrafter(3)), row(False)]
    ids = [engine.add(request) for request in rows]
    while engine.rows:
        engine.step()
    results = [engine.finished[i] for i in ids]
    scored, empty, drafted, unscored = results
    for result in (scored, empty, drafted):
        _assert_prompt_entries(result.prompt_logprobs, prompt, expected)
    assert unscored.prompt_logprobs is None
    assert scored.token_ids == drafted.token_ids == unscored.token_ids
    assert len(scored.token_ids) == 10
    assert empty.token_ids == [] and empty.finish_reason == "length"
    assert empty.stats.target_calls == 0  # the prompt's passes only: no round was decoded


def test_prompt_logprobs_after_an_earlier_generation_on_one_model(folder: Path) -> None:
    """The single-sequence engine keeps its cache between generations: a generation that
    scores its prompt rescores the positions the earlier one left cached."""
    require_kernels()
    prompt = _ids(30, 51)[0].tolist()[:14]
    target = load_native(folder, max_length=96)
    engine = SpeculativeEngine(target, PromptLookupDrafter(3), 3)
    greedy, stop = SamplingParams(temperature=0), StopCriteria(8)
    first = engine.generate(prompt, greedy, stop, torch.Generator())
    rounds = list(engine.stream(prompt, greedy, stop, torch.Generator(), prompt_logprobs=2))
    assert [t for r in rounds for t in r.tokens] == first.token_ids
    assert [r.prompt_logprobs is None for r in rounds] == [False] + [True] * (len(rounds) - 1)
    expected = _prompt_reference(folder, "kernels", prompt)
    _assert_prompt_entries(rounds[0].prompt_logprobs, prompt, expected)


class _SecondBranch(PromptLookupDrafter):
    """Token trees whose root's first child is wrong and whose second starts the target's
    own greedy ``continuation``: every accepted path leaves the tree's first nodes."""

    def __init__(self, prompt_length: int, continuation: list[int]) -> None:
        super().__init__(max_ngram=3)
        self.prompt_length, self.continuation = prompt_length, continuation

    def propose_tree(
        self,
        context: Sequence[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftTree:
        done = len(context) - self.prompt_length
        right = self.continuation[done : done + 2]
        if len(right) < 2:
            return DraftTree(torch.zeros(0), torch.zeros(0))
        wrong = (right[0] + 1) % VOCAB
        return DraftTree(torch.tensor([wrong, *right]), torch.tensor([-1, -1, 1]))


def test_logprobs_of_a_tree_path_come_from_its_nodes_rows(folder: Path) -> None:
    """A tree round's emitted tokens take their log-probabilities from the root's row and
    the accepted nodes' rows, wherever those nodes sit in the tree."""
    from speculative.engine.tree import make_tree_round

    backend = _backend("kernels")
    target = load_native(folder, max_length=96, backend=backend, max_slots=2)
    prompt = _ids(30, 51)[0].tolist()[:9]
    greedy, stop = SamplingParams(temperature=0), StopCriteria(max_new_tokens=12)
    plain = BatchEngine(target, max_batch=1).run(
        [BatchRequest(prompt, greedy, stop, torch.Generator(), logprobs=0)]
    )[0]
    drafter = _SecondBranch(len(prompt), plain.token_ids)
    tree = make_tree_round("static", drafter, 4)
    row = BatchRequest(prompt, greedy, stop, torch.Generator(), drafter, 3, tree=tree, logprobs=0)
    result = BatchEngine(target, max_batch=1).run([row])[0]
    assert result.token_ids == plain.token_ids
    assert max(r.num_accepted for r in result.rounds) == 2  # paths [1, 2]: off the first nodes
    assert result.logprobs is not None and plain.logprobs is not None
    for tree_entry, plain_entry in zip(result.logprobs, plain.logprobs, strict=True):
        assert abs(tree_entry.logprob - plain_entry.logprob) < 1e-5


def _cli_job(tmp_path: Path, *options: str) -> tuple[Path, list[dict], Path, Path, list[str]]:
    """A tiny model, two prompt records in a JSONL file, where results go, and the
    `generate` command line for that model (with ``options``)."""
    import json

    from tiny import save_tiny

    folder = save_tiny(tmp_path / "tiny", seed=2, layers=2)
    records = [{"prompt": "the cat sat on the mat and the cat"}, {"prompt": "a dog ran"}]
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    base = ["generate", "--target", str(folder), "--runtime", "native", "--no-chat", *options]
    return folder, records, prompts, out, base


def test_cli_logprobs_in_batch_lines_and_single_json(tmp_path: Path, capsys) -> None:
    """``--logprobs N``: each JSONL line (and a single prompt's --json) lists every token's
    log-probability with N alternatives, the values the Python API gives for that prompt
    alone; without --json it is refused before loading."""
    import json

    from speculative.pipeline import Speculator
    from test_cli import run_cli

    folder, records, prompts, out, base = _cli_job(
        tmp_path, "--max-new-tokens", "8", "--draft", "ngram", "--gamma", "3", "--logprobs", "2"
    )
    code, _, err = run_cli(capsys, *base, "--prompts", str(prompts), "--out", str(out))
    assert code == 0, err
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    single = Speculator.load(str(folder), "ngram", 3, "native")
    for record, line in zip(records, lines, strict=True):
        alone = single.generate(record["prompt"], chat=False, max_new_tokens=8, logprobs=2)
        assert alone.logprobs is not None
        assert [e["token"] for e in line["logprobs"]] == line["token_ids"] == alone.token_ids
        for entry, expected in zip(line["logprobs"], alone.logprobs, strict=True):
            assert abs(entry["logprob"] - expected.logprob) < 1e-5 and len(entry["top"]) == 2
    code, stdout, err = run_cli(capsys, *base, "--prompt", records[0]["prompt"], "--json")
    assert code == 0, err
    output = json.loads(stdout.strip().splitlines()[-1])
    assert [e["token"] for e in output["logprobs"]] == output["token_ids"]
    code, _, err = run_cli(capsys, *base, "--prompt", records[0]["prompt"])
    assert code != 0 and "--logprobs shows in the --json output" in err


def test_cli_prompt_logprobs_score_prompts(tmp_path: Path, capsys) -> None:
    """``--prompt-logprobs N --max-new-tokens 0`` scores prompts without generating: each
    ``--prompts`` line and a single prompt's --json list the prompt's tokens after the
    first with N alternatives, the values the Python API gives; a budget of 0 without it
    is refused before loading."""
    import json

    from speculative.pipeline import Speculator
    from test_cli import run_cli

    folder, records, prompts, out, base = _cli_job(
        tmp_path, "--max-new-tokens", "0", "--prompt-logprobs", "2"
    )
    code, _, err = run_cli(capsys, *base, "--prompts", str(prompts), "--out", str(out))
    assert code == 0, err
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    single = Speculator.load(str(folder), "ngram", 3, "native")
    for record, line in zip(records, lines, strict=True):
        alone = single.generate(record["prompt"], chat=False, max_new_tokens=0, prompt_logprobs=2)
        assert alone.prompt_logprobs is not None and alone.token_ids == line["token_ids"] == []
        assert len(line["prompt_logprobs"]) == alone.prompt_tokens - 1
        for got, want in zip(line["prompt_logprobs"], alone.prompt_logprobs, strict=True):
            assert got["token"] == want.token and abs(got["logprob"] - want.logprob) < 1e-5
            assert [t for t, _ in got["top"]] == [t for t, _ in want.top]
    code, stdout, err = run_cli(capsys, *base, "--prompt", records[0]["prompt"], "--json")
    assert code == 0, err
    output = json.loads(stdout.strip().splitlines()[-1])
    assert output["token_ids"] == [] and output["finish_reason"] == "length"
    assert output["prompt_logprobs"] == lines[0]["prompt_logprobs"]
    code, _, err = run_cli(capsys, *base[:-2], "--prompt", records[0]["prompt"], "--json")
    assert code != 0 and "--max-new-tokens 0 generates nothing" in err


@pytest.mark.parametrize("processor", ["penalties", "constraint"])
def test_penalized_rows_equal_plain_penalized_decoding(folder: Path, processor: str) -> None:
    """Greedy rows with penalties, or a token constraint, drafted by chains or trees,
    batched, emit plain penalized (constrained) decoding's tokens; the penalties (the
    constraint) change them (the control)."""
    from speculative.engine.tree import make_tree_round
    from speculative.sampling.penalties import Penalties
    from test_engine_markov import NoRepeat

    backend = _backend("kernels")
    target = load_native(folder, max_length=96, backend=backend, max_slots=3)
    loop = _specs()[0].prompt
    greedy, stop = SamplingParams(temperature=0), StopCriteria(max_new_tokens=24)
    if processor == "penalties":
        extra = {"penalties": Penalties(presence=0.3, frequency=0.2, repetition=1.2)}
    else:  # no token twice in a row (a fresh constraint for every row)
        extra = {"constraint": NoRepeat(loop)}
    alone = load_native(folder, max_length=96, backend=backend)
    engine = SpeculativeEngine(alone, None)
    plain = engine.generate(loop, greedy, stop, torch.Generator(), **extra)
    unpenalized = engine.generate(loop, greedy, stop, torch.Generator())
    assert plain.token_ids != unpenalized.token_ids
    # drafters right on the penalized continuation, so that rows past the first verify
    chain, tree = _Oracle(len(loop), plain.token_ids), _SecondBranch(len(loop), plain.token_ids)
    chain_row = BatchRequest(loop, greedy, stop, torch.Generator(), chain, 4)
    tree_row = replace(chain_row, drafter=tree, tree=make_tree_round("static", tree, 4))
    rows = [chain_row, tree_row, replace(chain_row, drafter=None)]
    if processor == "penalties":
        rows = [replace(row, **extra) for row in rows]
    else:
        rows = [replace(row, constraint=NoRepeat(loop)) for row in rows]
    results = BatchEngine(target, max_batch=3).run(rows)
    for result in results:
        assert result.token_ids == plain.token_ids
    assert max(r.num_accepted for r in results[0].rounds) == 4
    assert max(r.num_accepted for r in results[1].rounds) == 2


def test_a_greedy_check_takes_allowed_argmax_ids_without_masks(folder: Path) -> None:
    """A constraint that can check single tokens (ChecksTokens) lets greedy chains take
    the kernels' argmax wherever it is allowed and mask only the rows where it is not:
    the same tokens as masking every row, far fewer masks, and masks still where the
    model's argmax is refused (the constraint changes the output: the control)."""
    from test_engine_markov import NoRepeat

    class Counted(NoRepeat):
        def __init__(self, prompt: list[int]) -> None:
            super().__init__(prompt)
            self.masked = 0

        def restrict(self, logits: torch.Tensor, extras) -> torch.Tensor:
            self.masked += len(extras)
            return super().restrict(logits, extras)

    class Checked(Counted):
        def allows(self, extra, token: int) -> bool:
            return token != (extra[-1] if extra else self.last)

    backend = _backend("kernels")
    target = load_native(folder, max_length=96, backend=backend, max_slots=1)
    loop = _specs()[0].prompt
    greedy, stop = SamplingParams(temperature=0), StopCriteria(max_new_tokens=24)
    free = BatchEngine(target, max_batch=1).run(
        [BatchRequest(loop, greedy, stop, torch.Generator(), PromptLookupDrafter(3), 4)]
    )[0]
    results, masked = {}, {}
    for kind in (Counted, Checked):
        constraint = kind(loop)
        row = BatchRequest(loop, greedy, stop, torch.Generator(), PromptLookupDrafter(3), 4,
                           constraint=constraint)  # fmt: skip
        results[kind] = BatchEngine(target, max_batch=1).run([row])[0].token_ids
        masked[kind] = constraint.masked
    assert results[Checked] == results[Counted] != free.token_ids
    assert 0 < masked[Checked] < masked[Counted] / 4


class _FailsAfter:
    """A token constraint that allows every token and fails after ``n`` tokens."""

    def __init__(self, n: int) -> None:
        self.left = n

    def extend(self, tokens: Sequence[int]) -> None:
        from speculative.sampling.constraints import ConstraintError

        self.left -= len(tokens)
        if self.left <= 0:
            raise ConstraintError("the grammar gave up")

    def restrict(self, logits: torch.Tensor, extras) -> torch.Tensor:
        return logits


def test_a_failing_constraint_ends_its_row_alone(folder: Path) -> None:
    """A row whose constraint fails ends with finish reason "error" and the message; the
    row beside it decodes on to its own tokens; the single-sequence engine raises."""
    from speculative.sampling.constraints import ConstraintError

    backend = _backend("kernels")
    target = load_native(folder, max_length=96, backend=backend, max_slots=2)
    loop = _specs()[0].prompt
    greedy, stop = SamplingParams(temperature=0), StopCriteria(max_new_tokens=16)
    row = BatchRequest(loop, greedy, stop, torch.Generator(), PromptLookupDrafter(3), 3)
    failing, fine = BatchEngine(target, max_batch=2).run(
        [replace(row, constraint=_FailsAfter(5)), row]
    )
    alone = BatchEngine(target, max_batch=1).run([row])[0]
    assert failing.finish_reason == "error" and failing.error == "the grammar gave up"
    assert 0 < len(failing.token_ids) < 16
    assert fine.token_ids == alone.token_ids and fine.error is None
    engine = SpeculativeEngine(load_native(folder, max_length=96, backend=backend), None)
    with pytest.raises(ConstraintError, match="gave up"):
        engine.generate(loop, greedy, stop, torch.Generator(), None, _FailsAfter(3))


def test_the_servers_scheduler_fails_only_the_row_whose_constraint_failed(folder: Path) -> None:
    """Through the server's scheduler, a row whose constraint fails gets an error event
    with the message; the row beside it finishes with its own tokens."""
    import asyncio

    from speculative.server.scheduler import DoneEvent, ErrorEvent, Job, Scheduler

    backend = _backend("kernels")
    target = load_native(folder, max_length=96, backend=backend, max_slots=2)
    loop = _specs()[0].prompt
    greedy, stop = SamplingParams(temperature=0), StopCriteria(max_new_tokens=16)
    row = BatchRequest(loop, greedy, stop, torch.Generator(), PromptLookupDrafter(3), 3)
    alone = BatchEngine(target, max_batch=1).run([row])[0]

    async def last_events() -> list:
        scheduler = Scheduler(BatchEngine(target, max_batch=2))
        running = asyncio.get_running_loop()
        jobs = [Job(replace(row, constraint=_FailsAfter(5)), running), Job(row, running)]
        scheduler.start()
        try:
            for job in jobs:
                scheduler.submit(job)
            return [await _last_event(job) for job in jobs]
        finally:
            scheduler.stop()

    failed, done = asyncio.run(last_events())
    assert isinstance(failed, ErrorEvent) and failed.message == "the grammar gave up"
    assert isinstance(done, DoneEvent) and done.result.token_ids == alone.token_ids


def test_the_servers_scheduler_survives_a_row_that_cannot_start(folder: Path) -> None:
    """A row whose admission fails unexpectedly (its drafter breaks on reset) gets an
    error event naming the failure and leaves no cache slot held; the scheduler goes on,
    and the next row decodes (before: the scheduler's loop died and every later request
    waited forever)."""
    import asyncio

    from speculative.server.scheduler import DoneEvent, ErrorEvent, Job, Scheduler

    backend = _backend("kernels")
    target = load_native(folder, max_length=96, backend=backend, max_slots=2)
    greedy, stop = SamplingParams(temperature=0), StopCriteria(max_new_tokens=6)
    row = BatchRequest(_specs()[0].prompt, greedy, stop, torch.Generator(), None, 0)

    async def ends() -> list:
        scheduler = Scheduler(BatchEngine(target, max_batch=2))
        running = asyncio.get_running_loop()
        jobs = [Job(replace(row, drafter=_BreaksOnReset(), gamma=3), running), Job(row, running)]
        scheduler.start()
        try:
            out = []
            for job in jobs:  # one after the other: the second comes after the failure
                scheduler.submit(job)
                out.append(await _last_event(job))
            return out
        finally:
            scheduler.stop()

    failed, done = asyncio.run(ends())
    assert isinstance(failed, ErrorEvent) and "RuntimeError: broken drafter" in failed.message
    assert isinstance(done, DoneEvent) and len(done.result.token_ids) == 6
    assert sorted(target.acquire_slot() for _ in range(2)) == [0, 1]  # no slot left held


@pytest.mark.parametrize("by_priority", [True, False])
def test_the_servers_scheduler_admits_by_priority_under_that_policy(
    folder: Path, by_priority: bool, tmp_path: Path
) -> None:
    """One batch row, five waiting requests of priorities 5, 1, 3, 1, 0: under the
    priority policy they are admitted lowest value first, ties in arrival order; the
    control (first come, first served) admits them as they came. Through the server, a
    priority under first come, first served is a 400 naming it."""
    import asyncio

    from server_helpers import http, start_server, tiny_chat_folder
    from speculative.server.scheduler import Job, Scheduler

    target = load_native(folder, max_length=96, backend=_backend("kernels"), max_slots=1)
    greedy, stop = SamplingParams(temperature=0), StopCriteria(max_new_tokens=3)
    row = BatchRequest(_specs()[0].prompt, greedy, stop, torch.Generator(), None, 0)
    priorities = [5, 1, 3, 1, 0]

    async def admitted() -> list[int]:
        scheduler = Scheduler(BatchEngine(target, max_batch=1), by_priority=by_priority)
        running = asyncio.get_running_loop()
        jobs = [Job(row, running, priority=p) for p in priorities]
        for job in jobs:  # all waiting before the first admission
            scheduler.submit(job)
        scheduler.start()
        try:
            for job in jobs:
                await _last_event(job)
        finally:
            scheduler.stop()
        return sorted(range(len(jobs)), key=lambda i: jobs[i].admitted)

    order = asyncio.run(admitted())
    assert order == ([4, 1, 3, 2, 0] if by_priority else [0, 1, 2, 3, 4])
    if not by_priority:
        with start_server(tiny_chat_folder(tmp_path / "chat")) as server:
            model = http(server.url + "/v1/models", key=None)[1]["data"][0]["id"]
            body = {"model": model, "prompt": "the cat", "max_tokens": 2, "priority": 1}
            status, error = http(server.url + "/v1/completions", "POST", body, key=None)
            assert status == 400 and error["error"]["param"] == "priority"


async def _last_event(job):
    """A scheduler job's last event (its DoneEvent or ErrorEvent)."""
    import asyncio

    from speculative.server.scheduler import DoneEvent, ErrorEvent

    while True:
        event = await asyncio.wait_for(job.events.get(), 30)
        if isinstance(event, DoneEvent | ErrorEvent):
            return event


class _BreaksOnReset(PromptLookupDrafter):
    def reset(self) -> None:
        raise RuntimeError("broken drafter")


class _Oracle(_SecondBranch):
    """Chains of the target's own ``continuation``: every draft is accepted."""

    def propose(
        self,
        context: Sequence[int],
        gamma: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        done = len(context) - self.prompt_length
        return Draft(tokens=self.continuation[done : done + gamma])


def test_cli_openai_batch_requests_answer_as_the_server_does(tmp_path: Path, capsys) -> None:
    """A file of OpenAI batch requests (chat and completions, greedy and seeded): each
    output line's body has the text, finish reason and usage the server gives the same
    request; a rerun after a crash resumes by custom_id; what a row cannot serve is one
    line naming it."""
    import json

    from server_helpers import http, start_server, tiny_chat_folder
    from test_cli import run_cli

    folder = tiny_chat_folder(tmp_path / "tiny")
    chat = {"messages": [{"role": "user", "content": "the cat sat"}]}
    plain = {"prompt": "the cat sat on", "max_tokens": 9, "temperature": 0, "stop": "mat"}
    seeded = {**chat, "max_completion_tokens": 7, "temperature": 0.9, "seed": 3}
    bodies = {
        "greedy": ("/v1/chat/completions", {**chat, "max_tokens": 8, "temperature": 0}),
        "plain": ("/v1/completions", plain),
        "seeded": ("/v1/chat/completions", seeded),
    }
    requests = [
        {"custom_id": name, "method": "POST", "url": url, "body": {"model": "m", **body}}
        for name, (url, body) in bodies.items()
    ]
    prompts, out = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in requests))
    argv = ["generate", "--target", str(folder), "--runtime", "native", "--json"]
    argv += ["--prompts", str(prompts), "--out", str(out), "--draft", "ngram", "--gamma", "4"]
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 0, err
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == list(bodies)
    with start_server(folder) as server:
        model = http(server.url + "/v1/models", key=None)[1]["data"][0]["id"]
        for line, (url, body) in zip(lines, bodies.values(), strict=True):
            status, served = http(server.url + url, "POST", {"model": model, **body}, key=None)
            assert status == 200 and line["response"]["status_code"] == 200
            made = line["response"]["body"]
            counts = {key: served["usage"][key] for key in made["usage"]}  # (and the cache's)
            assert made["object"] == served["object"] and made["usage"] == counts
            ours, theirs = made["choices"][0], served["choices"][0]
            assert ours["finish_reason"] == theirs["finish_reason"]
            if "message" in ours:
                assert ours["message"]["content"] == theirs["message"]["content"]
            else:
                assert ours["text"] == theirs["text"]
    kept = out.read_text().splitlines()
    out.write_text(kept[0] + "\n" + kept[1][:30])  # a crash mid-line
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 0 and json.loads(stdout.strip().splitlines()[-1])["rows"] == 2, err
    again = [
        json.loads(line)["response"]["body"]["choices"] for line in out.read_text().splitlines()
    ]
    assert again == [line["response"]["body"]["choices"] for line in lines]
    for bad, named in [({"n": 2}, "n is not served"), ({"tools": [{}]}, "tools is not served")]:
        prompts.write_text(json.dumps({**requests[0], "body": {**requests[0]["body"], **bad}}))
        code, _, err = run_cli(capsys, *argv)
        assert code != 0 and f"batch.jsonl:1: {named}" in err, err
    prompts.write_text(json.dumps(requests[0]) + "\n" + json.dumps({"prompt": "a"}) + "\n")
    code, _, err = run_cli(capsys, *argv)
    assert code != 0 and "batch.jsonl:2: OpenAI batch requests and prompts records are mixed" in err
