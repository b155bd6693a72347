"""Unit tests of the small decision functions: γ policies, n-gram lookup, common prefixes."""

from __future__ import annotations

import random

import pytest
import torch

from speculative.drafters.auto import longest_match
from speculative.drafters.ngram import (
    ContextIndex,
    Match,
    PromptLookupDrafter,
    best_match,
    continuation,
    find_continuation,
    match_situation,
)
from speculative.engine.gamma import (
    AdaptiveGamma,
    FixedGamma,
    HeuristicGamma,
    make_gamma_policy,
)
from speculative.engine.stats import PositionAcceptance
from speculative.models.session import common_prefix_length
from speculative.sampling import SamplingParams
from speculative.theory import expected_tokens_positional


def test_heuristic_gamma_follows_transformers_schedule():
    policy = HeuristicGamma(gamma=5, max_gamma=8)
    seen = []
    for drafted_all in (True, True, False, False, True):
        gamma = policy.next_gamma()
        seen.append(gamma)
        policy.update(gamma, gamma if drafted_all else gamma - 2)
    # +2 after a fully accepted round (capped at 8), -1 otherwise
    assert seen == [5, 7, 8, 7, 6]
    assert policy.next_gamma() == 8
    for _ in range(20):
        policy.update(policy.next_gamma(), 0)
    assert policy.next_gamma() == 1  # never below one


def test_fixed_gamma_rejects_negative_and_ignores_feedback():
    with pytest.raises(ValueError, match="gamma"):
        FixedGamma(-1)
    policy = FixedGamma(3)
    policy.update(3, 0)
    assert policy.next_gamma() == 3


def test_adaptive_gamma_grows_with_acceptance_and_stops_when_drafting_cannot_pay():
    """High acceptance and a cheap drafter ask for long drafts; low acceptance short ones;
    a drafter as costly as the target is switched off (γ = 0), probing now and then."""
    flat = {k: 1.0 for k in range(1, 20)}
    eager = AdaptiveGamma(c=0.05, verify_cost=flat)
    for _ in range(40):
        gamma = eager.next_gamma()
        eager.update(gamma, gamma)  # every drafted token accepted
    assert eager.next_gamma() >= 8
    assert min(eager.position_acceptance()[:8]) > 0.9

    weak = AdaptiveGamma(c=0.05, verify_cost=flat)
    for _ in range(40):
        gamma = weak.next_gamma()
        weak.update(gamma, 0)  # nothing accepted
    # later positions inherit the first one's low estimate: going on cannot pay
    assert weak.position_acceptance()[0] < 0.15 and weak.next_gamma() <= 2

    costly = AdaptiveGamma(c=1.0, verify_cost={1: 1.0, 2: 2.0, 3: 3.0}, max_gamma=2)
    for _ in range(30):
        gamma = costly.next_gamma()
        costly.update(gamma, 0)
    choices = [costly.next_gamma() for _ in range(16)]
    assert choices.count(0) == 14 and choices.count(1) == 2  # a probe every 8 idle rounds


def test_adaptive_gamma_maximizes_the_generalized_speedup():
    """With measured per-position acceptance the chosen γ is the argmax of
    E[tokens](γ) / (γ c + T(γ + 1)) — checked against a brute-force search."""
    curve = {1: 1.0, 2: 1.02, 3: 1.05, 4: 1.1, 5: 1.2, 6: 1.5, 7: 1.8, 8: 2.2}
    policy = AdaptiveGamma(c=0.1, verify_cost=curve, max_gamma=7, decay=1.0)
    rng = random.Random(0)
    for _ in range(300):
        gamma = 7
        accepted = 0
        while accepted < gamma and rng.random() < 0.8:
            accepted += 1
        policy.update(gamma, accepted)
    rates = policy.position_acceptance()
    assert rates[0] == pytest.approx(0.8, abs=0.06)
    values = {
        g: expected_tokens_positional(rates, g) / (g * 0.1 + curve[g + 1]) for g in range(1, 8)
    }
    assert policy.next_gamma() == max(values, key=values.get)


