"""The generation engine on the specification's toy Markov models."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

import broken
from speculative.drafters import DraftModelDrafter, PromptLookupDrafter
from speculative.drafters.prediction import PredictionDrafter
from speculative.engine import (
    AdaptiveGamma,
    HeuristicGamma,
    SpeculativeEngine,
    StopCriteria,
)
from speculative.models import MarkovLM, seed_matrices
from speculative.sampling import SamplingParams
from speculative.sampling.penalties import Penalties

pytestmark = pytest.mark.usefixtures("single_thread")

P, Q = seed_matrices()


def make_engine(drafter: str | None, gamma=4) -> SpeculativeEngine:
    target = MarkovLM(P, "target")
    if drafter is None:
        return SpeculativeEngine(target, None)
    if drafter == "ngram":
        return SpeculativeEngine(target, PromptLookupDrafter(), gamma)
    if drafter == "prediction":  # a predicted output (prompts here are 2 or 3 tokens)
        predicted = PredictionDrafter([1, 2, 0, 1, 3, 4, 2, 2, 0, 1] * 5, 3, min_match=1)
        return SpeculativeEngine(target, predicted, gamma)
    return SpeculativeEngine(target, DraftModelDrafter(MarkovLM(Q, "draft"), 5), gamma)


def sequence_counts(engine, n, length, params, seed) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(5**length)
    stop = StopCriteria(max_new_tokens=length)
    for _ in range(n):
        tokens = engine.generate([0, 3, 0], params, stop, g).token_ids
        assert len(tokens) == length
        counts[int("".join(map(str, tokens)), 5)] += 1
    return counts


def two_sample_p_value(a: np.ndarray, b: np.ndarray) -> float:
    keep = (a + b) > 0
    return float(stats.chi2_contingency(np.stack([a[keep], b[keep]]))[1])


@pytest.mark.parametrize(
    "drafter, gamma, params",
    [
        ("model", 4, SamplingParams()),
        ("model", AdaptiveGamma(c=0.1, max_gamma=6), SamplingParams()),
        ("model", HeuristicGamma(), SamplingParams(top_k=3)),
        ("model", 2, SamplingParams(temperature=0.7, top_p=0.8)),
        ("model", 3, SamplingParams(min_p=0.3)),
        ("ngram", 3, SamplingParams()),
        ("prediction", 4, SamplingParams()),
    ],
)
def test_sequence_distribution_matches_plain_sampling(drafter, gamma, params):
    n, length = 3000, 3
    plain = sequence_counts(make_engine(None), n, length, params, seed=1)
    spec = sequence_counts(make_engine(drafter, gamma), n, length, params, seed=2)
    assert two_sample_p_value(plain, spec) > 1e-3


def test_sequence_distribution_negative_control():
    """The draft's own samples (what an always-accept sampler emits) are detected."""
    n, length = 3000, 3
    plain = sequence_counts(make_engine(None), n, length, SamplingParams(), seed=1)
    draft_only = SpeculativeEngine(MarkovLM(Q), None)
    wrong = sequence_counts(draft_only, n, length, SamplingParams(), seed=2)
    assert two_sample_p_value(plain, wrong) < 1e-3


@pytest.mark.parametrize("rule", [broken.always_accept, broken.resample_from_target])
def test_sequence_distribution_negative_control_broken_rule(rule):
    """The same engine and drafter as above with a broken verification rule (the engine's
    verifier seam): the test above detects it."""
    n, length = 3000, 3
    plain = sequence_counts(make_engine(None), n, length, SamplingParams(), seed=1)
    target, draft = MarkovLM(P, "target"), DraftModelDrafter(MarkovLM(Q, "draft"), 5)
    engine = SpeculativeEngine(target, draft, 4, verifier=rule)
    wrong = sequence_counts(engine, n, length, SamplingParams(), seed=2)
    assert two_sample_p_value(plain, wrong) < 1e-3


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("drafter", ["model", "ngram", "prediction"])
def test_greedy_matches_plain(gamma, drafter):
    params = SamplingParams(temperature=0)
    stop = StopCriteria(max_new_tokens=40)
    g = torch.Generator().manual_seed(0)
    plain = make_engine(None).generate([1, 2], params, stop, g).token_ids
    spec = make_engine(drafter, gamma).generate([1, 2], params, stop, g)
    assert spec.token_ids == plain
    assert spec.stats.new_tokens == 40


