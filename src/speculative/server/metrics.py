"""Prometheus metrics of one server (a registry per app: never the global default one).

Counters: requests by endpoint and status; prompt, completion, drafted, accepted,
recovered and bonus tokens; per drafted position, the rounds that reached it and those
that accepted it. Gauges: running and waiting requests, the last pass's batch size, free
batch slots, the acceptance rate α and per-position acceptance. Histograms: time to first
token, time per output token, end-to-end latency, emitted tokens per target pass per row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from speculative.engine.loop import GenerationResult, Round
from speculative.engine.stats import PositionAcceptance
from speculative.server.scheduler import Job, Scheduler, SchedulerObserver
from speculative.server.text import BONUS, RECOVERED, token_kinds

PREFIX = "speculative"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class _Timing:
    """Per-job timestamps the metrics need."""

    first_token: float | None = None
    tokens: int = 0


@dataclass
class ServerMetrics(SchedulerObserver):
    """The app's metrics; also the scheduler's observer."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    _timings: dict[int, _Timing] = field(default_factory=dict)
    _drafted: int = 0  # totals behind the acceptance gauges
    _accepted: int = 0
    _positions: PositionAcceptance = field(default_factory=PositionAcceptance)

    def __post_init__(self) -> None:
        r = self.registry
        p = PREFIX
        self.requests = Counter(
            f"{p}_requests", "Finished requests", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_prompt_tokens = Counter(
            f"{p}_prompt_tokens_cached",
            "Prompt tokens found in the cache (a live or finished row's), not computed",
            registry=r,
        )
        self.completion_tokens = Counter(f"{p}_completion_tokens", "Generated tokens", registry=r)
        self.drafted = Counter(f"{p}_drafted_tokens", "Drafted tokens", registry=r)
        self.accepted = Counter(f"{p}_accepted_tokens", "Accepted drafted tokens", registry=r)
        self.recovered = Counter(
            f"{p}_recovered_tokens", "Recovered tokens (after a rejection)", registry=r
        )
        self.bonus = Counter(
            f"{p}_bonus_tokens", "Bonus tokens (after a full acceptance)", registry=r
        )
        self.reached = Counter(
            f"{p}_position_reached",
            "Rounds whose drafted position was examined",
            ["position"],
            registry=r,
        )
        self.accepted_at = Counter(
            f"{p}_position_accepted",
            "Rounds whose drafted position was accepted",
            ["position"],
            registry=r,
        )
        self.running = Gauge(f"{p}_requests_running", "Requests decoding in the batch", registry=r)
        self.waiting = Gauge(
            f"{p}_requests_waiting", "Requests waiting for a batch slot", registry=r
        )
        self.batch_size = Gauge(f"{p}_batch_size", "Rows in the last target pass", registry=r)
        self.free_slots = Gauge(f"{p}_free_cache_slots", "Free batch (cache) slots", registry=r)
        self.acceptance = Gauge(f"{p}_acceptance_rate", "α: accepted ÷ drafted tokens", registry=r)
        self.position_acceptance = Gauge(
            f"{p}_position_acceptance_rate", "Acceptance rate at each drafted position",
            ["position"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            f"{p}_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            f"{p}_time_per_output_token_seconds", "Time per output token after the first",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            f"{p}_e2e_request_latency_seconds", "End-to-end request latency",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens_per_pass = Histogram(
            f"{p}_tokens_per_target_pass", "Emitted tokens per target pass (per row)",
            buckets=TOKEN_BUCKETS, registry=r,
        )  # fmt: skip

    def attach(self, scheduler: Scheduler) -> None:
        """Read the live gauges from ``scheduler`` at each scrape."""
        self.running.set_function(lambda: scheduler.running)
        self.waiting.set_function(lambda: scheduler.waiting)
        self.free_slots.set_function(lambda: scheduler.free_slots)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_request(self, endpoint: str, status: str) -> None:
        self.requests.labels(endpoint=endpoint, status=status).inc()

    # ---- scheduler observer (scheduler thread) ----------------------------------
    def on_admit(self, job: Job) -> None:
        self._timings[id(job)] = _Timing()
        self.prompt_tokens.inc(len(job.request.prompt_ids))
        self.cached_prompt_tokens.inc(job.stats.cached_prompt_tokens)

    def on_step(self, batch: int, waiting: int, running: int) -> None:
        self.batch_size.set(batch)

    def on_round(self, job: Job, round_: Round) -> None:
        timing = self._timings.setdefault(id(job), _Timing())
        if round_.tokens and timing.first_token is None:
            timing.first_token = time.perf_counter()
            self.ttft.observe(timing.first_token - job.submitted)
        timing.tokens += len(round_.tokens)
        self.completion_tokens.inc(len(round_.tokens))
        self.tokens_per_pass.observe(len(round_.tokens))
        self.drafted.inc(round_.drafted)
        self.accepted.inc(round_.num_accepted)
        kinds = token_kinds(round_)
        self.recovered.inc(kinds.count(RECOVERED))
        self.bonus.inc(kinds.count(BONUS))
        self._record_acceptance(round_.drafted, round_.num_accepted)

    def on_finish(self, job: Job, status: str, result: GenerationResult | None) -> None:
        timing = self._timings.pop(id(job), None)
        now = time.perf_counter()
        self.e2e.observe(now - job.submitted)
        if timing is not None and timing.first_token is not None and timing.tokens > 1:
            self.tpot.observe((now - timing.first_token) / (timing.tokens - 1))

    def _record_acceptance(self, drafted: int, num_accepted: int) -> None:
        """Per-position counts as GenerationStats keeps them (:class:`PositionAcceptance`):
        position i+1 is examined when the i before it were accepted."""
        self._drafted += drafted
        self._accepted += num_accepted
        if self._drafted:
            self.acceptance.set(self._accepted / self._drafted)
        examined = self._positions.record(drafted, num_accepted)
        for i in range(examined):
            position = str(i + 1)
            self.reached.labels(position=position).inc()
            if i < num_accepted:
                self.accepted_at.labels(position=position).inc()
            self.position_acceptance.labels(position=position).set(self._positions.rate(i))