def test_find_continuation_prefers_the_longest_most_recent_match():
    context = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix [2, 3] occurs at 1 and 5; the most recent earlier match is at 5 -> "7 8 5"
    assert find_continuation(context, 3, max_ngram=2, min_ngram=1) == [7, 8, 5]
    # a longer suffix wins over a more recent shorter one
    context = [4, 5, 6, 1, 0, 6, 2, 4, 5, 6]
    assert find_continuation(context, 2, max_ngram=3, min_ngram=1) == [1, 0]
    assert find_continuation([1, 2, 3], 4, max_ngram=3, min_ngram=1) == []  # no match
    # the copy overlaps what it drafts: a run goes on past the context's end
    assert find_continuation([5, 5, 5], 4, max_ngram=1, min_ngram=1) == [5, 5, 5, 5]
    assert find_continuation([1, 2, 9, 1, 2], 2, max_ngram=2, min_ngram=2) == [9, 1]


def test_continuation_overlaps_the_copy_it_writes():
    assert continuation([1, 2, 3, 4], 1, 3) == [2, 3, 4]  # inside the context
    assert continuation([1, 2, 3, 4], 2, 5) == [3, 4, 3, 4, 3]  # past it: repeats [3, 4]
    assert continuation([1, 2], 2, 3) == [] and continuation([1, 2], 0, 0) == []


@pytest.mark.parametrize("drafter_kind", ["ngram", "auto"])
def test_lookup_drafts_a_whole_loop_whatever_its_period(drafter_kind: str):
    # a context that repeats a loop of `period` tokens: the longest match ends `period`
    # tokens back, and the draft must be the loop's next `gamma` tokens, not `period`
    rng = random.Random(0)
    for period in (1, 2, 3, 5):
        loop = [rng.randrange(100, 200) for _ in range(period)]
        prefix = [rng.randrange(0, 100) for _ in range(7)]
        context = prefix + loop * (12 // period + 2) + loop[:1]
        truth = [loop[(len(context) - len(prefix) + i) % period] for i in range(8)]
        if drafter_kind == "ngram":
            drafter = PromptLookupDrafter()
            draft = drafter.propose(context, 8, SamplingParams(0.0), torch.Generator())
            assert draft.tokens == truth
        else:
            situation, follow = longest_match(ContextIndex(), context, 8)
            assert follow == truth and situation == 8  # the whole earlier loop matched


@pytest.mark.parametrize("seed", range(5))
def test_common_prefix_length_matches_a_linear_scan(seed: int):
    rng = random.Random(seed)
    for _ in range(200):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(5))]
        expected = 0
        while expected < min(len(a), len(b)) and a[expected] == b[expected]:
            expected += 1
        assert common_prefix_length(a, b) == expected
        assert common_prefix_length(b, a) == expected


def test_one_gamma_parser_for_generate_speculator_and_bench():
    """ "heuristic" is accepted (or anything else refused) alike everywhere."""
    from speculative.bench import parse_gamma_choices
    from speculative.cli.main import build_parser
    from speculative.engine.gamma import make_gamma_policy, parse_gamma
    from speculative.pipeline import Speculator

    assert [parse_gamma(v) for v in ("3", 3, "auto", "heuristic")] == [3, 3, "auto", "heuristic"]
    assert isinstance(make_gamma_policy("heuristic"), HeuristicGamma)
    assert isinstance(make_gamma_policy("auto"), AdaptiveGamma)
    assert [c.fixed for c in parse_gamma_choices(["2", "heuristic"])] == [2, None]
    assert Speculator(None, None, "heuristic").gamma == "heuristic"  # type: ignore[arg-type]
    for bad in ("fast", "0", 0, "-2", True):
        with pytest.raises(ValueError, match="integer >= 1, 'auto' or 'heuristic'"):
            parse_gamma(bad)
        with pytest.raises(ValueError, match="integer >= 1, 'auto' or 'heuristic'"):
            parse_gamma_choices([str(bad)])
        with pytest.raises(ValueError, match="integer >= 1, 'auto' or 'heuristic'"):
            Speculator(None, None, bad)  # type: ignore[arg-type]
    args = build_parser().parse_args(["generate", "--prompt", "x", "--gamma", "heuristic"])
    assert parse_gamma(args.gamma) == "heuristic"