def test_rng_hygiene_and_reproducibility():
    torch.manual_seed(123)
    np.random.seed(123)
    torch_state = torch.get_rng_state()
    np_state = np.random.get_state()[1].copy()
    stop = StopCriteria(max_new_tokens=30)
    runs = [
        make_engine("model").generate([0], SamplingParams(), stop, torch.Generator().manual_seed(7))
        for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert (np.random.get_state()[1] == np_state).all()


def test_stops_exactly_inside_a_block():
    eos = 4
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        result = make_engine("model", 6).generate(
            [0],
            SamplingParams(),
            StopCriteria(max_new_tokens=50, eos_token_ids=frozenset({eos})),
            g,
        )
        tokens = result.token_ids
        assert eos not in tokens[:-1]
        assert tokens[-1] == eos or len(tokens) == 50
        assert result.stats.new_tokens == len(tokens)
    for budget in (1, 2, 3, 7):
        result = make_engine("model", 6).generate(
            [0], SamplingParams(), StopCriteria(max_new_tokens=budget), g
        )
        assert len(result.token_ids) == budget == result.stats.new_tokens


def test_stop_strings_cut_tokens():
    decode = lambda ids: "".join("abcde"[i] for i in ids)  # noqa: E731
    params, seed = SamplingParams(), 4
    uncut = make_engine("model", 5).generate(
        [0], params, StopCriteria(max_new_tokens=100), torch.Generator().manual_seed(seed)
    )
    full = decode(uncut.token_ids)
    hit = full.find("ea")
    assert hit >= 0  # the stop string really occurs (else nothing below is tested)
    stop = StopCriteria(max_new_tokens=100, stop_strings=("ea",), decode=decode)
    generator = torch.Generator().manual_seed(seed)
    result = make_engine("model", 5).generate([0], params, stop, generator)
    # the same seeded run, cut right after the first "ea" (the token that completes it)
    assert result.token_ids == uncut.token_ids[: hit + 2]
    assert result.finish_reason == "stop"
    assert stop.final_text(decode(result.token_ids)) == full[:hit]


def _reference_stop(tokens, decode, stop, min_tokens):
    """vLLM's min_tokens rule token by token: after each output token from index
    min_tokens - 1 on, a stop string ending in that token's text ends the output."""
    for i in range(len(tokens)):
        before, text = decode(tokens[:i]), decode(tokens[: i + 1])
        if i + 1 >= min_tokens and text.find(stop, max(0, len(before) - len(stop) + 1)) >= 0:
            return i + 1
    return None


@pytest.mark.parametrize("min_tokens", [0, 1, 3, 6, 12])
def test_min_tokens_lets_no_stop_string_end_inside_them(min_tokens: int):
    """With ``min_tokens``, a stop string the first min_tokens - 1 tokens complete does
    not count: the seeded run is cut where the token-by-token reference cuts it, for
    several seeds and block sizes; the text is cut at the first stop string that counts.
    Control: the same runs without min_tokens stop earlier on some seed."""
    decode = lambda ids: "".join("abcde"[i] for i in ids)  # noqa: E731
    earlier = 0
    for seed in range(8):
        for gamma in (1, 4):
            uncut = make_engine("model", gamma).generate(
                [0], SamplingParams(), StopCriteria(max_new_tokens=60),
                torch.Generator().manual_seed(seed),
            )  # fmt: skip
            want = _reference_stop(uncut.token_ids, decode, "ae", min_tokens)
            stop = StopCriteria(60, stop_strings=("ae",), decode=decode, min_tokens=min_tokens)
            result = make_engine("model", gamma).generate(
                [0], SamplingParams(), stop, torch.Generator().manual_seed(seed)
            )
            assert result.token_ids == uncut.token_ids[: want or 60], (seed, gamma)
            text = decode(result.token_ids)
            quiet = len(decode(result.token_ids[: max(0, min_tokens - 1)]))
            cut = stop.final_text(text, result.token_ids)
            assert cut == (text if want is None else text[: text.index("ae", max(0, quiet - 1))])
            plain = _reference_stop(uncut.token_ids, decode, "ae", 0)
            earlier += plain is not None and (want is None or plain < want)
    assert earlier > 0 or min_tokens <= 1


def test_stop_string_window_is_bounded_and_finds_boundary_hits():
    seen: list[int] = []

    def decode(ids):
        seen.append(len(ids))
        return "".join("abcde"[i] for i in ids)

    stop = StopCriteria(max_new_tokens=10_000, stop_strings=("cab",), decode=decode)
    generated = [0, 1] * 2000  # "abab...": no stop string yet
    assert stop.cut(generated, [3, 4]).finished is False  # "...ab" + "de"
    assert max(seen) <= 4 * 3 + 4 + 2  # a tail window, not the whole text
    # the stop string straddles the old text and the new tokens: "...b" + "c" "a" "b"
    cut = stop.cut([*generated, 2], [0, 1, 3])
    assert (cut.keep, cut.reason) == (2, "stop")


def test_stats_are_consistent():
    result = make_engine("model", 4).generate(
        [0], SamplingParams(), StopCriteria(max_new_tokens=200), torch.Generator().manual_seed(5)
    )
    s = result.stats
    assert s.new_tokens == 200 == len(result.token_ids)
    assert s.target_calls == len(result.rounds)
    assert s.draft_calls >= s.drafted_tokens - s.target_calls
    assert 0.5 < s.acceptance_rate < 1
    assert s.mean_accepted_length == pytest.approx(200 / s.target_calls)
    assert len(s.per_position_acceptance) == 4


def test_stats_of_generations_side_by_side():
    """GenerationStats.together: two generations' counts as one (rates from the sums, the
    positions merged, the longer one's seconds)."""
    from speculative.engine.stats import GenerationStats

    runs = [
        make_engine("model", gamma)
        .generate(
            [0], SamplingParams(), StopCriteria(max_new_tokens=n), torch.Generator().manual_seed(n)
        )
        .stats
        for gamma, n in ((4, 60), (2, 90))
    ]
    both = GenerationStats.together(runs)
    assert both.new_tokens == 150 and both.target_calls == sum(r.target_calls for r in runs)
    drafted = sum(r.drafted_tokens for r in runs)
    assert both.acceptance_rate == sum(r.accepted_tokens for r in runs) / drafted
    assert both.mean_accepted_length == 150 / both.target_calls
    reached = [a + b for a, b in zip(*(r.positions.reached[:2] for r in runs), strict=True)]
    assert both.positions.reached[:2] == reached and len(both.positions.reached) == 4
    assert (
        both.seconds == max(r.seconds for r in runs)
        and both.gammas == runs[0].gammas + runs[1].gammas
    )


def test_engine_bad_input():
    engine = make_engine("model")
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], SamplingParams(), StopCriteria(max_new_tokens=3), torch.Generator())
    with pytest.raises(ValueError, match="max_new_tokens"):
        StopCriteria(max_new_tokens=-1)


