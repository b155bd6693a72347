"""Build a local training corpus for a drafting head (nothing is downloaded but Debian docs).

    apt-get update && apt-get install -y python3.11-doc     # Python's documentation sources
    PYTHONPATH=src .venv/bin/python scripts/prepare_draft_data.py --out data/draft \
        --self-distill 600

Writes into --out:
  docs.jsonl         chat-templated records: Python documentation passages as answers
                     ("Explain ..." -> a doc passage) and stdlib code
  prompts.jsonl      the self-distillation prompts (never the benchmark's prompts)
  selfdistill-I.jsonl the target's own answers to them (appended as they come: a partial
                     run is usable; rerun with --skip to continue)
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
        help="prompts the target answers (slow: ~50 tokens/s)",
    )
    parser.add_argument(
        "--eval",
        type=int,
        default=0,
        metavar="N",
        help="answers to N prompts on held-out topics, written to eval.jsonl",
    )
    parser.add_argument("--skip", type=int, default=0, help="skip the first N prompts")
    parser.add_argument(
        "--shard",
        default="0/1",
        metavar="I/N",
        help="answer only prompts i, i+N, i+2N, ... (parallel processes)",
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    from speculative.training.prompts import build_prompts, code_snippets, passages

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
    prompts = build_prompts(args.self_distill, args.seed, passages(docs), code)
    with (args.out / "prompts.jsonl").open("w", encoding="utf-8") as handle:
        for messages in prompts:
            handle.write(json.dumps({"messages": messages}) + "\n")
    from speculative.pipeline import Speculator, build_drafter, load_target
    from speculative.training.prompts import eval_prompts
    from speculative.training.selfdistill import answer_prompts, write_transcripts

    target = load_target(args.target, runtime="native", precision="fp32")
    speculator = Speculator(target, build_drafter("ngram", target), gamma=4)
    index, count = (int(x) for x in args.shard.split("/"))
    if args.eval > 0 and index == 0:  # one shard writes it
        path = args.out / "eval.jsonl"
        path.unlink(missing_ok=True)
        tokens = write_transcripts(
            path, answer_prompts(speculator, eval_prompts(args.eval), args.max_new_tokens)
        )
        print(f"eval.jsonl: {args.eval} answers, {tokens} tokens")
    if args.self_distill <= 0:
        return 0
    todo = prompts[args.skip :][index::count]
    tokens = write_transcripts(
        args.out / f"selfdistill-{index}.jsonl",
        answer_prompts(speculator, todo, args.max_new_tokens, args.seed + args.skip),
    )
    print(f"selfdistill.jsonl: {len(todo)} answers, {tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
