"""`speculative build-corpus`: a corpus of the target's own answers for corpus lookup."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from speculative.cli.common import Formatter, add_json_flag, emit_json

DESCRIPTION = """\
Build a drafting corpus for `--draft corpus:OUT` (and for `auto`, which looks up the
corpus shipped for its target): the token ids of every assistant turn in the given
transcripts, indexed at load time for longest-suffix lookup. The best text is the
target's own answers to prompts like the ones it will serve: a small model repeats its
phrasing across answers, and the corpus drafts exactly those repeats.

Data: JSONL ({"messages": [...]}, {"prompt", "response"}, {"text"} or {"ids"}) or text
files. Chat transcripts contribute their assistant turns only (each after the assistant
header the chat template adds), text and ids records their whole tokens; a document
that occurs twice is kept once.

The shipped corpus of the default model came from the target's answers written by
scripts/prepare_draft_data.py (see the README, "Corpus lookup").

example:
  speculative build-corpus --data data/draft/selfdistill.jsonl --out corpora/mine
  speculative generate --draft corpus:corpora/mine "Write a haiku about rain."
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "build-corpus",
        help="build a corpus of the target's answers for corpus-lookup drafting",
        description=DESCRIPTION,
        formatter_class=Formatter,
    )
    parser.add_argument("--target", default="default", help="target model (name, folder, .gguf)")
    parser.add_argument(
        "--data", type=Path, nargs="+", required=True, metavar="FILE", help="JSONL or text files"
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    add_json_flag(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from speculative.corpora.build import distinct, record_documents
    from speculative.corpora.store import join_documents, save_corpus, tokenizer_fingerprint
    from speculative.drafters.corpus import SuffixIndex
    from speculative.targets import load_target
    from speculative.training.data import read_records

    started = time.perf_counter()
    target = load_target(args.target)  # its tokenizer and name
    records = list(read_records(args.data))
    if not records:
        raise ValueError("the data holds no records")
    documents = distinct(
        record_documents(target.tokenizer, tqdm(records, desc="tokenize", unit="record"))
    )
    if not documents:
        raise ValueError("the data holds no assistant turns or text to draft from")
    tokens = join_documents(documents)
    fingerprint = tokenizer_fingerprint(target.tokenizer, target.lm.vocab_size)
    source = ", ".join(p.name for p in args.data)
    save_corpus(args.out, tokens, fingerprint, target.name, source)
    index_started = time.perf_counter()
    SuffixIndex(tokens)  # what loading it costs
    report = {
        "out": str(args.out),
        "target": target.name,
        "records": len(records),
        "documents": len(documents),
        "tokens": len(tokens),
        "bytes": sum(f.stat().st_size for f in Path(args.out).iterdir()),
        "index_seconds": round(time.perf_counter() - index_started, 3),
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(
        f"corpus for {target.name} -> {args.out}: {report['documents']} documents, "
        f"{report['tokens']} tokens, {report['bytes'] / 1e6:.1f} MB; "
        f"indexing it takes {report['index_seconds']} s at load"
    )
    if args.json:
        emit_json(report)
    return 0
