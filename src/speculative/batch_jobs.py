"""Offline batched jobs: prompt records in, one result line per record out.

A record is a dict with ``prompt`` or ``messages`` and optional ``temperature``, ``top_p``,
``seed``, ``max_new_tokens``, ``stop`` and ``chat``; what it leaves out comes from the job's
:class:`BatchJob` settings. :class:`RowDecoder` loads the target once and decodes records
with the batched engine, yielding each result line as its row finishes. The local
``speculative generate --prompts`` job and every Ray worker (:mod:`speculative.scaleout`)
run this same code, so a row's output does not depend on where it ran.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from speculative.engine.gamma import LOAD_AWARE_MAX_GAMMA
from speculative.engine.loop import GenerationResult

Record = dict[str, Any]
ResultLine = dict[str, Any]


@dataclass(frozen=True)
class BatchJob:
    """A batched job's settings: the model, the drafter and every row's defaults."""

    target: str = "default"
    runtime: str = "auto"
    precision: str = "auto"
    kv_cache: str = "auto"  # the native runtime's KV cache (see load_target)
    max_context: int | None = None  # the context window (None: the model's own)
    draft: str | None = "ngram"
    gamma: int | str = "auto"  # every row's γ chosen for the load each round, or fixed
    chat: bool | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int = 128
    seed: int = 0
    stop: tuple[str, ...] = ()
    batch_size: int = 8
    logprobs: int | None = None  # each token's log-probability and this many alternatives'
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    output_format: Any = None  # what the output must be (a structured.OutputFormat; None: text)
    presence_penalty: float = 0.0  # the target's logits penalized (sampling.penalties)
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


def openai_batch_line(
    custom_id: str, status_code: int, body: dict[str, Any], error: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One line of an OpenAI Batch API output (or error) file: a request's answer ``body``
    (or error body) with its HTTP status, and ``error`` where it failed."""
    response = {"status_code": status_code, "request_id": uuid.uuid4().hex, "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": response, "error": error}  # fmt: skip


FORMAT_KEYS = ("json_schema", "regex", "choice", "grammar")  # a record's output format


def record_output_format(record: Record) -> Any:
    """A record's own output format (its ``json_schema``, ``regex``, ``choice`` or
    ``grammar``: at most one), or None; ValueError for two of them."""
    from speculative.structured import OutputFormat

    return OutputFormat.given(*(record.get(key) for key in FORMAT_KEYS))


class RowDecoder:
    """A loaded target and its batched engine, decoding prompt records into result lines."""

    def __init__(self, job: BatchJob, loaded: Any = None) -> None:
        """``loaded``: an already loaded target (a :class:`LoadedModel`) instead of the
        job's target, runtime and precision."""
        from speculative.engine.batch import BatchEngine
        from speculative.engine.gamma import parse_gamma
        from speculative.models.base import SupportsBatchRows
        from speculative.targets import load_target_of

        self.job = job
        self.gamma = parse_gamma(job.gamma)
        self.loaded = loaded or load_target_of(job)
        if not isinstance(self.loaded.lm, SupportsBatchRows):
            raise ValueError(
                "batched generation (--prompts) needs a runtime with cache slots (native or hf)"
            )
        self.engine = BatchEngine(self.loaded.lm, max_batch=job.batch_size, load=self._load())

    def _load(self) -> Any:
        """--gamma auto: per-row γ for the load, from the measured pass-cost curves (none
        measured for a job without a drafter)."""
        if self.gamma != "auto" or self.job.draft in (None, "none"):
            return None
        from speculative.engine.costs import pass_cost_curves, probe_context
        from speculative.engine.gamma import LOAD_AWARE_MAX_GAMMA, LoadAwareGamma

        lm, rows = self.loaded.lm, self.job.batch_size
        context = probe_context(lm.vocab_size)
        costs = pass_cost_curves(lm, context, rows, rows * (LOAD_AWARE_MAX_GAMMA + 1), 2)
        return LoadAwareGamma(costs.tokens, rows_cost=costs.rows)

    def request(self, record: Record) -> Any:
        """The engine's :class:`BatchRequest` for one record (record values over the job's)."""
        from speculative.drafters.registry import build_drafter
        from speculative.engine.batch import BatchRequest
        from speculative.engine.gamma import make_gamma_policy
        from speculative.sampling import SamplingParams
        from speculative.targets import encode_prompt

        job, loaded = self.job, self.loaded
        chat = record.get("chat", job.chat)
        ids = encode_prompt(loaded.tokenizer, record.get("prompt"), record.get("messages"), chat)
        stop = tuple(record.get("stop", job.stop))
        params = SamplingParams(
            temperature=float(record.get("temperature", job.temperature)),
            top_k=int(record.get("top_k", job.top_k)),
            top_p=float(record.get("top_p", job.top_p)),
            min_p=float(record.get("min_p", job.min_p)),
        )
        criteria = loaded.stop_criteria(int(record.get("max_new_tokens", job.max_new_tokens)), stop)
        generator = torch.Generator().manual_seed(int(record.get("seed", job.seed)))
        drafter = build_drafter(job.draft, loaded)
        row_gamma = LOAD_AWARE_MAX_GAMMA if self.gamma == "auto" else make_gamma_policy(self.gamma)
        from speculative.sampling.penalties import Penalties

        penalties = Penalties(
            float(record.get("presence_penalty", job.presence_penalty)),
            float(record.get("frequency_penalty", job.frequency_penalty)),
            float(record.get("repetition_penalty", job.repetition_penalty)),
        )
        constraint = None
        output = record_output_format(record) or job.output_format
        if output is not None:
            from speculative.structured import constraints_for

            constraint = constraints_for(loaded, output)()
        return BatchRequest(
            ids, params, criteria, generator, drafter, row_gamma, logprobs=job.logprobs,
            penalties=penalties, prompt_logprobs=job.prompt_logprobs, constraint=constraint,
        )  # fmt: skip

    def result_line(
        self, index: int, record: Record, result: GenerationResult, prompt_tokens: int
    ) -> ResultLine:
        """The output line of a finished row (text cut at its stop string)."""
        stop = tuple(record.get("stop", self.job.stop))
        text = self.loaded.stop_criteria(1, stop).final_text(self.loaded.decode(result.token_ids))
        line: ResultLine = {
            "index": index,
            "text": text,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "prompt_tokens": prompt_tokens,
            "stats": result.stats.to_dict(),
        }
        if result.logprobs is not None:
            line["logprobs"] = [entry.to_dict() for entry in result.logprobs]
        if result.prompt_logprobs is not None:
            line["prompt_logprobs"] = [entry.to_dict() for entry in result.prompt_logprobs]
        return line

    def run(self, items: Iterable[tuple[int, Record]]) -> Iterator[ResultLine]:
        """Decode ``(index, record)`` pairs, at most ``batch_size`` at once (rows join as
        others finish); yields each row's line as soon as it finishes."""
        engine, queue = self.engine, list(items)
        queue.reverse()  # pop() from the end takes the rows in their given order
        record_of: dict[int, tuple[int, Record, int]] = {}
        while queue or engine.rows:
            while queue and len(engine.rows) < engine.max_batch:
                index, record = queue.pop()
                request = self.request(record)
                record_of[engine.add(request)] = (index, record, len(request.prompt_ids))
            engine.draining = not queue  # the job's last rows: its end is theirs
            engine.step()
            for row_id in [r for r in engine.finished if r in record_of]:
                index, record, prompt_tokens = record_of.pop(row_id)
                result = engine.finished.pop(row_id)
                yield self.result_line(index, record, result, prompt_tokens)