def test_ngram_drafts_a_whole_short_loop_every_round():
    # a target that repeats 0 1 2: the context's end matches 3 tokens back, and every round
    # still drafts γ = 6 tokens (the copy runs on past the context's end), all of them kept
    loop = np.zeros((5, 5))
    for state in range(5):
        loop[state, (state + 1) % 3] = 1.0
    engine = SpeculativeEngine(MarkovLM(loop), PromptLookupDrafter(), 6)
    result = engine.generate(
        [0, 1, 2, 0],
        SamplingParams(temperature=0.0),
        StopCriteria(max_new_tokens=35),
        torch.Generator().manual_seed(0),
    )
    assert result.token_ids == [(1 + i) % 3 for i in range(35)]
    assert result.stats.accepted_tokens == result.stats.drafted_tokens
    # 7 tokens a round (6 drafts and the bonus); drafts that stopped at the context's end
    # (3 a round) took 9
    assert result.stats.target_calls == 5


PENALTIES = Penalties(presence=0.7, frequency=0.4, repetition=1.3)
HOLDING = Penalties(min_tokens=2, held=(4, 1))  # tokens 4 and 1 not before position 2
VARIANTS = {"penalties": PENALTIES, "min_tokens": HOLDING,
            "both": Penalties(presence=0.7, frequency=0.4, repetition=1.3, min_tokens=1,
                              held=(2,))}  # fmt: skip


