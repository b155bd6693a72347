"""`speculative generate --prompts FILE.jsonl --batch-size B --out results.jsonl [--ray]`.

Decodes a file of prompts with the batched engine: one JSON object a line with
``prompt`` or ``messages`` and optional ``temperature``, ``top_p``, ``seed``,
``max_new_tokens`` and ``stop`` (the command-line values are the defaults), or a file of
OpenAI batch requests (:mod:`speculative.cli.openai_batch`). Writes one line per prompt
to ``--out`` in input order (``index``, ``text``, ``token_ids``, ``finish_reason``,
``prompt_tokens``, ``stats``; or OpenAI's batch output lines); lines already there are
skipped, so a crashed run resumes.
``--gamma auto`` (the default here) chooses every row's γ for the load
(:class:`LoadAwareGamma`, from the pass-cost curves, one row's tokens and rows of one
token, measured at start).
``--ray [ADDRESS] --workers N`` spreads the rows over N Ray actors
(:mod:`speculative.scaleout.ray_batch`), each running the same
:class:`~speculative.batch_jobs.RowDecoder` as the local job.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from speculative.batch_jobs import BatchJob, Record, ResultLine
from speculative.cli.common import CliError, emit_json
from speculative.cli.openai_batch import batch_output, is_batch_request, prompts_record


@dataclass
class PromptsFile:
    """A prompts file's records; for a file of OpenAI batch requests, the requests too
    (each row is then written as OpenAI's batch output line)."""

    records: list[Record]
    requests: list[dict[str, Any]] | None = None

    def shape(self, model: str) -> Callable[[ResultLine], dict[str, Any]]:
        """What a result line is written as."""
        if self.requests is None:
            return lambda line: line
        requests = self.requests
        return lambda line: batch_output(line, requests[line["index"]], model)

    def index_of(self, written: dict[str, Any]) -> int:
        """The row a line already in ``--out`` is (KeyError: none)."""
        if self.requests is None:
            return int(written["index"])
        return self._by_custom_id[written["custom_id"]]

    @functools.cached_property
    def _by_custom_id(self) -> dict[str, int]:
        return {request["custom_id"]: i for i, request in enumerate(self.requests or [])}


def read_records(path: Path) -> PromptsFile:
    """The prompt records of a JSONL file (blank lines skipped): prompts records, or
    OpenAI batch requests (every line then)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise CliError(f"cannot read --prompts {path}: {exc.strerror}") from None
    records, requests = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CliError(f"{where}: not JSON ({exc.msg})") from None
        batch = is_batch_request(record)
        if records and batch != bool(requests):
            raise CliError(f"{where}: OpenAI batch requests and prompts records are mixed")
        if batch:
            requests.append(record)
            record = prompts_record(record, where)
        elif not isinstance(record, dict) or not ("prompt" in record or "messages" in record):
            raise CliError(f"{where}: expected an object with 'prompt' or 'messages'")
        records.append(record)
    ids = [request["custom_id"] for request in requests]
    if len(set(ids)) < len(ids):
        raise CliError(f"{path}: custom_id repeats (each request's must be its own)")
    return PromptsFile(records, requests or None)


def done_indices(out: Path, prompts: PromptsFile) -> set[int]:
    """Indices of the rows a previous run already wrote to ``out``; a line a crash cut
    short is dropped from the file (that row runs again)."""
    if not out.is_file():
        return set()
    kept, done = [], set()
    for line in out.read_text().splitlines():
        try:
            index = prompts.index_of(json.loads(line))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
        kept.append(line)
        done.add(index)
    out.write_text("".join(line + "\n" for line in kept))
    return done


def job_from_args(args: argparse.Namespace) -> BatchJob:
    from speculative.cli.generate_cmd import gamma_text, output_format_of
    from speculative.engine.gamma import parse_gamma

    return BatchJob(
        target=args.target,
        runtime=args.runtime,
        precision=args.precision,
        kv_cache=args.kv_cache,
        max_context=args.max_context,
        draft=args.draft,
        gamma=parse_gamma(gamma_text(args)),
        chat=args.chat,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        stop=tuple(args.stop),
        batch_size=args.batch_size,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
        output_format=output_format_of(args),
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
    )


@dataclass
class OrderedWriter:
    """Writes result lines to ``out`` in input order as they arrive in any order; the
    indices in ``done`` are already in the file and are passed over."""

    out: TextIO
    done: set[int]
    bar: Any  # tqdm progress bar, one tick a row
    shape: Callable[[ResultLine], dict[str, Any]] = field(default=lambda line: line)
    written: int = 0  # every index below this one is in the file
    new_tokens: int = 0

    def __post_init__(self) -> None:
        self.pending: dict[int, ResultLine | None] = dict.fromkeys(self.done)
        self._flush()

    def add(self, line: ResultLine) -> None:
        self.pending[int(line["index"])] = line
        self.new_tokens += len(line["token_ids"])
        self.bar.update(1)
        self._flush()

    def _flush(self) -> None:
        while self.written in self.pending:  # the rows that are next in input order
            line = self.pending.pop(self.written)
            if line is not None:
                self.out.write(json.dumps(self.shape(line)) + "\n")
                self.out.flush()
            self.written += 1


def write_in_order(
    out: Path,
    total: int,
    done: set[int],
    lines: Iterable[ResultLine],
    shape: Callable[[ResultLine], dict[str, Any]] = lambda line: line,
) -> tuple[int, float]:
    """Append ``lines`` to ``out`` in input order (each as ``shape`` makes it) with a
    progress bar; returns the new tokens and the seconds from the first line asked for to
    the last one written."""
    with (
        out.open("a") as file,
        tqdm(total=total, initial=len(done), desc="rows", unit="row", disable=None) as bar,
    ):
        writer = OrderedWriter(file, done, bar, shape)
        started = time.perf_counter()
        for line in lines:
            writer.add(line)
        seconds = time.perf_counter() - started
    return writer.new_tokens, seconds


def run_batch(args: argparse.Namespace) -> int:
    if args.out is None:
        raise CliError("--prompts needs --out FILE.jsonl")
    if args.ray is None and (args.workers != 1 or args.worker_cpus != 1):
        raise CliError("--workers and --worker-cpus need --ray")
    prompts = read_records(args.prompts)
    records, shape = prompts.records, prompts.shape(args.target)
    job = job_from_args(args)
    done = done_indices(args.out, prompts)
    todo = [i for i in range(len(records)) if i not in done]
    items = [(i, records[i]) for i in todo]
    summary: dict[str, Any] = {"rows": len(todo)}
    if not items:  # every row is in --out already: nothing to load
        new_tokens, seconds = 0, 0.0
    elif args.ray is None:
        from speculative.batch_jobs import RowDecoder

        lines = RowDecoder(job).run(items)  # loads the target before the clock starts
        new_tokens, seconds = write_in_order(args.out, len(records), done, lines, shape)
    else:
        from speculative.scaleout.ray_batch import RayJobError, ray_rows

        try:
            with ray_rows(job, items, args.workers, args.ray or None, args.worker_cpus) as lines:
                new_tokens, seconds = write_in_order(args.out, len(records), done, lines, shape)
        except RayJobError as exc:
            raise CliError(str(exc)) from None
    if args.ray is not None:
        summary["workers"] = args.workers
    if args.json:
        summary["new_tokens"] = new_tokens
        summary["seconds"] = seconds
        summary["tokens_per_second"] = new_tokens / seconds if seconds > 0 else 0.0
        emit_json(summary)
    return 0