def test_unreached_positions_inherit_what_was_learnt():
    """Drafting 2 tokens that are always accepted: positions 3+ were never examined, yet
    their estimate follows position 2 (not the 0.6 prior that kept γ small)."""
    policy = AdaptiveGamma(c=0.05, verify_cost={k: 1.0 for k in range(1, 20)}, decay=1.0)
    for _ in range(50):
        policy.update(2, 2)
    rates = policy.position_acceptance()
    assert rates[1] > 0.95 and rates[5] == pytest.approx(rates[1])
    assert policy.next_gamma() >= 8


def _trained(feedback: bool) -> AdaptiveGamma:
    curve = {k: 1.0 + 0.05 * (k - 1) for k in range(1, 20)}
    policy = AdaptiveGamma(c=0.1, verify_cost=curve, decay=1.0)
    rng = random.Random(1)
    for _ in range(300):
        gamma = rng.randint(1, 6)
        accepted = 0
        while accepted < gamma and rng.random() < 0.75:
            accepted += 1
        policy.update(gamma, accepted)
        if feedback:  # each round pays one extra draft-model forward of 1.0 step: catch-up
            step = 0.01
            policy.observe_costs(gamma, (0.1 * gamma + 1.0) * step, curve[gamma + 1] * step)
    return policy


def test_adaptive_gamma_charges_the_measured_catch_up_of_each_round():
    seen, blind = _trained(True), _trained(False)
    assert seen.overhead == pytest.approx(1.0, rel=1e-6)
    assert seen.step_seconds == pytest.approx(0.01)
    rates = seen.position_acceptance()
    values = {
        g: expected_tokens_positional(rates, g) / (0.1 * g + 1.0 + seen.verify_cost[g + 1])
        for g in range(1, 13)
    }
    assert seen.next_gamma() == max(values, key=values.get)
    # negative control: blind to the per-round cost, the policy drafts shorter chains
    assert blind.overhead == 0.0 and blind.next_gamma() < seen.next_gamma()


def _best_match_reference(
    context: list[int], max_length: int, min_length: int = 1
) -> tuple[int, int] | None:
    """Slow twin of best_match: every earlier end, its common suffix with the context."""
    best = None
    for end in range(1, len(context)):
        length = 0
        while (
            length < min(max_length, len(context) - 1)
            and end - 1 - length >= 0
            and context[end - 1 - length] == context[len(context) - 1 - length]
        ):
            length += 1
        if length and (best is None or length >= best[0]):
            best = (length, end)
    return best if best is not None and best[0] >= min_length else None


@pytest.mark.parametrize("seed", range(4))
def test_best_match_is_the_longest_then_most_recent_earlier_occurrence(seed: int):
    rng = random.Random(seed)
    for _ in range(300):
        context = [rng.randrange(3) for _ in range(rng.randrange(0, 30))]
        cap = rng.choice([1, 2, 5, 16])
        found = best_match(context, cap)
        expected = _best_match_reference(context, cap)
        assert (None if found is None else (found.length, found.end)) == expected, context


def test_context_index_answers_as_the_slow_twin_over_the_window_as_the_context_grows():
    """The n-gram drafters' index over a growing context gives the slow twin's answer on
    the last ``window`` tokens (its end an index of the whole context), as tokens are
    appended across calls and when another context replaces the indexed one."""
    rng = random.Random(3)
    for _ in range(2000):
        index, context = ContextIndex(), []
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.2:  # another sequence
                context = [rng.randrange(4) for _ in range(rng.randrange(0, 8))]
            context = context + [rng.randrange(rng.choice([2, 3, 5])) for _ in range(9)]
            cap, least, window = (
                rng.choice([1, 2, 5, 16]),
                rng.choice([1, 2]),
                rng.choice([0, 3, 7, 20]),
            )
            found = index.best_match(context, cap, least, window)
            recent = context[-window:] if window else context
            expected = _best_match_reference(recent, cap, least)
            shift = len(context) - len(recent)
            assert (None if found is None else (found.length, found.end)) == (
                None if expected is None else (expected[0], expected[1] + shift)
            )
            assert index.tokens == context