def penalized_law(prompt: list[int], length: int, penalties: Penalties) -> np.ndarray:
    """The exact probability of every output sequence of ``length`` tokens after
    ``prompt`` from the target P with ``penalties`` (temperature 1), by enumeration."""
    logp = torch.log(torch.as_tensor(P)).double()
    law = np.zeros(5**length)
    for index in range(5**length):
        tokens = [int(d) for d in np.base_repr(index, 5).zfill(length)]
        p, history = 1.0, list(prompt)
        for t, token in enumerate(tokens):
            row = logp[history[-1]].clone()
            output = tokens[:t]
            for seen in set(history):  # repetition: prompt and output tokens
                row[seen] = row[seen] / penalties.repetition if row[seen] > 0 else (
                    row[seen] * penalties.repetition)  # fmt: skip
            for seen in set(output):
                row[seen] -= penalties.frequency * output.count(seen) + penalties.presence
            if t < penalties.min_tokens:  # held back before min_tokens
                row[list(penalties.held)] = -math.inf
            p *= torch.softmax(row, dim=0)[token].item()
            history.append(token)
        law[index] = p
    return law


def penalized_counts(engine, n, length, seed, penalties=PENALTIES) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(5**length)
    stop = StopCriteria(max_new_tokens=length)
    for _ in range(n):
        tokens = engine.generate([0, 3, 0], SamplingParams(), stop, g, penalties).token_ids
        counts[int("".join(map(str, tokens)), 5)] += 1
    return counts


def goodness_of_fit(counts: np.ndarray, law: np.ndarray) -> float:
    keep = law > 0
    expected = law[keep] / law[keep].sum() * counts.sum()
    return float(stats.chisquare(counts[keep], expected).pvalue)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("drafter", [None, "model", "ngram"])
def test_penalized_sampling_follows_the_penalized_target_exactly(drafter, variant):
    """Sequences sampled with penalties (plain or speculative) follow the exact law of
    the penalized target, computed by enumeration: each verified row is penalized by its
    own history, drafts included (``min_tokens``: a row's output position counts the
    drafts before it)."""
    n, length, penalties = 3000, 3, VARIANTS[variant]
    law = penalized_law([0, 3, 0], length, penalties)
    assert np.abs(law - penalized_law([0, 3, 0], length, Penalties())).max() > 0.02
    counts = penalized_counts(make_engine(drafter, 4), n, length, 3, penalties)
    assert goodness_of_fit(counts, law) > 1e-3


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_penalized_sampling_negative_control(monkeypatch, variant):
    """Verification that penalizes every row by the committed sequence alone (forgetting
    the drafts before it) samples another law, and the test above sees it."""
    import speculative.engine.batch as batch

    def forgets_drafts(logits, history, constraint, proposal):
        return history.apply(logits[0], [[]] * logits.shape[1]).unsqueeze(0)

    monkeypatch.setattr(batch, "_processed", forgets_drafts)
    n, length, penalties = 3000, 3, VARIANTS[variant]
    law = penalized_law([0, 3, 0], length, penalties)
    counts = penalized_counts(make_engine("model", 4), n, length, 3, penalties)
    assert goodness_of_fit(counts, law) < 1e-3


class NoRepeat:
    """A token constraint: no token may follow itself (the prompt's last token included)."""

    def __init__(self, prompt: list[int]) -> None:
        self.last = prompt[-1]

    def extend(self, tokens) -> None:
        if tokens:
            self.last = tokens[-1]

    def restrict(self, logits: torch.Tensor, extras) -> torch.Tensor:
        for i, extra in enumerate(extras):
            logits[i, extra[-1] if extra else self.last] = float("-inf")
        return logits


