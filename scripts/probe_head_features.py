"""Which features should an EAGLE head read? A side-by-side probe on the same data.

    PYTHONPATH=src .venv/bin/python scripts/prepare_draft_data.py --out data/probe --docs 0 \
        --self-distill 1500 --eval 80 --follow-ups 0
    PYTHONPATH=src .venv/bin/python scripts/probe_head_features.py --data data/probe \
        --variants last fused --layers 3 15
    PYTHONPATH=src .venv/bin/python scripts/probe_head_features.py --data data/probe \
        --variants last --fraction 0.5          # the same head on half the answers

Trains one-layer EAGLE heads (``speculative.heads.modules.EagleHead``) with the same
budget (one epoch, same seed, batch, schedule and loss: the target's distribution over an
8,192-token draft vocabulary through its own output rows, plus 0.2 x smooth-L1 on the
feature, over 3 unrolled draft steps) on the target's own answers (selfdistill.jsonl), and
scores each on the held-out answers to prompts on unseen topics (eval.jsonl, answer
positions only): top-1 agreement with the target's greedy token, per draft step.

Variants:
  last   the head reads the target's final feature (what `train-draft` ships);
  fused  EAGLE-3's input: the residual stream after --layers (low, middle) and the final
         feature, each RMS-normed, fused to one vector by a learned linear map; later draft
         steps read the head's own output in its place.

Features come from transformers at fp32 (``output_hidden_states``) over the default
model's converted weights, cached in --data as features-<layers>.pt (about 2 GB for 330k
tokens). A throwaway measurement, not part of the product: its figures are in
docs/heads-diagnosis.md.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from speculative.heads.modules import EagleHead, HeadConfig, RMSNorm

STEPS = 3  # unrolled draft steps, trained and scored
DRAFT_VOCAB = 8192
MAX_LENGTH = 640


class FusedEagleHead(EagleHead):
    """EagleHead whose target input is ``parts`` features [..., parts * H] fused by fc_g."""

    def __init__(self, config: HeadConfig, parts: int) -> None:
        super().__init__(config)
        h = config.hidden_size
        self.parts = parts
        self.part_norms = nn.ModuleList(RMSNorm(h, config.rms_norm_eps) for _ in range(parts))
        self.fc_g = nn.Linear(parts * h, h, bias=False)

    def fuse(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        h = self.config.hidden_size
        if features.shape[-1] == self.parts * h:  # the target's layers; else the head's own
            pieces = features.split(h, -1)
            normed = [norm(piece) for norm, piece in zip(self.part_norms, pieces, strict=True)]
            features = self.fc_g(torch.cat(normed, -1))
        return super().fuse(embeds, features)


def encode(tokenizer, messages: list[dict]) -> tuple[torch.Tensor, int]:
    """Token ids [T] of a chat transcript and the index where its answer starts."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = tokenizer.apply_chat_template(
        messages[:-1], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, add_special_tokens=False).input_ids[:MAX_LENGTH]
    return torch.tensor(ids), len(tokenizer(prompt, add_special_tokens=False).input_ids)


@torch.no_grad()
def extract(model, tokenizer, path: Path, layers: list[int]) -> list[tuple]:
    """(ids [T], answer start, features [T, (len(layers) + 1) * H] bf16, final last)."""
    items, tokens, started = [], 0, time.time()
    for line in path.read_text(encoding="utf-8").splitlines():
        ids, start = encode(tokenizer, json.loads(line)["messages"])
        states = model(ids[None], output_hidden_states=True).hidden_states  # [1, T, H] each
        features = torch.cat([states[i][0] for i in layers] + [states[-1][0]], -1)
        items.append((ids, start, features.to(torch.bfloat16)))
        tokens += ids.numel()
    print(f"{path.name}: {len(items)} records, {tokens} tokens, {time.time() - started:.0f} s")
    return items


def unrolled(head: EagleHead, item: tuple, fused: bool, embedding: torch.Tensor, hidden: int):
    """The head's STEPS predicted features [1, T - 1, H] each, and the final features [T, H]."""
    ids, _, features = item
    features = features.float()
    final = features[:, -hidden:]
    rows = ids.numel() - 1
    embeds = embedding[torch.cat([ids[1:], torch.zeros(STEPS, dtype=torch.long)])][None]
    inputs = features if fused else final
    return head.unrolled(embeds[:, : rows + STEPS - 1], inputs[None, :rows], STEPS), final


