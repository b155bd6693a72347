"""Batched speculative decoding: many rows share each target pass.

Each round every active row proposes its own draft (its own drafter, γ, sampling
parameters and generator); ONE ragged target forward (``SupportsBatchRows.forward_rows``)
scores every row's last token and drafts, each row in its own cache slot; each row is then
verified and committed alone with the same functions as the single-sequence loop
(:func:`propose_draft`, :func:`verify_draft`, :func:`commit_tokens`). A row's logits in
the batch equal its logits alone (bitwise), and its randomness comes only from its own
generator, so each row's output is exactly what :class:`SpeculativeEngine` gives it alone.

Continuous batching: :meth:`BatchEngine.add` joins a row between rounds (its prompt is
prefilled inside the next shared pass), a finished or cancelled row frees its slot at
once. A drafter is per row: one instance per request (a model drafter with its own model
and session). Priming a model drafter from the target's prefill (``share_prefill``) is
not done here: the drafter prefills itself (lossless; only the drafts can differ).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from speculative.drafters.base import Draft, Drafter
from speculative.engine.gamma import FixedGamma, GammaPolicy, LoadAwareGamma, RowLoad
from speculative.engine.loop import (
    DecodeState,
    GenerationResult,
    Round,
    Verifier,
    commit_tokens,
    propose_draft,
    verify_draft,
)
from speculative.engine.stats import GenerationStats
from speculative.engine.stopping import StopCriteria
from speculative.models.base import CausalLM, SupportsBatchRows
from speculative.models.session import SlotSession
from speculative.sampling import SamplingParams

ALPHA_PRIOR = 0.6  # running acceptance estimate: Beta prior mean ...
ALPHA_PRIOR_WEIGHT = 2.0  # ... and weight in pseudo-drafts
COST_DECAY = 0.8  # running means of measured seconds: weight of the previous value


@dataclass
class BatchRequest:
    """One sequence to decode in a batch, with everything that is its own."""

    prompt_ids: Sequence[int]
    params: SamplingParams
    stop: StopCriteria
    generator: torch.Generator
    drafter: Drafter | None = None  # one instance per row (drafters keep per-row state)
    gamma: GammaPolicy | int = 4  # the row's own γ (the load-aware policy may lower it)
    draft_cost: float = 0.0  # c of the drafter (draft step ÷ target step), for the load policy


@dataclass
class BatchRow:
    """An active row: its request, cache slot, committed sequence and rounds."""

    row_id: int
    request: BatchRequest
    session: SlotSession
    state: DecodeState
    gamma_policy: GammaPolicy
    started: float
    rounds: list[Round] = field(default_factory=list)
    propose_seconds: float | None = None  # running mean of a propose call that drafted
    step_draft_seconds: float | None = None  # model drafters: running mean per draft step

    def result(self) -> GenerationResult:
        return GenerationResult(
            token_ids=list(self.state.generated),
            stats=self.state.stats,
            finish_reason=self.state.reason,
            rounds=self.rounds,
        )

    def alpha(self) -> float:
        """Running per-token acceptance estimate (Beta prior + this row's examined drafts)."""
        stats = self.state.stats
        prior = ALPHA_PRIOR * ALPHA_PRIOR_WEIGHT
        return (sum(stats.accepted_at) + prior) / (sum(stats.reached) + ALPHA_PRIOR_WEIGHT)


@dataclass
class _Planned:
    row: BatchRow
    draft: Draft


class BatchEngine:
    """Decodes many rows together over a target with per-row cache slots."""

    def __init__(
        self,
        target: CausalLM,
        max_batch: int = 8,
        load: LoadAwareGamma | None = None,
        verifier: Verifier | None = None,
    ) -> None:
        """load: choose every row's γ (at most its own) for the load each round; None
        keeps each row's own γ. verifier: as in :class:`SpeculativeEngine` (negative
        controls only)."""
        if not isinstance(target, SupportsBatchRows):
            raise ValueError(f"{type(target).__name__} cannot hold several sequences (slots)")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.target = target
        self.max_batch = max_batch
        self.load = load
        self.verifier = verifier
        self.rows: dict[int, BatchRow] = {}  # active rows by id, in joining order
        self.finished: dict[int, GenerationResult] = {}
        self.target_passes = 0
        self.step_seconds: float | None = None  # running estimate of T(1), in seconds
        self._next_id = 0

    @property
    def max_length(self) -> int | None:
        return self.target.max_length

    def add(self, request: BatchRequest) -> int:
        """Join a row (decoded from the next round on); returns its id. ValueError when
        the batch is full or the prompt does not fit."""
        if len(self.rows) >= self.max_batch:
            raise ValueError(f"the batch is full ({self.max_batch} rows)")
        prompt = list(request.prompt_ids)
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        limit = self.max_length
        if limit is not None and len(prompt) >= limit:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens but the model's context window is {limit}"
            )
        session = SlotSession(self.target)  # raises when no slot is free
        if request.drafter is not None:
            request.drafter.reset()
        gamma = request.gamma
        row = BatchRow(
            row_id=self._next_id,
            request=request,
            session=session,
            state=DecodeState(prompt, len(prompt), GenerationStats()),
            gamma_policy=FixedGamma(gamma) if isinstance(gamma, int) else gamma,
            started=time.perf_counter(),
        )
        self.rows[row.row_id] = row
        self._next_id += 1
        return row.row_id

    def cancel(self, row_id: int) -> GenerationResult:
        """Stop a row now and free its slot; returns what it generated so far."""
        row = self.rows.pop(row_id)
        row.state.finished, row.state.reason = True, "cancelled"
        row.session.release()
        result = row.result()
        self.finished[row_id] = result
        return result

    def step(self) -> dict[int, Round]:
        """One round for every active row: propose, one shared target pass, verify and
        commit per row. Finished rows leave (slot freed) before this returns."""
        if not self.rows:
            return {}
        planned = self._propose(list(self.rows.values()))
        inputs = [p.row.session.request(p.row.state.sequence, p.draft.tokens) for p in planned]
        started = time.perf_counter()
        outputs = self.target.forward_rows(inputs)  # [k_row, vocab] each
        self._measure_pass(time.perf_counter() - started, sum(r.input_ids.numel() for r in inputs))
        self.target_passes += 1
        rounds = {}
        for p, logits in zip(planned, outputs, strict=True):
            rounds[p.row.row_id] = self._commit(p, p.row.session.receive(logits))
        return rounds

    def run(self, requests: Iterable[BatchRequest]) -> list[GenerationResult]:
        """Decode every request, at most ``max_batch`` at a time, rows joining as others
        finish (continuous batching); results in request order."""
        queue = list(requests)
        ids: list[int] = []
        while queue or self.rows:
            while queue and len(self.rows) < self.max_batch:
                ids.append(self.add(queue.pop(0)))
            self.step()
        return [self.finished[i] for i in ids]

    # ---- the steps of a round ------------------------------------------------------
    def _propose(self, rows: list[BatchRow]) -> list[_Planned]:
        wanted = [
            row.gamma_policy.next_gamma() if row.request.drafter is not None else 0
            for row in rows
        ]
        if self.load is not None:
            loads = [
                RowLoad(row.alpha(), g, self._fed(row), *self._draft_costs(row))
                for row, g in zip(rows, wanted, strict=True)
            ]
            wanted = self.load.choose(loads)
        planned = []
        for row, gamma in zip(rows, wanted, strict=True):
            request = row.request
            started, calls = time.perf_counter(), row.state.stats.draft_calls
            draft = propose_draft(
                request.drafter, gamma, row.state, self.max_length, request.params,
                request.generator,
            )  # fmt: skip
            self._measure_propose(row, time.perf_counter() - started, calls)
            planned.append(_Planned(row, draft))
        return planned

    @staticmethod
    def _measure_propose(row: BatchRow, seconds: float, calls_before: int) -> None:
        steps = row.state.stats.draft_calls - calls_before
        if steps:  # a model drafter: its cost grows with the draft steps
            row.step_draft_seconds = _running(row.step_draft_seconds, seconds / steps)
        elif row.request.drafter is not None and seconds > 0:
            row.propose_seconds = _running(row.propose_seconds, seconds)

    def _draft_costs(self, row: BatchRow) -> tuple[float, float]:
        """(c per draft step, fixed cost per propose call), each ÷ T(1): the request's
        ``draft_cost`` until measured, then the running measurements."""
        if not self.step_seconds:
            return row.request.draft_cost, 0.0
        per_step = row.request.draft_cost
        if row.step_draft_seconds is not None:
            per_step = row.step_draft_seconds / self.step_seconds
        per_call = (row.propose_seconds or 0.0) / self.step_seconds
        return per_step, per_call

    def _measure_pass(self, seconds: float, tokens: int) -> None:
        """Update the running T(1) estimate from a pass of ``tokens`` tokens."""
        if self.load is None or tokens > 4 * self.max_batch * 16:  # skip prefill-sized passes
            return
        self.step_seconds = _running(self.step_seconds, seconds / self.load.cost(tokens))

    @staticmethod
    def _fed(row: BatchRow) -> int:
        """Tokens the row feeds this round besides its drafts (prefill, catch-up, last)."""
        return max(1, len(row.state.sequence) - len(row.session.cached))

    def _commit(self, planned: _Planned, logits: torch.Tensor) -> Round:
        row, draft = planned.row, planned.draft
        request = row.request
        result = verify_draft(draft, logits, request.params, request.generator, self.verifier)
        num_accepted = int(result.num_accepted[0])
        if request.drafter is not None:
            row.gamma_policy.update(len(draft.tokens), num_accepted)
        round_ = commit_tokens(
            row.state, request.drafter, self.max_length, len(draft.tokens), result.emitted(0),
            num_accepted, request.stop,
        )  # fmt: skip
        row.rounds.append(round_)
        row.state.stats.seconds = time.perf_counter() - row.started
        if round_.finished:
            del self.rows[row.row_id]
            row.session.release()
            self.finished[row.row_id] = row.result()
        return round_


def _running(previous: float | None, value: float) -> float:
    """Running mean with decay COST_DECAY (the first value as is)."""
    return value if previous is None else COST_DECAY * previous + (1 - COST_DECAY) * value
