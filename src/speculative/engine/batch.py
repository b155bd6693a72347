"""Batched speculative decoding: many rows share each target pass.

This is the engine's one loop. Each round every decoding row proposes its own draft (its
own drafter, γ or token tree, sampling parameters and generator); ONE target pass
(:meth:`RowPool.forward_rows`) scores every row's last token and drafts, each row in its
own cache; each row is then verified and committed alone (:mod:`speculative.engine.round`).
A row's logits in the batch equal its logits alone (bitwise on the native runtime), and
its randomness comes only from its own generator, so each row's output is exactly what it
would be alone. The single-sequence :class:`~speculative.engine.loop.SpeculativeEngine`
is this engine with one row on the model's own cache (:class:`SinglePool`).

Continuous batching: :meth:`BatchEngine.add` joins a row between rounds; its prompt is
prefilled inside the next shared passes, at most ``prefill_chunk`` tokens per pass
(chunked prefill: a long prompt does not stall the other rows' decoding for long). A
finished or cancelled row frees its slot at once. A drafter is per row: one instance per
request (a model drafter with its own model and session, or a cache slot of a shared
one). A model drafter that follows the target (``follow_target``) copies its row's
committed positions from the row's session, on slots as alone. Drafting heads read each
row's features from its slot session when the model gives per-row features
(:class:`~speculative.models.base.SupportsBatchRowFeatures`).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

import torch

from speculative.capabilities import provides
from speculative.drafters.base import (
    ChoosesDraftLength,
    Draft,
    Drafter,
    DraftsRowsTogether,
    LooksUpContext,
    ReadsTargetFeatures,
    ReportsDraftCost,
    RowAsk,
    ShedsTargetFeatures,
    SupportsDraftSituation,
    SupportsPriming,
)
from speculative.drafters.tree import DraftsTreesTogether, DraftTree
from speculative.engine.gamma import (
    AUTO_LENGTH_CAP,
    LOAD_AWARE_MAX_GAMMA,
    FixedGamma,
    GammaPolicy,
    LearnsRoundCosts,
    LoadAwareGamma,
    PositionCounts,
    RowLoad,
    SupportsCostFeedback,
    SupportsSituations,
    smoothed_rates,
)
from speculative.engine.round import (
    DecodeState,
    GenerationResult,
    Proposal,
    Round,
    TokenLogprobs,
    Verifier,
    accepted,
    commit_tokens,
    draft_length,
    emitted_logprobs,
    propose_draft,
    propose_drafts_together,
    verify_draft,
)
from speculative.engine.stats import GenerationStats
from speculative.engine.stopping import StopCriteria
from speculative.engine.tree import TreeRound, propose_trees_together
from speculative.models.base import (
    CausalLM,
    PadsBatchRows,
    ReservesSlots,
    RowInput,
    SupportsBatchRows,
    SupportsFusedArgmax,
    SupportsNucleusSearch,
    SupportsWeightBytes,
)
from speculative.models.session import (
    ModelSession,
    RowPool,
    RowSession,
    SinglePool,
    SlotPool,
    common_prefix_length,
)
from speculative.sampling import SamplingParams, VerifyResult, VerifyUniforms
from speculative.sampling.constraints import (
    ChecksTokens,
    ConstraintError,
    ForcesTokens,
    TokenConstraint,
)
from speculative.sampling.penalties import Penalties, PenaltyHistory
from speculative.sampling.tree import TreeVerifyResult
from speculative.theory import decayed_average

ALPHA_PRIOR = 0.6  # running acceptance estimate: Beta prior mean ...
ALPHA_PRIOR_WEIGHT = 2.0  # ... and weight in pseudo-drafts
COST_DECAY = 0.8  # running means of measured seconds: weight of the previous value
# rounds a drafter's catch-up is spread over when priced: a row that catches up drafts on
# after it (charged to one round, a row lagging a few rounds at B = 1 would never draft
# again: each round it skips lengthens the catch-up)
CATCH_UP_ROUNDS = 4
# consecutive rounds a row beside others was given γ 0 by the load policy after which its
# drafter, where it can draft without the target's features (ShedsTargetFeatures), sheds
# them: every pass that copies them out costs 2-3 % more (Zen 4, SmolLM2-135M at B = 4-8),
# paid for drafts the load no longer lets the row make
SHED_AFTER = 16
# most tokens a round drafts from what a row's constraint forces (ForcesTokens)
FORCED_DRAFT_MAX = 16
# most prompt tokens a row that asked for the prompt's log-probabilities feeds per pass:
# its logits are kept for every token (256 × the default model's 49,152: 50 MB)
PROMPT_LOGPROBS_CHUNK = 256


POSITIONS = LOAD_AWARE_MAX_GAMMA  # draft positions whose acceptance the load policy learns
CHAINED_PRIOR = (ALPHA_PRIOR, *[-1.0] * (POSITIONS - 1))  # later positions: the one before


@dataclass
class SituationAcceptance:
    """Acceptance per draft position per (drafter, round situation), shared by every row
    of one engine: the load-aware policy's acceptance for a row whose drafter says what
    situation its round is in (:class:`~speculative.drafters.base.SupportsDraftSituation`,
    n-gram lookup: the match's length class). A row's first rounds then start from what
    earlier rows measured in the same situation instead of a fixed prior, and a row after
    a 1-token match is not drafted for as if it were after a 10-token one. Per position
    (P(draft g kept | drafts 1..g−1 kept)), because a copying drafter's first token is
    its risk: after it, the copy usually holds. Counts of examined and accepted positions,
    exponentially decayed per recorded round; rates are cached until the next record."""

    decay: float = 0.95
    counts: dict[Hashable, PositionCounts] = field(default_factory=dict)
    _rates: dict[Hashable, tuple[float, ...]] = field(default_factory=dict, repr=False)
    _best: dict[Hashable, tuple[float, ...]] = field(default_factory=dict, repr=False)

    def alphas(self, key: Hashable, own: tuple[float, ...]) -> tuple[float, ...]:
        """The situation's acceptance per position (Beta prior: ALPHA_PRIOR at the first
        position, each later one starting from the one before); ``own`` (the row's) where
        the situation was never recorded."""
        if key not in self.counts:
            return own
        if key not in self._rates:
            self._rates[key] = tuple(self.counts[key].rates(CHAINED_PRIOR, ALPHA_PRIOR_WEIGHT))
        return self._rates[key]

    def best_alphas(self, drafter: str, own: tuple[float, ...]) -> tuple[float, ...]:
        """Position by position, the largest acceptance of ``own`` and of every recorded
        situation of ``drafter``: its gains bound every situation's from above."""
        if drafter not in self._best:
            best = [0.0] * POSITIONS
            for key in self.counts:
                if _drafter_of(key) == drafter:
                    best = list(map(max, best, self.alphas(key, own)))
            self._best[drafter] = tuple(best)
        return tuple(map(max, self._best[drafter], own))

    def record(self, key: Hashable, drafted: int, num_accepted: int, asked: int = 0) -> None:
        """A round in situation ``key``: ``asked`` drafts wanted, ``drafted`` proposed,
        ``num_accepted`` kept. A round that asked and got no draft (an n-gram lookup
        without a match) counts as the first position examined and not accepted:
        drafting in that situation emits nothing more than plain decoding."""
        if drafted == 0 and asked == 0:
            return
        counts = self.counts.setdefault(key, PositionCounts.empty(POSITIONS))
        counts.record(max(drafted, 1), num_accepted if drafted else 0, self.decay)
        self._rates.pop(key, None)
        self._best.pop(_drafter_of(key), None)


def _drafter_of(key: Hashable) -> Hashable:
    """The drafter of a (drafter, situation) key."""
    return key[0] if isinstance(key, tuple) and key else key


@dataclass
class HopelessRounds:
    """Rounds decoded plain without asking the load policy: after even every row's most
    optimistic acceptance drafted nothing (the batch fills the kernels' flat region), or
    the choice was nothing for rows whose α cannot move before they draft (no
    situation), the next ``rounds`` rounds with as many rows skip the policy's work (row
    rates, a choice) and the rows' own γ policies' (neither asked for a γ nor told the
    round: the load, not their acceptance, kept them from drafting), which costs a few
    per cent of a pass there. Each verdict of nothing that follows such a skip doubles
    the next skip, up to ``most`` rounds (a batch too full to draft stays so while its
    rows decode); a row joining or leaving, or a choice that drafts, starts over, and
    the policy is asked at once."""

    rounds: int = 3
    most: int = 24
    left: int = 0
    rows: int = 0  # the batch's rows when the policy last found nothing to draft
    streak: int = 0  # the length of the last skip (0: none since the batch changed)

    def start(self, rows: int) -> None:
        again = rows == self.rows and self.streak > 0
        self.streak = min(self.most, 2 * self.streak) if again else self.rounds
        self.left, self.rows = self.streak, rows

    def drafted(self) -> None:
        """The policy's last choice drafted: the next verdict of nothing skips ``rounds``."""
        self.streak = 0

    def skip(self, rows: int) -> bool:
        """Whether this round (of ``rows`` rows) decodes plain without asking."""
        if rows != self.rows:
            self.left = self.streak = 0
            return False
        if self.left == 0:
            return False
        self.left -= 1
        return True


@dataclass
class BatchRequest:
    """One sequence to decode in a batch, with everything that is its own."""

    prompt_ids: Sequence[int]
    params: SamplingParams
    stop: StopCriteria
    generator: torch.Generator
    drafter: Drafter | None = None  # one instance per row (drafters keep per-row state)
    gamma: GammaPolicy | int = 4  # the row's own γ (the load-aware policy may lower it)
    # c of the drafter (draft step ÷ target step), for the load policy until it is measured;
    # None: estimated (:func:`streamed_draft_cost`)
    draft_cost: float | None = None
    tree: TreeRound | None = None  # draft token trees with this strategy instead of chains
    # each emitted token's log-probability (Round.logprobs) and this many alternatives';
    # None: none
    logprobs: int | None = None
    # each prompt token's after the first, and this many alternatives' (the row's first
    # Round.prompt_logprobs); None: none. Such a row prefills its whole prompt itself (no
    # prefix shared with another row), PROMPT_LOGPROBS_CHUNK tokens at most per pass
    prompt_logprobs: int | None = None
    # repetition / frequency / presence penalties of the target's logits (None: none)
    penalties: Penalties | None = None
    # the tokens allowed after the output (a grammar; one instance per row: it keeps the
    # row's state); the target's distribution is restricted to them (None: none)
    constraint: TokenConstraint | None = None


@dataclass
class BatchRow:
    """An active row: its request, cache session, committed sequence and rounds."""

    row_id: int
    request: BatchRequest
    session: RowSession
    state: DecodeState
    gamma_policy: GammaPolicy
    started: float
    rounds: list[Round] = field(default_factory=list)
    decoding: bool = False  # the prompt is prefilled (and the drafter primed)
    propose_seconds: float | None = None  # running mean of a propose call that drafted
    step_draft_seconds: float | None = None  # model drafters: running mean per draft step
    situation: Hashable | None = None  # (drafter, situation) of this round, load-aware only
    # the row's drafter where it says its round's situation (chains only), and whether its
    # γ policy takes it: asked once (a runtime protocol check costs ~10 µs per round)
    situated: SupportsDraftSituation | None = None
    situates_policy: bool = False
    learns_costs: SupportsCostFeedback | None = None  # the γ policy, where it learns timings
    learns_rounds: LearnsRoundCosts | None = None  # ... and what a round of k tokens costs
    chooses_length: bool = False  # the drafter picks its own length (ChoosesDraftLength)
    reads_features: bool = False  # the drafter reads the target's features (still)
    load_plain_rounds: int = 0  # consecutive rounds beside others the load gave it γ 0
    draft_cost: float = 0.0  # c until measured: the request's, else streamed_draft_cost
    # what the row's penalties read (its prompt, its output's counts), where it has them
    penalty_history: PenaltyHistory | None = None
    # the prompt's log-probabilities so far, where the request asked for them
    prompt_entries: list[TokenLogprobs] | None = None
    error: str | None = None  # why the row failed (its constraint: ConstraintError)

    def result(self) -> GenerationResult:
        return GenerationResult(
            token_ids=list(self.state.generated),
            stats=self.state.stats,
            finish_reason=self.state.reason,
            rounds=self.rounds,
            error=self.error,
        )

    def alphas(self) -> tuple[float, ...]:
        """Running acceptance per draft position (Beta prior: ALPHA_PRIOR at the first,
        each later position starting from the one before) from this row's rounds."""
        counts = self.state.stats.positions
        rates = smoothed_rates(counts.reached, counts.accepted, CHAINED_PRIOR, ALPHA_PRIOR_WEIGHT)
        return tuple(rates)

    def prefill_left(self) -> int:
        """Prompt tokens (all but the last) not yet in the row's cache."""
        prefix = self.state.sequence[: self.state.prompt_length - 1]
        return len(prefix) - common_prefix_length(self.session.cached, prefix)


@dataclass
class _Planned:
    row: BatchRow
    proposal: Proposal
    propose_seconds: float = 0.0  # this round's drafting time
    asked: int = 0  # the γ the row was asked to draft
    unasked: bool = False  # a round the load policy skipped (HopelessRounds): the row's
    # own γ policy was neither asked nor is told the round


def streamed_draft_cost(drafter: Drafter | None, target_bytes: int) -> float:
    """c before any draft step is timed, from the weights a step streams: the drafter's
    weight bytes ÷ the target's (``target_bytes``; 0: unknown), where both are known (a
    decode step reads its weights once; self-exit:8 of the default model: 0.49, its
    output head alone 0.30; the EAGLE head at int4: 0.06, where its steps' fixed costs
    make it 0.17 timed); 0 for the other drafters (lookups: about free). A row that
    never drafted would otherwise price its first drafts as free: at a large batch, a
    round of full-length drafts from every row, each with a catch-up over its prompt."""
    if not target_bytes or not provides(drafter, ReportsDraftCost):
        return 0.0
    return drafter.draft_weight_bytes() / target_bytes


def new_state(
    prompt_ids: Sequence[int], max_length: int | None, stats: GenerationStats | None = None
) -> DecodeState:
    """A generation's state after validating its prompt against the context window."""
    prompt = list(prompt_ids)
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    if max_length is not None and len(prompt) >= max_length:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens but the model's context window is {max_length}"
        )
    return DecodeState(prompt, len(prompt), GenerationStats() if stats is None else stats)


