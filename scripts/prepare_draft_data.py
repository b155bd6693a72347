"""Build a local training corpus for a drafting head (nothing is downloaded but Debian docs).

    apt-get update && apt-get install -y python3.11-doc     # Python's documentation sources
    PYTHONPATH=src .venv/bin/python scripts/prepare_draft_data.py --out data/draft \
        --self-distill 600
    # more answers for a fine-tune (train-draft --init): a new seed, no prompt drawn before
    PYTHONPATH=src .venv/bin/python scripts/prepare_draft_data.py --out data/draft-s4 \
        --docs 0 --self-distill 4000 --seed 4 --exclude data/draft*/selfdistill.jsonl

Writes into --out:
  docs.jsonl         chat-templated records: Python documentation passages as answers
                     ("Explain ..." -> a doc passage) and stdlib code
  prompts.jsonl      the self-distillation prompts (never the benchmark's prompts)
  selfdistill.jsonl  the target's own answers to them, first turns and --follow-ups second
                     turns, decoded by the batched engine at the target's own precision
                     (appended as rows finish: a partial run is usable, a rerun continues)
  eval.jsonl         with --eval N: the target's answers to N open-ended prompts on topics
                     no training prompt names (train-draft --eval-data: the acceptance
                     chat-like text gets, not a split of the easier templated records)
The corpus is never committed; train-draft reads these files (--data).
"""

from __future__ import annotations

import argparse
import glob
import json
import random
import sys
from pathlib import Path

DOC_SOURCES = "/usr/share/doc/python3.11/html/_sources"
PY_SOURCES = "/usr/lib/python3.11"