def test_best_match_prefers_a_longer_older_copy_and_drafts_what_followed_it():
    # the suffix 1 2 3 4 5 matches 5 tokens at the start (then 9); its last 3 tokens
    # also match more recently (then 8), which the 3-gram lookup picks
    context = [1, 2, 3, 4, 5, 9, 7, 3, 4, 5, 8, 1, 2, 3, 4, 5]
    assert best_match(context, 16) == Match(length=5, end=5)
    assert find_continuation(context, 2, max_ngram=3, min_ngram=1) == [8, 1]
    drafter = PromptLookupDrafter()
    draft = drafter.propose(context, 2, SamplingParams(0.0), torch.Generator())
    assert draft.tokens == [9, 7] and draft.probs is None
    assert drafter.draft_situation(context) == 4  # a 5-token match: the 4–7 class
    assert best_match(context, 3) == Match(length=3, end=10)  # capped: the recent one
    assert best_match([1, 2, 9, 1, 2], 16, min_length=3) is None
    assert best_match([5, 5, 5], 16) == Match(length=2, end=2)  # overlapping its suffix
    assert best_match([7], 16) is None and best_match([], 16) is None


def test_match_situation_classes():
    lengths = {None: 0, 1: 1, 2: 2, 3: 3, 4: 4, 7: 4, 8: 8, 15: 8}
    for length, situation in lengths.items():
        match = None if length is None else Match(length, 1)
        assert match_situation(match) == situation
    assert PromptLookupDrafter().draft_situation([1, 2, 3]) == 0


def test_adaptive_gamma_learns_per_situation():
    """Rounds after long matches are kept whole, rounds after short ones rejected at once:
    told the situation, the policy drafts long after long matches and nothing after short
    ones; the pooled estimate (no situation) cannot tell them apart and picks one γ."""
    curve = {k: 1.0 + 0.12 * (k - 1) for k in range(1, 14)}  # T(5) ≈ 1.5, like int4 AVX2
    policy = AdaptiveGamma(c=0.01, verify_cost=curve, max_gamma=8)
    rng = random.Random(1)
    for _ in range(200):
        situation = rng.choice([1, 8])
        policy.situate(situation)
        gamma = policy.next_gamma()
        policy.update(gamma, gamma if situation == 8 else 0)
    policy.situate(8)
    long_gamma = policy.next_gamma()
    policy.situate(1)
    short = [policy.next_gamma() for _ in range(8)]  # idle rounds (a probe every 8th)
    assert long_gamma >= 6 and short.count(0) == 7 and max(short) == 1
    assert policy.position_acceptance()[0] < 0.2
    policy.situate(8)
    assert min(policy.position_acceptance()) > 0.9
    # an unseen situation starts from the pooled estimate of every round
    policy.situate(3)
    pooled = policy.pooled.rates([policy.prior_alpha] + [-1.0] * 7, policy.prior_weight)
    assert policy.position_acceptance() == pytest.approx(pooled)
    # negative control: with no situation the pooled rates decide alone, one γ for both
    assert 0 < pooled[0] < 1 and policy.situation == 3
    policy.situation = None
    assert policy.position_acceptance() == pytest.approx(pooled)


def test_the_engine_tells_the_policy_each_rounds_situation():
    """n-gram rounds under γ = auto: before each round the policy hears the class of the
    match the drafter will copy from; greedy output stays plain decoding's."""
    from speculative.engine import SpeculativeEngine, StopCriteria
    from speculative.models import MarkovLM, seed_matrices

    class Recording(AdaptiveGamma):
        def situate(self, situation):
            heard.append(situation)
            super().situate(situation)

    heard: list = []
    target = MarkovLM(seed_matrices()[0])
    drafter = PromptLookupDrafter()
    policy = Recording(c=0.01, verify_cost={k: 1.0 for k in range(1, 14)})
    prompt, stop = [0, 3, 0, 3, 0, 3, 1, 2, 0, 3, 0], StopCriteria(max_new_tokens=40)
    params = SamplingParams(0.0)
    spec = SpeculativeEngine(target, drafter, policy).generate(
        prompt, params, stop, torch.Generator()
    )
    plain = SpeculativeEngine(target, None).generate(prompt, params, stop, torch.Generator())
    assert spec.token_ids == plain.token_ids
    assert len(heard) == len(spec.stats.gammas) and set(heard) <= {0, 1, 2, 3, 4, 8}
    assert len(set(heard)) > 1 and policy.by_situation.keys() == set(heard)


