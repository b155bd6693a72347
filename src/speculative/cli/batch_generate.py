"""`speculative generate --prompts FILE.jsonl --batch-size B --out results.jsonl [--ray]`.

Decodes a file of prompts with the batched engine: one JSON object a line with
``prompt`` or ``messages`` and optional ``temperature``, ``top_p``, ``seed``,
``max_new_tokens`` and ``stop`` (the command-line values are the defaults). Writes one
line per prompt to ``--out`` in input order (``index``, ``text``, ``token_ids``,
``finish_reason``, ``stats``); lines already there are skipped, so a crashed run resumes.
``--gamma auto`` (the default here) chooses every row's γ for the load
(:class:`LoadAwareGamma`, from the pass-cost curves, one row's tokens and rows of one
token, measured at start).
``--ray [ADDRESS] --workers N`` spreads the rows over N Ray actors
(:mod:`speculative.scaleout.ray_batch`), each running the same
:class:`~speculative.batch_jobs.RowDecoder` as the local job.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from speculative.batch_jobs import BatchJob, Record, ResultLine
from speculative.cli.common import CliError, emit_json


def read_records(path: Path) -> list[Record]:
    """The prompt records of a JSONL file (blank lines skipped)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise CliError(f"cannot read --prompts {path}: {exc.strerror}") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CliError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not ("prompt" in record or "messages" in record):
            raise CliError(f"{path}:{number}: expected an object with 'prompt' or 'messages'")
        records.append(record)
    return records


def done_indices(out: Path) -> set[int]:
    """Indices of the rows a previous run already wrote to ``out``; a line a crash cut
    short is dropped from the file (that row runs again)."""
    if not out.is_file():
        return set()
    kept, done = [], set()
    for line in out.read_text().splitlines():
        try:
            index = int(json.loads(line)["index"])
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
                self.out.write(json.dumps(line) + "\n")
                self.out.flush()
            self.written += 1


def write_in_order(
    out: Path, total: int, done: set[int], lines: Iterable[ResultLine]
) -> tuple[int, float]:
    """Append ``lines`` to ``out`` in input order with a progress bar; returns the new
    tokens and the seconds from the first line asked for to the last one written."""
    with (
        out.open("a") as file,
        tqdm(total=total, initial=len(done), desc="rows", unit="row", disable=None) as bar,
    ):
        writer = OrderedWriter(file, done, bar)
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
    records = read_records(args.prompts)
    job = job_from_args(args)
    done = done_indices(args.out)
    todo = [i for i in range(len(records)) if i not in done]
    items = [(i, records[i]) for i in todo]
    summary: dict[str, Any] = {"rows": len(todo)}
    if not items:  # every row is in --out already: nothing to load
        new_tokens, seconds = 0, 0.0
    elif args.ray is None:
        from speculative.batch_jobs import RowDecoder

        lines = RowDecoder(job).run(items)  # loads the target before the clock starts
        new_tokens, seconds = write_in_order(args.out, len(records), done, lines)
    else:
        from speculative.scaleout.ray_batch import RayJobError, ray_rows

        try:
            with ray_rows(job, items, args.workers, args.ray or None, args.worker_cpus) as lines:
                new_tokens, seconds = write_in_order(args.out, len(records), done, lines)
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