def loss_of(head, item, fused, embedding, rows_out, hidden, generator) -> torch.Tensor:
    outputs, final = unrolled(head, item, fused, embedding, hidden)
    total = torch.zeros(())
    t = final.shape[0] - 1
    for step, predicted in enumerate(outputs):
        n = t - step
        if n <= 0:
            break
        target = final[step + 1 : step + 1 + n]  # f_{t+step+1}
        keep = torch.randperm(n, generator=generator)[: max(1, int(n * 0.3))]
        p = torch.softmax(target[keep] @ rows_out.T, -1)
        log_q = torch.log_softmax(predicted[0, keep] @ rows_out.T, -1)
        loss = -(p * log_q).sum(-1).mean() + 0.2 * F.smooth_l1_loss(predicted[0, :n], target)
        total = total + 0.8**step * loss
    return total


@torch.no_grad()
def evaluate(head, held, fused, embedding, rows_out, vocab, output, hidden) -> list[float]:
    hits, seen = torch.zeros(STEPS), torch.zeros(STEPS)
    for item in held:
        start = item[1]
        outputs, final = unrolled(head, item, fused, embedding, hidden)
        greedy = (final @ output.T).argmax(-1)  # [T] the target's next token
        t = final.shape[0] - 1
        for step, predicted in enumerate(outputs):
            n = t - step
            guess = vocab[(predicted[0, :n] @ rows_out.T).argmax(-1)]
            answer = torch.arange(n) >= start
            hits[step] += ((guess == greedy[step + 1 : step + 1 + n]) & answer).sum()
            seen[step] += answer.sum()
    return (hits / seen.clamp(min=1)).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="prepare_draft_data.py --out")
    parser.add_argument(
        "--variants", nargs="+", default=["last", "fused"], choices=["last", "fused"]
    )
    parser.add_argument(
        "--layers",
        nargs="+",
        type=int,
        default=[3, 15],
        help="hidden_states indices fused beside the final feature",
    )
    parser.add_argument(
        "--fraction", type=float, default=1.0, help="share of the answers trained on"
    )
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from speculative.models.loading import resolve_model

    torch.set_num_threads(args.threads)
    folder = resolve_model("default").path
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cfg = model.config
    hidden = cfg.hidden_size
    cache = args.data / f"features-{'-'.join(map(str, args.layers))}.pt"
    if cache.exists():
        train, held = torch.load(cache)
    else:
        train = extract(model, tokenizer, args.data / "selfdistill.jsonl", args.layers)
        held = extract(model, tokenizer, args.data / "eval.jsonl", args.layers)
        torch.save((train, held), cache)
    train = train[: int(len(train) * args.fraction)]
    counts = torch.zeros(cfg.vocab_size)
    for ids, _, _ in train:
        counts += torch.bincount(ids, minlength=cfg.vocab_size)
    vocab = counts.argsort(descending=True)[:DRAFT_VOCAB]
    output = model.lm_head.weight.detach()  # [V, H]
    rows_out = output[vocab].clone()  # [N, H]
    embedding = model.model.embed_tokens.weight.detach()
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    config = HeadConfig(
        "eagle",
        hidden,
        DRAFT_VOCAB,
        cfg.intermediate_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        theta,
        cfg.rms_norm_eps,
    )
    tokens = sum(item[0].numel() for item in train)
    for variant in args.variants:
        fused = variant == "fused"
        torch.manual_seed(1)
        head = FusedEagleHead(config, len(args.layers) + 1) if fused else EagleHead(config)
        optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
        generator = torch.Generator().manual_seed(2)
        total = max(1, tokens // args.batch_tokens)
        order = torch.randperm(len(train), generator=generator).tolist()
        step, batch, size, started = 0, [], 0, time.time()
        for index in order:
            batch.append(train[index])
            size += train[index][0].numel()
            if size < args.batch_tokens and index != order[-1]:
                continue
            warm = min(1.0, step / 50)
            for group in optimizer.param_groups:
                group["lr"] = (
                    args.lr * warm * 0.5 * (1 + math.cos(math.pi * min(step / total, 1.0)))
                )
            loss = sum(
                loss_of(head, item, fused, embedding, rows_out, hidden, generator) for item in batch
            ) / len(batch)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            step, batch, size = step + 1, [], 0
        top1 = evaluate(head, held, fused, embedding, rows_out, vocab, output, hidden)
        params = sum(p.numel() for p in head.parameters()) / 1e6
        print(
            f"{variant}: {tokens} training tokens, held-out top-1 by draft step "
            f"{[round(v, 3) for v in top1]} ({time.time() - started:.0f} s, {params:.2f}M params)"
        )


if __name__ == "__main__":
    main()
