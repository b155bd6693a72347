"""`speculative train-draft`: train an EAGLE or Medusa drafting head for a target."""

from __future__ import annotations

import argparse
from pathlib import Path

from speculative.cli.common import (
    Formatter,
    add_json_flag,
    emit_json,
    non_negative_float,
    positive_int,
    probability,
)
from speculative.training.precision import CHOICES as PRECISION_CHOICES
from speculative.training.trainer import LOSS_ROWS

DESCRIPTION = """\
Train a drafting head on the target's own features and distributions.

  eagle   one decoder layer over [token embedding, target feature] predicting the next
          feature and token (trained through --unroll draft steps, as drafting runs it);
          by default the target feature fuses a low, a middle and a high layer's states
          as EAGLE-3 does (--feature-layers)
  medusa  K residual heads on the last feature, head k predicting k tokens further

Both reuse the target's frozen embedding and output head, restricted to a draft
vocabulary of the --draft-vocab most frequent target tokens of the data (a map back to
target ids is stored, never the rows). Data: text files or JSONL ({"messages": [...]},
{"prompt", "response"} or {"text"}), chat-templated like the drafter will meet them;
--self-distill N first has the target answer N generated chat prompts (its own answers
are what the head meets at inference). The target's features come from teacher-forced
forwards, cached in OUT/features in chunks; a held-out split (or --eval-data) gives the
acceptance at the end. OUT then holds head.safetensors + config.json (naming the target), usable as
--draft eagle:OUT or medusa:OUT.

examples:
  speculative train-draft --method eagle --data data/draft/*.jsonl --out heads/eagle
  # fine-tune the shipped head on your own text (scored before and after):
  speculative train-draft --init shipped --precision int4 --data mine.jsonl \
      --eval-data held.jsonl --epochs 1 --lr 5e-4 --out heads/mine
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train-draft",
        help="train an EAGLE or Medusa drafting head for a target",
        description=DESCRIPTION,
        formatter_class=Formatter,
    )
    parser.add_argument("--method", choices=("eagle", "medusa"), default="eagle")
    parser.add_argument("--target", default="default", help="target model (name, folder, .gguf)")
    parser.add_argument(
        "--runtime",
        choices=("native", "hf"),
        default="native",
        help="runtime giving the target's features",
    )
    parser.add_argument("--precision", default="fp32", help="target precision for the features")
    parser.add_argument(
        "--data",
        type=Path,
        nargs="*",
        default=[],
        metavar="FILE",
        help="training text (.txt) or JSONL files",
    )
    parser.add_argument(
        "--eval-data",
        type=Path,
        nargs="*",
        default=[],
        metavar="FILE",
        help="held-out text or JSONL for the acceptance report, instead of a split of "
        "--data (give text unlike the training prompts: a split of templated prompts "
        "overstates what fresh prompts get)",
    )
    parser.add_argument(
        "--self-distill",
        type=int,
        default=0,
        metavar="N",
        help="first let the target answer N generated chat prompts",
    )
    parser.add_argument(
        "--draft-vocab",
        type=positive_int,
        default=None,
        metavar="N",
        help="draft vocabulary size, the N most frequent target tokens of the data "
        "(default: 8192; with --init, the initial head's)",
    )
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps (0: from --epochs)")
    parser.add_argument("--epochs", type=non_negative_float, default=2.0)
    parser.add_argument("--batch-tokens", type=positive_int, default=2048)
    parser.add_argument("--lr", type=non_negative_float, default=1e-3)
    parser.add_argument(
        "--unroll", type=positive_int, default=3, help="eagle: draft steps trained through"
    )
    parser.add_argument(
        "--loss-fraction",
        type=probability,
        default=0.5,
        help="share of positions whose distributions enter the loss (the output-head "
        "matmuls dominate training time)",
    )
    parser.add_argument(
        "--loss-rows",
        choices=LOSS_ROWS,
        default="independent",
        help="eagle: how the unrolled draft steps draw the rows their loss scores "
        "(independent, the default and the shipped head's recipe: each step its own; "
        "shared: one draw for every step, so later steps compute no rows of their own: "
        "1.13-1.17x a training step at --loss-fraction 0.4 and --unroll 3, the same "
        "held-out scores on one measured epoch; an unbiased loss either way)",
    )
    parser.add_argument(
        "--matmul-precision",
        choices=PRECISION_CHOICES,
        default="auto",
        help="precision of the head's matmuls while training (auto, the default: bf16 "
        "autocast where the CPU has native bf16 dot products, AVX512-BF16 or AMX, which "
        "trains 1.6-1.8x faster there; fp32 elsewhere, where bf16 is emulated and slower). "
        "Parameters, gradients and the target's soft labels stay float32; drafting is "
        "unaffected",
    )
    parser.add_argument(
        "--feature-layers",
        default=None,
        metavar="auto|none|L,L,...",
        help="eagle: the target's middle layers whose states the head fuses with its "
        "features, as EAGLE-3 does (auto, the default: layers 2, L/2 and L-3 of L; none: "
        "the last layer's feature alone, as EAGLE-1/2; or 0-based indices, e.g. 2,15,27; "
        "with --init, the initial head's)",
    )
    parser.add_argument(
        "--init",
        metavar="shipped|DIR",
        help="fine-tune: start from a trained head (a train-draft folder, or 'shipped' for "
        "the head shipped for the target) instead of a fresh one; its shape, draft "
        "vocabulary and feature layers are kept, and the report scores it on the same "
        "held-out text before and after (a lower --lr than a fresh head's suits it)",
    )
    parser.add_argument("--medusa-heads", type=positive_int, default=4)
    parser.add_argument(
        "--max-tokens", type=positive_int, default=512, help="tokens per training sequence"
    )
    parser.add_argument(
        "--held-out",
        type=probability,
        default=0.05,
        help="fraction of records held out for the acceptance report",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="reuse OUT's cached features and continue from its checkpoint (a Medusa "
        "head, or --feature-layers none, can reuse an EAGLE head's cache of any layers)",
    )
    add_json_flag(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from speculative.training.train_draft import TrainDraftOptions, train_draft

    options = TrainDraftOptions(
        out=args.out,
        method=args.method,
        target=args.target,
        runtime=args.runtime,
        precision=args.precision,
        data=list(args.data),
        eval_data=list(args.eval_data),
        self_distill=args.self_distill,
        draft_vocab=args.draft_vocab,
        steps=args.steps,
        epochs=args.epochs,
        max_tokens=args.max_tokens,
        held_out=args.held_out,
        medusa_heads=args.medusa_heads,
        feature_layers=args.feature_layers,
        unroll=args.unroll,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        seed=args.seed,
        resume=args.resume,
        threads=args.threads,
        progress=True,
        loss_fraction=args.loss_fraction,
        loss_rows=args.loss_rows,
        matmul_precision=args.matmul_precision,
        init=args.init,
    )
    report = train_draft(options)
    top1 = ", ".join(f"{x:.2f}" for x in report["heldout_top1"])
    print(
        f"{report['method']} head for {report['target']} -> {report['out']}\n"
        f"data: {report['records']} records, {report['train_tokens']} train / "
        f"{report['heldout_tokens']} held-out tokens, draft vocab {report['draft_vocab']}, "
        f"feature layers {', '.join(map(str, report['feature_layers'])) or 'none'}\n"
        f"time: features {report['extract_seconds']}s, training {report['train_seconds']}s "
        f"({report['steps']} steps, {report['matmul_precision']} matmuls)\n"
        f"held-out ({report['heldout_source']}) top-1 per draft step: {top1}\n"
        f"greedy chain of {report['heldout_drafted']}: {report['heldout_accepted']:.2f} "
        f"accepted on average, acceptance rate {report['heldout_acceptance_rate']:.2f} "
        "(accepted / drafted, as the bench reports it)"
    )
    if "init" in report:
        before = ", ".join(f"{x:.2f}" for x in report["init_heldout_top1"])
        print(
            f"fine-tuned from {report['init']}: held-out top-1 per draft step before: "
            f"{before}; greedy chain of {report['heldout_drafted']}: "
            f"{report['init_heldout_accepted']:.2f} accepted before, "
            f"{report['heldout_accepted']:.2f} after"
        )
    if args.json:
        emit_json(report)
    return 0