class ThenFour(NoRepeat):
    """:class:`NoRepeat`, and after token 2 only token 4 may follow, which the constraint
    says it forces (:class:`~speculative.sampling.constraints.ForcesTokens`): the engine
    drafts it."""

    def restrict(self, logits: torch.Tensor, extras) -> torch.Tensor:
        super().restrict(logits, extras)
        for i, extra in enumerate(extras):
            if (extra[-1] if extra else self.last) == 2:
                four = logits[i, 4].clone()
                logits[i] = float("-inf")
                logits[i, 4] = four
        return logits

    def forced(self, limit: int) -> list[int]:
        return [4][:limit] if self.last == 2 else []


class ForcesWrongly(NoRepeat):
    """:class:`NoRepeat` that claims to force tokens it refuses (the last one again):
    drafts verification must reject, never emit."""

    def forced(self, limit: int) -> list[int]:
        return [self.last, self.last][:limit]


def constrained_law(prompt: list[int], length: int, then_four: bool = False) -> np.ndarray:
    """The exact probability of every output sequence of ``length`` tokens after
    ``prompt`` from the target P restricted by :class:`NoRepeat` (or :class:`ThenFour`),
    temperature 1."""
    logp = torch.log(torch.as_tensor(P)).double()
    law = np.zeros(5**length)
    for index in range(5**length):
        tokens = [int(d) for d in np.base_repr(index, 5).zfill(length)]
        p, last = 1.0, prompt[-1]
        for token in tokens:
            row = logp[last].clone()
            row[last] = float("-inf")
            if then_four and last == 2:
                row[[0, 1, 2, 3]] = float("-inf")
            p *= torch.softmax(row, dim=0)[token].item()
            last = token
        law[index] = p
    return law


def constrained_counts(engine, n, length, seed, kind=NoRepeat) -> tuple[np.ndarray, int]:
    """Counts of each output sequence, and the drafted tokens in all."""
    g = torch.Generator().manual_seed(seed)
    counts, drafted = np.zeros(5**length), 0
    stop, prompt = StopCriteria(max_new_tokens=length), [0, 3, 0]
    for _ in range(n):
        result = engine.generate(prompt, SamplingParams(), stop, g, None, kind(prompt))
        counts[int("".join(map(str, result.token_ids)), 5)] += 1
        drafted += result.stats.drafted_tokens
    return counts, drafted


@pytest.mark.parametrize(
    ("drafter", "kind"),
    [(None, NoRepeat), ("model", NoRepeat), ("ngram", NoRepeat), (None, ThenFour),
     ("model", ThenFour), ("ngram", ThenFour), (None, ForcesWrongly)],
)  # fmt: skip
def test_constrained_sampling_follows_the_constrained_target_exactly(drafter, kind):
    """Sequences sampled under a token constraint (plain or speculative) follow the exact
    law of the target restricted to the allowed tokens and renormalized, by enumeration:
    no sample leaves the constraint, and each verified row is restricted by its own
    history, drafts included (the drafters propose refused tokens too). The tokens a
    constraint forces are drafted in rounds of their own (ThenFour; an n-gram lookup
    continues them), and forced drafts that are wrong (ForcesWrongly) are rejected, never
    emitted."""
    n, length = 3000, 3
    law = constrained_law([0, 3, 0], length, then_four=kind is ThenFour)
    engine = make_engine(drafter, 4)
    counts, drafted = constrained_counts(engine, n, length, seed=5, kind=kind)
    assert (drafted > 0) == (drafter is not None or kind is not NoRepeat)
    assert counts[law == 0].sum() == 0
    assert goodness_of_fit(counts, law) > 1e-3


def test_constrained_sampling_negative_control(monkeypatch):
    """Verification that restricts every row by the committed sequence alone (forgetting
    the drafts before it) emits refused tokens, and the test above sees it."""
    import speculative.engine.batch as batch

    def forgets_drafts(logits, history, constraint, proposal):
        rows = logits[0].float().clone()
        return constraint.restrict(rows, [[]] * rows.shape[0]).unsqueeze(0)

    monkeypatch.setattr(batch, "_processed", forgets_drafts)
    law = constrained_law([0, 3, 0], 3)
    counts, _ = constrained_counts(make_engine("model", 4), 3000, 3, seed=5)
    assert counts[law == 0].sum() > 0