def read_texts(pattern: str, limit: int) -> list[str]:
    texts = []
    for name in sorted(glob.glob(pattern, recursive=True))[:limit]:
        try:
            texts.append(Path(name).read_text("utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    return texts


def doc_records(docs: list[str], code: list[str], seed: int) -> list[dict]:
    """Documentation passages and stdlib functions framed as chat answers."""
    from speculative.training.prompts import passages

    rng = random.Random(seed)
    records = []
    for passage in passages(docs, 200, 1500):
        first = passage.split(". ")[0][:80]
        question = rng.choice(("Explain this: ", "Tell me about ", "What does this mean: "))
        records.append(
            {
                "messages": [
                    {"role": "user", "content": question + first},
                    {"role": "assistant", "content": passage},
                ]
            }
        )
    for snippet in code:
        name = snippet.split("(")[0].removeprefix("def ")
        records.append(
            {
                "messages": [
                    {"role": "user", "content": f"Write a Python function named {name}."},
                    {"role": "assistant", "content": f"```python\n{snippet}\n```"},
                ]
            }
        )
    rng.shuffle(records)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--self-distill",
        type=int,
        default=0,
        metavar="N",
        help="prompts the target answers (batched: ~500 answer tokens/s at int4 on 2 cores)",
    )
    parser.add_argument(
        "--follow-ups",
        type=float,
        default=0.25,
        metavar="F",
        help="share of answered prompts that get a second user turn, answered too",
    )
    parser.add_argument(
        "--eval",
        type=int,
        default=0,
        metavar="N",
        help="answers to N prompts on held-out topics, written to eval.jsonl",
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--docs",
        type=int,
        default=1200,
        metavar="N",
        help="documentation / code records written to docs.jsonl",
    )
    parser.add_argument("--target", default="default")
    parser.add_argument(
        "--precision",
        default="auto",
        help="target precision answering (default: the model's own, what decoding runs)",
    )
    parser.add_argument(
        "--exclude",
        type=Path,
        nargs="*",
        default=[],
        metavar="FILE",
        help="JSONL prompts or transcripts of earlier runs (their prompts.jsonl or "
        "selfdistill.jsonl): prompts whose first user turn they hold are not drawn again, "
        "so every answer is new text (files in --out itself are ignored: a rerun continues)",
    )
    parser.add_argument("--batch-size", type=int, default=16, help="rows decoded together")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    args = parser.parse_args(argv)

    import torch

    from speculative.training.prompts import build_prompts, code_snippets, passages

    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    docs = read_texts(f"{DOC_SOURCES}/**/*.txt", 2000)
    sources = read_texts(f"{PY_SOURCES}/*.py", 400)
    if not docs:
        print(
            f"warning: no docs under {DOC_SOURCES} (apt-get install python3.11-doc)",
            file=sys.stderr,
        )
    code = code_snippets(sources)
    records = doc_records(docs, code, args.seed)[: args.docs]
    with (args.out / "docs.jsonl").open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    print(f"docs.jsonl: {len(records)} records")
    if args.self_distill <= 0 and args.eval <= 0:
        return 0
    from speculative.training.selfdistill import first_turns

    missing = [str(path) for path in args.exclude if not path.is_file()]
    if missing:
        parser.error(f"--exclude: no such file: {', '.join(missing)}")
    # the --out folder's own files are not earlier runs: a rerun continues its own prompts
    earlier = [path for path in args.exclude if path.resolve().parent != args.out.resolve()]
    drawn = first_turns(earlier)
    prompts = build_prompts(args.self_distill, args.seed, passages(docs), code, exclude=drawn)
    if drawn:
        print(f"prompts.jsonl: {len(prompts)} prompts, none of the {len(drawn)} in --exclude")
    with (args.out / "prompts.jsonl").open("w", encoding="utf-8") as handle:
        for messages in prompts:
            handle.write(json.dumps({"messages": messages}) + "\n")
    from speculative.batch_jobs import BatchJob, RowDecoder

    decoder = RowDecoder(
        BatchJob(
            target=args.target,
            runtime="native",
            precision=args.precision,
            draft=None,
            batch_size=args.batch_size,
        )
    )
    if args.eval > 0:
        from speculative.training.prompts import eval_prompts

        tokens = answer_into(args.out / "eval.jsonl", decoder, eval_prompts(args.eval), args)
        print(f"eval.jsonl: {args.eval} prompts, {tokens} new answer tokens")
    if args.self_distill <= 0:
        return 0
    path = args.out / "selfdistill.jsonl"
    tokens = answer_into(path, decoder, prompts, args)
    print(f"selfdistill.jsonl: {len(prompts)} first turns, {tokens} new answer tokens")
    tokens = answer_into(path, decoder, second_turns(path, prompts, args), args, offset=1)
    print(f"selfdistill.jsonl: second turns, {tokens} new answer tokens")
    return 0


def answer_into(
    path: Path, decoder: object, prompts: list, args: argparse.Namespace, offset: int = 0
) -> int:
    """Answer the prompts ``path`` does not answer yet, appending transcripts as rows
    finish (an interrupted run continues where it stopped)."""
    from speculative.training.selfdistill import answer_prompts, unanswered, write_transcripts

    todo = unanswered(path, prompts)
    seed = args.seed + 1_000_000 * offset
    return write_transcripts(path, answer_prompts(decoder, todo, args.max_new_tokens, seed))


def second_turns(path: Path, prompts: list, args: argparse.Namespace) -> list:
    """Follow-up turns for the first --follow-ups share of the answered first turns."""
    from speculative.training.prompts import follow_ups
    from speculative.training.selfdistill import prompt_key, read_transcripts

    first = {prompt_key(messages) for messages in prompts}
    answers = {}
    for messages in read_transcripts(path):
        if prompt_key(messages[:-1]) in first:
            answers[prompt_key(messages[:-1])] = messages
    chosen = [answers[prompt_key(m)] for m in prompts if prompt_key(m) in answers]
    return follow_ups(chosen[: int(len(chosen) * args.follow_ups)], args.seed)


if __name__ == "__main__":
    sys.exit(main())