def test_position_counts_merge_as_if_recorded_together() -> None:
    """The bench sums generations' per-position counts (merge); the sum must be what one
    counter recording every round would hold, and position i + 1 is reached only when the
    i drafts before it were accepted."""
    rng = random.Random(3)
    rounds = [(g, rng.randint(0, g)) for g in (rng.randint(0, 6) for _ in range(200))]
    together, first, second = PositionAcceptance(), PositionAcceptance(), PositionAcceptance()
    for n, (drafted, kept) in enumerate(rounds):
        together.record(drafted, kept)
        (first if n % 3 else second).record(drafted, kept)
    first.merge(second)
    assert first == together
    expected_reached = [sum(1 for d, k in rounds if d > i and k >= i) for i in range(6)]
    expected_accepted = [sum(1 for d, k in rounds if k > i) for i in range(6)]
    assert together.reached == expected_reached
    assert together.accepted == expected_accepted
    pairs = zip(expected_accepted, expected_reached, strict=True)
    assert together.rates() == [a / r if r else 0.0 for a, r in pairs]


# the curve one calibration measured on Zen 4 (not monotone), and the rounds then timed:
# plain rounds 3.95 ms, rounds of 3 tokens (γ = 2) 4.84 ms, sampling and commit included
NOISY_CURVE = {1: 1.0, 2: 1.024, 3: 1.002, 4: 1.103, 5: 1.089, 6: 1.311, 7: 1.393}


def test_adaptive_gamma_prices_a_noisy_curve_non_decreasing():
    policy = AdaptiveGamma(c=0.001, verify_cost=NOISY_CURVE, max_gamma=6)
    shapes = policy.verify_shapes(7)
    assert shapes == pytest.approx([1.0, 1.024, 1.024, 1.103, 1.103, 1.311, 1.393])
    assert policy.round_cost(2) == pytest.approx(0.002 + 1.024)


def _weak_policy() -> AdaptiveGamma:
    """A policy that has seen γ = 2 rounds keep one draft in twenty (α estimated 0.15)."""
    policy = AdaptiveGamma(c=0.001, verify_cost=NOISY_CURVE, max_gamma=6)
    for i in range(60):
        policy.update(2, 1 if i % 10 == 0 else 0)
    return policy


def test_adaptive_gamma_prices_rounds_from_their_timings():
    """Priced from the curve alone, a weak draft looks nearly free and the policy drafts;
    once rounds of 2 and 3 tokens have been timed next to plain ones (1.16x and 1.23x),
    it drafts nothing but its probes, and a length it has not timed is priced from the
    nearest timed one by the curve."""
    blind, timed = _weak_policy(), _weak_policy()
    for _ in range(20):
        for k, seconds in ((1, 3.95e-3), (2, 4.60e-3), (1, 3.95e-3), (3, 4.84e-3)):
            timed.observe_round(k, seconds)
    shapes = timed.verify_shapes(5)
    assert shapes[1] == pytest.approx(4.60 / 3.95, rel=0.01)
    assert shapes[2] == pytest.approx(4.84 / 3.95, rel=0.01)
    assert shapes[3] == pytest.approx(shapes[2] * 1.103 / 1.024)  # T(4) from T(3), the curve
    assert timed.verify.at(1) == pytest.approx(3.95e-3, rel=0.01)
    assert [timed.next_gamma() for _ in range(7)] == [0] * 7  # the 8th would probe
    # negative control: the same acceptance priced from the curve alone drafts every round
    assert all(blind.next_gamma() > 0 for _ in range(7))


