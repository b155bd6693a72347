"""`speculative generate --prompts FILE.jsonl --batch-size B --out results.jsonl`.

Decodes a file of prompts with the batched engine: one JSON object a line with
``prompt`` or ``messages`` and optional ``temperature``, ``top_p``, ``seed``,
``max_new_tokens`` and ``stop`` (the command-line values are the defaults). Writes one
line per prompt to ``--out`` in input order (``index``, ``text``, ``token_ids``,
``finish_reason``, ``stats``); lines already there are skipped, so a crashed run resumes.
``--gamma auto`` chooses every row's γ for the load (:class:`LoadAwareGamma`, from a
verify-cost curve measured at start).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from speculative.cli.common import CliError, emit_json

AUTO_MAX_GAMMA = 8  # --gamma auto: a row's cap; the load-aware policy picks up to it


def read_records(path: Path) -> list[dict[str, Any]]:
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


def run_batch(args: argparse.Namespace) -> int:
    from speculative.engine import StopCriteria
    from speculative.engine.batch import BatchEngine, BatchRequest
    from speculative.models.base import SupportsBatchRows
    from speculative.pipeline import (
        build_drafter,
        encode_prompt,
        load_target,
        make_gamma_policy,
        parse_gamma,
    )
    from speculative.sampling import SamplingParams

    if args.out is None:
        raise CliError("--prompts needs --out FILE.jsonl")
    records = read_records(args.prompts)
    gamma = parse_gamma(args.gamma)
    loaded = load_target(args.target, args.runtime, args.precision)
    if not isinstance(loaded.lm, SupportsBatchRows):
        raise CliError("batched generation (--prompts) needs the native runtime")
    done = done_indices(args.out)

    def request(record: dict[str, Any]) -> BatchRequest:
        messages = record.get("messages")
        ids = encode_prompt(loaded.tokenizer, record.get("prompt"), messages, args.chat)
        stop = tuple(record.get("stop", args.stop))
        params = SamplingParams(
            temperature=float(record.get("temperature", args.temperature)),
            top_k=args.top_k,
            top_p=float(record.get("top_p", args.top_p)),
        )
        criteria = StopCriteria(
            max_new_tokens=int(record.get("max_new_tokens", args.max_new_tokens)),
            eos_token_ids=loaded.eos_token_ids,
            stop_strings=stop,
            decode=decode if stop else None,
        )
        generator = torch.Generator().manual_seed(int(record.get("seed", args.seed)))
        drafter = build_drafter(args.draft, loaded)
        row_gamma = AUTO_MAX_GAMMA if gamma == "auto" else make_gamma_policy(gamma)
        return BatchRequest(ids, params, criteria, generator, drafter, row_gamma)

    def decode(token_ids: list[int]) -> str:
        return loaded.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    load = None
    if gamma == "auto":  # per-row γ for the load, from the measured verify-cost curve
        from speculative.engine.costs import verify_cost_curve
        from speculative.engine.gamma import LoadAwareGamma

        context = [(i * 7919) % loaded.lm.vocab_size for i in range(64)]
        load = LoadAwareGamma(verify_cost_curve(loaded.lm, context, 16, 2).verify_cost)
    engine = BatchEngine(loaded.lm, max_batch=args.batch_size, load=load)
    todo = [i for i in range(len(records)) if i not in done]
    pending, written, ids_of = dict.fromkeys(done), 0, {}
    started, new_tokens = time.perf_counter(), 0
    with args.out.open("a") as out:
        queue = list(todo)
        while queue or engine.rows:
            while queue and len(engine.rows) < args.batch_size:
                index = queue.pop(0)
                ids_of[engine.add(request(records[index]))] = index
            engine.step()
            for row_id in [r for r in engine.finished if r in ids_of]:
                index, result = ids_of.pop(row_id), engine.finished.pop(row_id)
                stop = records[index].get("stop", args.stop)
                text = decode(result.token_ids)
                if stop:
                    text = StopCriteria(1, stop_strings=tuple(stop), decode=decode).final_text(text)
                pending[index] = {
                    "index": index,
                    "text": text,
                    "token_ids": result.token_ids,
                    "finish_reason": result.finish_reason,
                    "stats": result.stats.to_dict(),
                }
                new_tokens += len(result.token_ids)
            while written in pending:  # flush the rows that are next in input order
                line = pending.pop(written)
                if line is not None:
                    out.write(json.dumps(line) + "\n")
                    out.flush()
                written += 1
            finished = len(records) - len(queue) - len(engine.rows) - len(done)
            sys.stderr.write(f"\r[{finished + len(done)}/{len(records)} rows]")
    sys.stderr.write("\n")
    seconds = time.perf_counter() - started
    if args.json:
        summary = {
            "rows": len(todo),
            "new_tokens": new_tokens,
            "seconds": seconds,
            "tokens_per_second": new_tokens / seconds if seconds > 0 else 0.0,
        }
        emit_json(summary)
    return 0