@dataclass(frozen=True)
class PassShape:
    """One target pass as it ran: per row, (positions its cache held, tokens it fed)."""

    rows: tuple[tuple[int, int], ...]
    seconds: float


class BatchEngine:
    """Decodes many rows together, one target pass per round."""

    def __init__(
        self,
        target: CausalLM,
        max_batch: int = 8,
        load: LoadAwareGamma | None = None,
        *,
        prefill_chunk: int | None = None,
        pool: RowPool | None = None,
        verifier: Verifier | None = None,
    ) -> None:
        """load: choose every row's γ (at most its own) for the load each round; None
        keeps each row's own γ. prefill_chunk: most prompt tokens a joining row feeds per
        pass (None: its whole prompt in one pass). pool: where rows live (default: the
        target's cache slots; a model without slots holds one row on its own cache).
        verifier: replaces the exact chain verification (negative controls only)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if pool is None:
            pool = _default_pool(target, max_batch)
            if provides(target, ReservesSlots):  # one allocation, not one per doubling
                cast(ReservesSlots, target).reserve_slots(max_batch)
        if pool.capacity is not None and max_batch > pool.capacity:
            raise ValueError(f"max_batch {max_batch} exceeds the {pool.capacity} rows this holds")
        self.target = target
        self.pool = pool
        self.max_batch = max_batch
        self.load = load
        self.prefill_chunk = prefill_chunk
        self.verifier = verifier
        self.rows: dict[int, BatchRow] = {}  # active rows by id, in joining order
        self.finished: dict[int, GenerationResult] = {}
        self.target_passes = 0
        self.forward_seconds = 0.0  # time spent inside the target passes
        self.step_seconds: float | None = None  # running estimate of T(1), in seconds
        self.situations = SituationAcceptance()  # the load policy's α by situation
        # nothing waits to join (run() sets it once its queue is empty): the batch's end is
        # its last row's, so the load policy drafts only for the rows furthest from theirs
        self.draining = False
        self._hopeless = HopelessRounds()
        self._next_id = 0
        # a list: every later pass's shape is appended to it (benchmarks; None: not kept)
        self.pass_log: list[PassShape] | None = None
        # greedy checks read the argmax the target's forward took, where it takes one
        self._fused_argmax = target if provides(target, SupportsFusedArgmax) else None
        self._nucleus = target.nucleus if provides(target, SupportsNucleusSearch) else None
        self._padded = target.padded_tokens if provides(target, PadsBatchRows) else None
        # weights a target pass streams (the prior of c: streamed_draft_cost), 0: unknown
        self._target_bytes = target.weight_bytes() if provides(target, SupportsWeightBytes) else 0

    @property
    def max_length(self) -> int | None:
        return self.target.max_length

    def add(self, request: BatchRequest, stats: GenerationStats | None = None) -> int:
        """Join a row (prefilled and decoded from the next round on); returns its id.
        ValueError when the batch is full or the prompt does not fit. ``stats`` (a fresh
        one when None) is updated in place as the row goes."""
        if len(self.rows) >= self.max_batch:
            raise ValueError(f"the batch is full ({self.max_batch} rows)")
        state = new_state(request.prompt_ids, self.max_length, stats)
        reads = provides(request.drafter, ReadsTargetFeatures)
        scores_prompt = request.prompt_logprobs is not None
        shared = () if scores_prompt else request.prompt_ids  # a prefix another row holds
        session = self.pool.open(features=reads, prompt=shared)  # raises when full
        try:
            row = self._new_row(request, session, state, reads, scores_prompt)
        except BaseException:
            session.release()  # a row that cannot start leaves no slot held
            raise
        self.rows[row.row_id] = row
        self._next_id += 1
        return row.row_id

    def _new_row(
        self,
        request: BatchRequest,
        session: RowSession,
        state: DecodeState,
        reads: bool,
        scores_prompt: bool,
    ) -> BatchRow:
        """The row of ``request`` on its new ``session`` (its drafter reset, its γ policy
        and bookkeeping set up)."""
        if scores_prompt:  # every prompt position's logits, so none may come cached
            session.reset()
        # the last prompt token is always computed: its logits start the generation
        cached = common_prefix_length(session.cached, request.prompt_ids[:-1])
        state.stats.cached_prompt_tokens = cached
        if request.drafter is not None:
            request.drafter.reset()
        chooses_length = provides(request.drafter, ChoosesDraftLength)
        if self.load is not None and chooses_length:
            # the load policy's measured K(k)/T(1) as the prior of its own V(k)
            curve = {k: self.load.cost(k) for k in range(1, AUTO_LENGTH_CAP + 2)}
            cast(ChoosesDraftLength, request.drafter).use_verify_cost(curve)
        gamma = request.gamma
        policy = FixedGamma(gamma) if isinstance(gamma, int) else gamma
        drafter = request.drafter
        situated = drafter if provides(drafter, SupportsDraftSituation) else None
        row = BatchRow(
            row_id=self._next_id,
            request=request,
            session=session,
            state=state,
            gamma_policy=policy,
            started=time.perf_counter(),
            situated=situated if request.tree is None else None,
            situates_policy=situated is not None and provides(policy, SupportsSituations),
            learns_costs=policy if provides(policy, SupportsCostFeedback) else None,
            learns_rounds=policy if provides(policy, LearnsRoundCosts) else None,
            chooses_length=chooses_length,
            reads_features=reads,
            draft_cost=(
                streamed_draft_cost(drafter, self._target_bytes)
                if request.draft_cost is None
                else request.draft_cost
            ),
            penalty_history=(
                PenaltyHistory(request.prompt_ids, request.penalties)
                if request.penalties is not None and request.penalties.active
                else None
            ),
            prompt_entries=[] if scores_prompt else None,
        )
        return row

    def forget_finished(self) -> None:
        """Later rows start from no finished row's cached prompt or output (a cold cache,
        as for benchmarks); live rows go on as they were."""
        self.pool.forget_finished()

    def cancel(self, row_id: int) -> GenerationResult:
        """Stop a row now and free its slot; returns what it generated so far."""
        return self._retire(self.rows[row_id], "cancelled")

    def _retire(self, row: BatchRow, reason: str | None = None) -> GenerationResult:
        """A finished row leaves: its slot freed, its result kept in ``finished``
        (``reason``: its finish reason, where the rounds did not set one)."""
        if reason is not None:
            row.state.finished, row.state.reason = True, reason
        del self.rows[row.row_id]
        row.session.release()
        result = row.result()
        self.finished[row.row_id] = result
        return result

    def step(self) -> dict[int, Round]:
        """One round for every decoding row and one prefill chunk for every joining row,
        all in one target pass: propose, forward, verify and commit per row. Finished
        rows leave (slot freed) before this returns; the result holds the rounds run."""
        rounds: dict[int, Round] = {}
        for row in list(self.rows.values()):
            if not row.decoding and row.prefill_left() == 0:
                if row.request.stop.max_new_tokens == 0:  # the prompt scored: done
                    rounds[row.row_id] = self._finish_prompt_only(row)
                else:
                    self._start_decoding(row)
        rows = list(self.rows.values())
        if not rows:
            return rounds
        chunks = [(row, self._prefill_chunk(row)) for row in rows if not row.decoding]
        chunk_tokens = sum(chunk.input_ids.numel() for _, chunk in chunks)
        planned = self._propose([row for row in rows if row.decoding], chunk_tokens, len(chunks))
        inputs = [chunk for _, chunk in chunks] + [p.proposal.request for p in planned]
        outputs, seconds = self._forward(inputs, chunks, planned)
        for (row, _), logits in zip(chunks, outputs[: len(chunks)], strict=True):
            scored = row.session.receive(logits)  # [1, k, vocab] or [1, 1, vocab]
            if row.prompt_entries is not None:
                self._score_prompt(row, scored[0])
            row.state.stats.prefill_seconds += seconds
        for p, logits in zip(planned, outputs[len(chunks) :], strict=True):
            _feed_back_costs(p, seconds)
            started = time.perf_counter()
            scored = p.row.session.receive(logits)
            try:
                rounds[p.row.row_id] = self._commit(p, scored)
            except ConstraintError as exc:  # that row ends; the others decode on
                rounds[p.row.row_id] = self._fail_row(p.row, str(exc))
                continue
            _feed_back_round(p, seconds + time.perf_counter() - started)
        return rounds

    def run(self, requests: Iterable[BatchRequest]) -> list[GenerationResult]:
        """Decode every request, at most ``max_batch`` at a time, rows joining as others
        finish (continuous batching); results in request order."""
        queue = list(requests)
        ids: list[int] = []
        while queue or self.rows:
            while queue and len(self.rows) < self.max_batch:
                ids.append(self.add(queue.pop(0)))
            self.draining = not queue
            self.step()
        return [self.finished[i] for i in ids]

    # ---- the steps of a round ------------------------------------------------------
    def _start_decoding(self, row: BatchRow) -> None:
        """The prompt is in the cache: hand the row's session (the model's single sequence
        or its cache slot, alike) to a drafter that reads it: its priming (features, a
        prompt cache import), else the features alone where the passes give them."""
        drafter = row.request.drafter
        if provides(drafter, SupportsPriming):
            drafter.prime(row.session)
        elif provides(drafter, ReadsTargetFeatures) and row.session.features is not None:
            drafter.read_features(row.session)
        row.decoding = True

    def _prefill_chunk(self, row: BatchRow) -> RowInput:
        """The row of the pass that feeds the next at most ``prefill_chunk`` prompt tokens
        (with every token's logits where the row scores its prompt)."""
        prefix = row.state.sequence[: row.state.prompt_length - 1]
        left = row.prefill_left()
        size = left if self.prefill_chunk is None else min(left, self.prefill_chunk)
        scores = row.prompt_entries is not None
        if scores:
            size = min(size, PROMPT_LOGPROBS_CHUNK)
        return row.session.request(prefix[: len(prefix) - left + size], every_logit=scores)

    @staticmethod
    def _score_prompt(row: BatchRow, logits: torch.Tensor) -> None:
        """The log-probabilities of the prompt tokens a prefill chunk's logits [k, vocab]
        predict: those after the chunk's k fed tokens (the last one at most the prompt's
        last token, which the first round feeds)."""
        assert row.prompt_entries is not None and row.request.prompt_logprobs is not None
        end = len(row.session.cached)  # the chunk fed positions end - k .. end - 1
        predicted = row.state.sequence[end - logits.shape[0] + 1 : end + 1]
        entries = emitted_logprobs(logits, predicted, row.request.prompt_logprobs)
        row.prompt_entries.extend(entries)

    def _finish_prompt_only(self, row: BatchRow) -> Round:
        """Retire a row that asked for no new tokens once its prompt is in the cache: one
        empty round, with the prompt's log-probabilities where it asked for them."""
        logprobs = None if row.request.logprobs is None else ()
        round_ = Round([], 0, 0, finished=True, reason="length", logprobs=logprobs)
        round_ = self._with_prompt_logprobs(row, round_)
        row.rounds.append(round_)
        self._retire(row, "length")
        return round_

    def _checks_constraint(self, row: BatchRow, proposal: Proposal) -> bool:
        """Whether a row's greedy check can take the model's own argmax ids, checked
        against its constraint token by token, instead of masking every row: a greedy
        chain under a constraint alone (no penalties) that answers :class:`ChecksTokens`,
        on a model that takes the argmax in its forward."""
        request = row.request
        return (
            request.params.greedy
            and proposal.tree is None
            and row.penalty_history is None
            and self._fused_argmax is not None
            and self.verifier is None
            and provides(request.constraint, ChecksTokens)
        )

    def _constrained_argmax(
        self,
        logits: torch.Tensor,  # [1, drafted + 1, vocab] the row's raw logits
        constraint: ChecksTokens,
        drafted: list[int],
    ) -> list[int] | None:
        """The argmax over the allowed tokens of each row the greedy check reads (the
        rows up to the first draft that differs from it): the model's own argmax where
        the constraint allows it (then the same token), else the restricted row's; rows
        after are left at the model's argmax (never read). None where the model has no
        argmax for these logits."""
        assert self._fused_argmax is not None
        ids = self._fused_argmax.argmax_rows(logits)
        if ids is None:
            return None
        assert provides(constraint, TokenConstraint)
        for i, token in enumerate(ids):
            extra = drafted[:i]
            if not constraint.allows(extra, token):
                row = logits[0, i : i + 1].float().clone()  # [1, vocab]
                ids[i] = int(constraint.restrict(row, [extra])[0].argmax())
            if i >= len(drafted) or drafted[i] != ids[i]:
                break  # the check stops here
        return ids

    def _fail_row(self, row: BatchRow, message: str) -> Round:
        """Retire a row whose constraint failed: an empty round, finish reason "error"
        (its result's ``error`` says why)."""
        round_ = Round([], 0, 0, finished=True, reason="error")
        row.rounds.append(round_)
        row.error = message
        self._retire(row, "error")
        return round_

    @staticmethod
    def _with_prompt_logprobs(row: BatchRow, round_: Round) -> Round:
        """``round_`` with the prompt's log-probabilities, if it is the row's first round
        and the row asked for them."""
        if row.prompt_entries is None or row.rounds:
            return round_
        return replace(round_, prompt_logprobs=tuple(row.prompt_entries))

    def _forward(
        self,
        inputs: list[RowInput],
        chunks: list[tuple[BatchRow, RowInput]],
        planned: list[_Planned],
    ) -> tuple[list[torch.Tensor], float]:
        """The shared target pass over ``inputs`` (the chunks' rows, then the planned
        rows'): every row's logits [k_row, vocab], and its seconds (its shape appended to
        ``pass_log`` where one is kept)."""
        log = self.pass_log
        cached = None
        if log is not None:  # before the pass: receiving its logits extends the caches
            rows = [row for row, _ in chunks] + [p.row for p in planned]
            cached = [len(row.session.cached) for row in rows]
        started = time.perf_counter()
        outputs = self.pool.forward_rows(inputs)
        seconds = time.perf_counter() - started
        if log is not None and cached is not None:
            fed = (row.input_ids.numel() for row in inputs)
            log.append(PassShape(tuple(zip(cached, fed, strict=True)), seconds))
        self._measure_pass(seconds, inputs)
        self.forward_seconds += seconds
        self.target_passes += 1
        return outputs, seconds

    def _propose(
        self, rows: list[BatchRow], extra_tokens: int = 0, extra_rows: int = 0
    ) -> list[_Planned]:
        load = None if self._chooses_alone(rows, extra_rows) else self.load
        unasked = load is not None and self._hopeless.skip(len(self.rows))
        wanted = [0] * len(rows) if unasked else [self._own_gamma(row) for row in rows]
        if load is not None and self.draining and len(self.rows) > 1 and any(wanted):
            wanted = self._furthest_behind(rows, wanted)
        offered = wanted  # what each row would draft but for the load
        if load is not None and any(wanted):
            wanted = self._load_gammas(load, rows, wanted, extra_tokens, extra_rows)
        if self.load is not None:  # a lone row choosing alone (load None here) too
            self._shed_idle_features(rows, offered, wanted, unasked)
        forced = self._forced_drafts(rows)
        if forced:  # those rows draft what their constraint forces (and a lookup after it)
            forced = {
                row.row_id: self._after_forced(row, forced[row.row_id], gamma)
                for row, gamma in zip(rows, wanted, strict=True)
                if row.row_id in forced
            }
            wanted = [0 if row.row_id in forced else g for row, g in zip(rows, wanted, strict=True)]
        free = [(row, g) for row, g in zip(rows, wanted, strict=True) if row.row_id not in forced]
        together = self._proposals_together([r for r, _ in free], [g for _, g in free])
        planned = []
        for row, gamma in zip(rows, wanted, strict=True):
            if row.row_id in forced:  # no γ policy is asked or told: unasked
                proposal = self._forced_proposal(row, forced[row.row_id])
                planned.append(_Planned(row, proposal, 0.0, 0, unasked=True))
                continue
            if row.row_id in together:
                proposal, seconds, calls = together[row.row_id]
            else:
                started, calls = time.perf_counter(), row.state.stats.draft_calls
                proposal = self._proposal(row, gamma)
                seconds = time.perf_counter() - started
            if gamma > 0 or row.request.tree is not None:  # the drafter was asked
                self._measure_propose(row, seconds, calls)
                row.state.stats.draft_seconds += seconds
            planned.append(_Planned(row, proposal, seconds, gamma, unasked))
        return planned

    def _forced_proposal(self, row: BatchRow, draft: Draft) -> Proposal:
        """A forced draft's pass row: a chain, or for a row that drafts token trees the
        same chain as a tree (its tree verification then checks it)."""
        if row.request.tree is None:
            return self._chain_proposal(row, draft)
        return self._tree_proposal(row, DraftTree.chain(draft.tokens))

    def _forced_drafts(self, rows: list[BatchRow]) -> dict[int, Draft]:
        """Per row whose constraint forces its next tokens (:class:`ForcesTokens`): those
        tokens as a point-mass draft, cut to what the pass and the row's token budget can
        still use (the round adds one token of its own)."""
        out = {}
        for row in rows:
            constraint = row.request.constraint
            if not provides(constraint, ForcesTokens):
                continue
            tokens = constraint.forced(self._forced_room(row, 0))
            if tokens:
                out[row.row_id] = Draft(tokens=tokens)
        return out

    def _forced_room(self, row: BatchRow, drafted: int) -> int:
        """Tokens a forced round may still draft after ``drafted`` of them: within
        FORCED_DRAFT_MAX, the row's token budget (the round adds one token of its own)
        and the context window."""
        state = row.state
        length = len(state.sequence) + drafted
        budget = row.request.stop.max_new_tokens - (length - state.prompt_length) - 1
        room = min(FORCED_DRAFT_MAX - drafted, budget)
        if self.max_length is not None:
            room = min(room, self.max_length - length - 1)
        return max(0, room)

    def _after_forced(self, row: BatchRow, forced: Draft, gamma: int) -> Draft:
        """A forced draft, continued by the row's drafter where it is a context lookup
        (:class:`LooksUpContext`: a function of the context, which may then end in the
        forced tokens) by up to the ``gamma`` it was offered, within FORCED_DRAFT_MAX:
        the value after a schema's key, copied from the prompt, in the key's round."""
        drafter = row.request.drafter
        limit = min(gamma, self._forced_room(row, len(forced.tokens)))
        if limit < 1 or not provides(drafter, LooksUpContext):
            return forced
        context = [*row.state.sequence, *forced.tokens]
        params, generator = row.request.params, row.request.generator
        more = drafter.propose(context, limit, params, generator)
        if more.probs is not None or more.rows is not None:  # not a point mass after all
            return forced
        return Draft(tokens=[*forced.tokens, *more.tokens])

    @staticmethod
    def _shed_idle_features(
        rows: list[BatchRow], offered: list[int], wanted: list[int], unasked: bool
    ) -> None:
        """Count, per row beside others, the consecutive rounds the load policy held it
        at γ 0 (skipped as hopeless, or offered a draft and given none; a round it was
        not offered one, e.g. a row ahead in a closing batch, counts neither way); after
        SHED_AFTER of them, a drafter that can draft without the target's features
        (:class:`ShedsTargetFeatures`) sheds them and the row's session stops keeping
        them, so passes without such rows copy none out. (Drafts are proposals only:
        what a row emits does not depend on which drafter proposed them.)"""
        for row, before, gamma in zip(rows, offered, wanted, strict=True):
            held = len(rows) > 1 and gamma == 0 and (unasked or before > 0)
            if held:
                row.load_plain_rounds += 1
            elif gamma > 0 or len(rows) == 1:
                row.load_plain_rounds = 0
            drafter = row.request.drafter
            if (
                row.reads_features
                and row.load_plain_rounds >= SHED_AFTER
                and row.request.tree is None
                and provides(drafter, ShedsTargetFeatures)
            ):
                cast(ShedsTargetFeatures, drafter).shed_features()
                row.session.drop_features()
                row.reads_features = False

    @staticmethod
    def _chooses_alone(rows: list[BatchRow], extra_rows: int) -> bool:
        """One row in the pass, whose drafter picks its own draft length
        (:class:`ChoosesDraftLength`): its running cost model already weighs the whole
        pass (the measured time of verifying k tokens against a plain step), so the load
        policy's γ is only its cap, as for a single sequence with ``--gamma auto``. (The
        policy, which prices drafts by the row's acceptance over all its rounds, had such
        a drafter draft in 2 % of rounds at B = 1, 0.97× plain, where it chose alone
        1.12×.)"""
        return len(rows) == 1 and extra_rows == 0 and rows[0].chooses_length

    def _proposals_together(
        self, rows: list[BatchRow], wanted: list[int]
    ) -> dict[int, tuple[Proposal, float, int]]:
        """The chains of rows whose drafters draft in shared steps (``DraftsRowsTogether``,
        the same row group, two rows or more): one call per group, each draft exactly the
        row's own. Per row id: its proposal, its share of the call's seconds and its
        draft-call count before."""
        groups: dict[Hashable, list[tuple[BatchRow, int]]] = {}
        for row, gamma in zip(rows, wanted, strict=True):
            drafter = row.request.drafter
            gamma = draft_length(gamma, row.state, self.max_length)
            if row.request.tree is not None or gamma == 0:
                continue
            group = drafter.row_group() if provides(drafter, DraftsRowsTogether) else None
            if group is not None:
                groups.setdefault(group, []).append((row, gamma))
        out = self._trees_together(rows)
        for members in groups.values():
            if len(members) < 2:
                continue
            calls = [row.state.stats.draft_calls for row, _ in members]
            asks = [
                RowAsk(row.request.drafter, row.state.sequence, gamma, row.request.params,
                       row.request.generator)
                for row, gamma in members
            ]  # fmt: skip
            states = [row.state for row, _ in members]
            started = time.perf_counter()
            lead = cast(DraftsRowsTogether, members[0][0].request.drafter)
            drafts = propose_drafts_together(lead, asks, states)
            share = (time.perf_counter() - started) / len(members)
            for (row, _), draft, before in zip(members, drafts, calls, strict=True):
                out[row.row_id] = (self._chain_proposal(row, draft), share, before)
        return out

    def _trees_together(self, rows: list[BatchRow]) -> dict[int, tuple[Proposal, float, int]]:
        """The trees of rows whose drafters draft trees in shared passes
        (``DraftsTreesTogether``, the same row group, two rows or more), as
        :meth:`_proposals_together` gives chains."""
        groups: dict[Hashable, list[BatchRow]] = {}
        for row in rows:
            tree, drafter = row.request.tree, row.request.drafter
            if tree is None or tree.drafter is not drafter:
                continue
            group = drafter.row_group() if provides(drafter, DraftsTreesTogether) else None
            if group is not None:
                groups.setdefault(group, []).append(row)
        out = {}
        for members in groups.values():
            if len(members) < 2:
                continue
            calls = [row.state.stats.draft_calls for row in members]
            asks = [
                cast(TreeRound, row.request.tree).ask(
                    row.state.sequence, self.max_length, row.request.params, row.request.generator
                )
                for row in members
            ]
            started = time.perf_counter()
            lead = cast(DraftsTreesTogether, members[0].request.drafter)
            trees = propose_trees_together(lead, asks, [row.state.stats for row in members])
            share = (time.perf_counter() - started) / len(members)
            for row, tree, before in zip(members, trees, calls, strict=True):
                out[row.row_id] = (self._tree_proposal(row, tree), share, before)
        return out

    def _load_gammas(
        self,
        load: LoadAwareGamma,
        rows: list[BatchRow],
        wanted: list[int],
        extra_tokens: int,
        extra_rows: int,
    ) -> list[int]:
        """The load-aware policy's γ per row. Several rows are asked first with each row's
        most optimistic acceptance (the best of its situations, :meth:`_best_alphas`):
        when even that drafts nothing (the batch fills the kernels' flat region), no
        row's situation is looked up (an n-gram search over its context, per row and
        round)."""
        padded = self._padded
        known = [
            (g, self._fed(row), *self._draft_costs(row, load))
            for row, g in zip(rows, wanted, strict=True)
        ]
        own = [row.alphas() for row in rows]
        if len(rows) > 1:  # one row: its lookup costs what the check would
            hopes = [
                _row_load(self._best_alphas(row, a), k)
                for row, a, k in zip(rows, own, known, strict=True)
            ]
            if not any(load.choose(hopes, extra_tokens, padded, extra_rows)):
                self._hopeless.start(len(self.rows))
                return [0] * len(rows)
        loads = [
            _row_load(self._load_alphas(row, a), k)
            for row, a, k in zip(rows, own, known, strict=True)
        ]
        chosen = load.choose(loads, extra_tokens, padded, extra_rows)
        if any(chosen):
            self._hopeless.drafted()
        elif all(row.situated is None for row in rows):
            # no row's α can change before it drafts again: skip the next few choices
            self._hopeless.start(len(self.rows))
        return chosen

    def _furthest_behind(self, rows: list[BatchRow], wanted: list[int]) -> list[int]:
        """While nothing waits to join, the batch ends when the row with the most tokens
        left (of its budget) ends: a row ahead of it emits its tokens sooner without
        ending the batch sooner, and its drafts make every pass dearer, so it keeps γ 0.
        A closed batch then never ends later than plain batched decoding's would for a
        draft the policy got right; its rows' own speeds are no longer the aim."""
        left = {row.row_id: self._tokens_left(row) for row in self.rows.values()}
        last = max(left.values())
        return [g if left[row.row_id] == last else 0 for row, g in zip(rows, wanted, strict=True)]

    def _tokens_left(self, row: BatchRow) -> int:
        """Tokens the row may still emit: its budget, capped by the model's length."""
        state = row.state
        left = row.request.stop.max_new_tokens - len(state.generated)
        if self.max_length is not None:
            left = min(left, self.max_length - len(state.sequence))
        return left

    def _best_alphas(self, row: BatchRow, own: tuple[float, ...]) -> tuple[float, ...]:
        """An upper bound of :meth:`_load_alphas`, position by position, without looking
        the situation up."""
        if row.situated is None:
            return own
        return self.situations.best_alphas(row.situated.name, own)

    def _load_alphas(self, row: BatchRow, own: tuple[float, ...]) -> tuple[float, ...]:
        """The acceptance per position the load policy drafts for: this round's
        situation's, pooled over rows, where the row's drafter says its situation; else
        the row's own (``own``)."""
        drafter = row.situated
        if drafter is None:
            return own
        row.situation = (drafter.name, drafter.draft_situation(row.state.sequence))
        return self.situations.alphas(row.situation, own)

    def _own_gamma(self, row: BatchRow) -> int:
        request, policy = row.request, row.gamma_policy
        if request.drafter is None or request.tree is not None:
            return 0
        if row.situates_policy and row.situated is not None:  # both asked at add()
            cast(SupportsSituations, policy).situate(
                row.situated.draft_situation(row.state.sequence)
            )
        return policy.next_gamma()

    def _proposal(self, row: BatchRow, gamma: int) -> Proposal:
        """The row's draft (chain of ``gamma`` tokens, or its tree) and the pass row."""
        request, state = row.request, row.state
        if request.tree is not None:
            tree = request.tree.propose(
                state.sequence, self.max_length, request.params, request.generator,
                state.stats, request.drafter,
            )  # fmt: skip
            return self._tree_proposal(row, tree)
        draft = propose_draft(
            request.drafter, gamma, state, self.max_length, request.params, request.generator
        )
        return self._chain_proposal(row, draft)

    def _chain_proposal(self, row: BatchRow, draft: Draft) -> Proposal:
        """The pass row that scores ``draft`` after the row's sequence, and the uniforms
        its verification will use, drawn now: right after the drafter's own draws, the
        generator's code is warm (right after the pass it is not), and nothing draws from
        the row's generator in between, so they are the values verification would draw."""
        request = row.request
        uniforms = None
        if self.verifier is None and not request.params.greedy:
            uniforms = VerifyUniforms.draw(len(draft.tokens), request.generator)
        pass_row = row.session.request(row.state.sequence, draft.tokens)
        return Proposal(pass_row, draft=draft, uniforms=uniforms)

    @staticmethod
    def _tree_proposal(row: BatchRow, tree: DraftTree) -> Proposal:
        """The pass row that scores the row's tree after its sequence."""
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        return Proposal(row.session.request_tree(row.state.sequence, tokens, parents), tree=tree)

    @staticmethod
    def _measure_propose(row: BatchRow, seconds: float, calls_before: int) -> None:
        steps = row.state.stats.draft_calls - calls_before
        if steps:  # a model drafter: its cost grows with the draft steps
            row.step_draft_seconds = decayed_average(
                row.step_draft_seconds, seconds / steps, COST_DECAY
            )
        elif row.request.drafter is not None and seconds > 0:
            row.propose_seconds = decayed_average(row.propose_seconds, seconds, COST_DECAY)

    def _draft_costs(self, row: BatchRow, load: LoadAwareGamma) -> tuple[float, float]:
        """(c per draft step, fixed cost of the propose call), each ÷ T(1): the row's
        prior c until measured, then the running measurements. The fixed cost includes
        the catch-up a lagging drafter runs first (:class:`ReportsDraftCost`): its first
        step feeds ``backlog`` positions more, priced as a pass that much longer, spread
        over ``CATCH_UP_ROUNDS`` rounds."""
        per_step = row.draft_cost
        if self.step_seconds and row.step_draft_seconds is not None:
            per_step = row.step_draft_seconds / self.step_seconds
        per_call = (row.propose_seconds or 0.0) / self.step_seconds if self.step_seconds else 0.0
        drafter = row.request.drafter
        if per_step and provides(drafter, ReportsDraftCost):
            backlog = drafter.draft_backlog(row.state.sequence)
            if backlog:
                catch_up = per_step * (load.cost(backlog + 1) - load.cost(1))
                per_call += catch_up / CATCH_UP_ROUNDS
        return per_step, per_call

    def _measure_pass(self, seconds: float, inputs: list[RowInput]) -> None:
        """Tell the load policy the pass's shape and seconds, and update the running T(1)
        estimate from it."""
        if self.load is None:
            return
        lengths = [row.input_ids.numel() for row in inputs]
        tokens = sum(lengths) if self._padded is None else self._padded(lengths)
        self.load.observe(len(inputs), tokens, seconds)
        if tokens > 4 * self.max_batch * 16:  # skip prefill-sized passes
            return
        self.step_seconds = decayed_average(
            self.step_seconds, seconds / self.load.pass_cost(len(inputs), tokens), COST_DECAY
        )

    @staticmethod
    def _fed(row: BatchRow) -> int:
        """Tokens the row feeds this round besides its chain drafts (catch-up, the last
        token; a tree row's whole tree)."""
        tree = row.request.tree
        nodes = tree.budget if tree is not None else 0
        return max(1, len(row.state.sequence) - len(row.session.cached)) + nodes

    def _commit(self, planned: _Planned, logits: torch.Tensor) -> Round:
        """Verify the row's proposal against its logits [1, drafted + 1, vocab], keep the
        accepted tokens, and retire the row when it finished."""
        row, proposal = planned.row, planned.proposal
        request = row.request
        raw = logits  # what log-probabilities report
        history, constraint = row.penalty_history, request.constraint
        penalized = history is not None or constraint is not None
        best = None  # the model's argmax and nucleus search read its own (raw) logits
        if request.params.greedy and self._fused_argmax is not None and not penalized:
            best = self._fused_argmax.argmax_rows(logits)  # drafted + 1 ids or None
        elif self._checks_constraint(row, proposal):
            assert provides(constraint, ChecksTokens) and proposal.draft is not None
            best = self._constrained_argmax(logits, constraint, proposal.draft.tokens)
            penalized = best is None  # else the rows the check reads are settled: no mask
        if penalized:
            logits = _processed(logits, history, constraint, proposal)
        if proposal.tree is not None:
            assert request.tree is not None
            result = request.tree.verify(
                proposal.tree, logits[0], request.params, request.generator
            )
            row.session.keep_path(result.path)
        else:
            assert proposal.draft is not None
            result = verify_draft(
                proposal.draft, logits, request.params, request.generator, self.verifier, best,
                None if penalized else self._nucleus, proposal.uniforms,
            )  # fmt: skip
        emitted, num_accepted = accepted(result)
        if request.drafter is not None and proposal.tree is None and not planned.unasked:
            row.gamma_policy.update(proposal.drafted, num_accepted)
            if row.situation is not None:
                self.situations.record(row.situation, proposal.drafted, num_accepted, planned.asked)
                row.situation = None
        round_ = commit_tokens(
            row.state, request.drafter, self.max_length, proposal.drafted, emitted,
            num_accepted, request.stop,
        )  # fmt: skip
        if history is not None:
            history.extend(round_.tokens)
        if constraint is not None:
            constraint.extend(round_.tokens)
        if request.logprobs is not None:
            rows = _emitted_rows(raw, result)  # [emitted, vocab]
            logprobs = emitted_logprobs(rows, round_.tokens, request.logprobs)
            round_ = replace(round_, logprobs=logprobs)
        round_ = self._with_prompt_logprobs(row, round_)
        row.rounds.append(round_)
        row.state.stats.seconds = time.perf_counter() - row.started
        if round_.finished:
            self._retire(row)
        return round_


def _processed(
    logits: torch.Tensor,
    history: PenaltyHistory | None,
    constraint: TokenConstraint | None,
    proposal: Proposal,
) -> torch.Tensor:
    """The row's logits [1, fed, vocab] penalized, then restricted to what the constraint
    allows, each row by its own history: the committed sequence, then a chain's drafts
    before it or a tree node's path."""
    tree = proposal.tree
    if tree is not None:
        tokens = tree.tokens.tolist()
        paths = ([tokens[i] for i in tree.path_to(node)] for node in range(tree.size))
        extras = [[], *paths]
    else:
        drafted = proposal.draft.tokens if proposal.draft is not None else []
        extras = [drafted[:i] for i in range(len(drafted) + 1)]
    rows = logits[0, : len(extras)]  # [n, vocab]
    rows = rows.float().clone() if history is None else history.apply(rows, extras)
    if constraint is not None:
        rows = constraint.restrict(rows, extras)
    return rows.unsqueeze(0)


def _emitted_rows(logits: torch.Tensor, result: VerifyResult | TreeVerifyResult) -> torch.Tensor:
    """The target's logits row of each token a round emitted, [emitted, vocab], from the
    row's [1, fed, vocab]: a chain's emitted token i was scored at row i; a tree's at the
    root's row, then at each accepted node's (node j's row is j + 1)."""
    if isinstance(result, TreeVerifyResult):
        return logits[0, [0, *(node + 1 for node in result.path)]]
    return logits[0]


def _row_load(alphas: tuple[float, ...], known: tuple[int, int, float, float]) -> RowLoad:
    """What the load policy knows of a row: its acceptance per position and ``known``
    (its own γ, fed tokens, draft cost per step and per call)."""
    return RowLoad(alphas[0], *known, alphas=alphas)


def _feed_back_costs(planned: _Planned, pass_seconds: float) -> None:
    """Tell a γ policy that learns from timings what this round's drafting and its
    verification pass really cost (catch-up forwards and overheads included)."""
    policy, drafted = planned.row.learns_costs, planned.proposal.drafted
    if drafted and planned.proposal.tree is None and policy is not None and not planned.unasked:
        policy.observe_costs(drafted, planned.propose_seconds, pass_seconds)


def _feed_back_round(planned: _Planned, seconds: float) -> None:
    """Tell a γ policy that prices rounds from their timings what this one cost: the
    pass and the row's verification and commit, plain rounds included."""
    policy = planned.row.learns_rounds
    if policy is not None and planned.proposal.tree is None:
        policy.observe_round(planned.proposal.drafted + 1, seconds)


def _default_pool(target: CausalLM, max_batch: int) -> RowPool:
    """The target's cache slots, or (max_batch 1) its own single-sequence cache."""
    if provides(target, SupportsBatchRows):
        return SlotPool(target)
    if max_batch > 1:
        raise ValueError(f"{type(target).__name__} cannot hold several sequences (slots)")
    return SinglePool(ModelSession(target))