def test_adaptive_gamma_learns_a_shape_from_adjacent_rounds_only():
    """Rounds of 3 tokens with no plain one beside them move the scale (V(1)) but not the
    shape: a slower machine is not taken for a steeper curve."""
    apart, control = _weak_policy(), _weak_policy()
    for _ in range(60):
        apart.observe_round(3, 4.84e-3)
    assert apart.verify_shapes(4) == _weak_policy().verify_shapes(4)
    assert apart.verify.at(1) == pytest.approx(4.84e-3 / 1.024, rel=0.02)  # T(3) as the curve
    # the control: the same rounds interleaved do move the shape of 3 tokens
    for _ in range(10):
        control.observe_round(1, 3.95e-3)
        control.observe_round(3, 4.84e-3)
    assert control.verify_shapes(4)[2] > 1.15


def test_adaptive_gamma_prices_drafting_in_timed_plain_rounds():
    """Drafting time beyond γ·c is priced in the unit its verification is priced in: timed
    plain rounds once there are some (3.95 ms), else T(1) as the pass and the curve imply
    (4.84 ms ÷ T(3) 1.002): the control, a policy that timed no plain round."""
    timed = make_gamma_policy("auto", 0.001, NOISY_CURVE)
    untimed = make_gamma_policy("auto", 0.001, NOISY_CURVE)
    assert isinstance(timed, AdaptiveGamma) and isinstance(untimed, AdaptiveGamma)
    for _ in range(3):
        timed.observe_round(1, 3.95e-3)
    timed.observe_costs(2, 2e-3, 4.84e-3)  # 2 ms of drafting at γ = 2
    untimed.observe_costs(2, 2e-3, 4.84e-3)
    share = 1 - timed.cost_decay  # of the first measurement in the running mean
    assert timed.overhead == pytest.approx(share * (2 / 3.95 - 2 * 0.001))
    assert untimed.overhead == pytest.approx(share * (2 / (4.84 / 1.002) - 2 * 0.001))


def test_a_speculator_keeps_its_gamma_policy_across_generations():
    """γ = auto goes on from what earlier generations taught it: every round of every
    generation reaches the next one's policy; a new curve starts a new policy."""
    from speculative.pipeline import Speculator
    from tiny import tiny_loaded

    target = tiny_loaded(layers=2)
    flat = {k: 1.0 for k in range(1, 14)}
    auto = Speculator(target, PromptLookupDrafter(), "auto", draft_cost=0.01, verify_cost=flat)
    rounds = []
    for prompt in ("the cat sat on the mat and the cat", "a b a b a b a"):
        out = auto.generate(prompt, max_new_tokens=16, chat=False)
        rounds += [g + 1 for g in out.stats.gammas]
    policy = auto.engine().gamma_policy
    assert isinstance(policy, AdaptiveGamma)
    assert policy.verify.counts == {k: rounds.count(k) for k in set(rounds)}
    auto.verify_cost = {k: 1.0 + 0.1 * (k - 1) for k in range(1, 14)}  # a new calibration
    fresh = auto.engine().gamma_policy
    assert isinstance(fresh, AdaptiveGamma) and fresh.verify_cost == auto.verify_cost
    assert fresh.verify.counts == {}


def test_the_engine_times_every_round_for_the_policy():
    """Each round, plain ones included, reaches observe_round with its γ + 1 tokens and a
    positive time; greedy output stays plain decoding's."""
    from speculative.engine import SpeculativeEngine, StopCriteria
    from speculative.models import MarkovLM, seed_matrices

    class Recording(AdaptiveGamma):
        def observe_round(self, tokens, seconds):
            timed.append((tokens, seconds))
            super().observe_round(tokens, seconds)

    timed: list = []
    target = MarkovLM(seed_matrices()[0])
    policy = Recording(c=0.01, verify_cost={k: 1.0 for k in range(1, 14)})
    prompt, stop = [0, 3, 0, 3, 0, 3, 1, 2, 0, 3, 0], StopCriteria(max_new_tokens=40)
    params = SamplingParams(0.0)
    spec = SpeculativeEngine(target, PromptLookupDrafter(), policy).generate(
        prompt, params, stop, torch.Generator()
    )
    plain = SpeculativeEngine(target, None).generate(prompt, params, stop, torch.Generator())
    assert spec.token_ids == plain.token_ids
    assert [t for t, _ in timed] == [g + 1 for g in spec.stats.gammas]
    assert all(s > 0 for _, s in timed) and 0 in spec.stats.gammas
