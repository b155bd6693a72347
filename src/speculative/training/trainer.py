"""Train an EAGLE or Medusa head on cached target features (see :mod:`.features`).

Loss = distillation against the target's own distribution over the draft vocabulary
(soft cross-entropy; the target's probabilities come from its stored features) plus,
for EAGLE, a feature regression. EAGLE trains through ``unroll`` consecutive draft steps
(each reading its own previous prediction), as drafting will run it. The head's forward may
run under bf16 autocast (``TrainSettings.matmul_precision``, see :mod:`.precision`); the
target's soft labels are always computed in float32. The soft cross-entropy runs as the C
kernels' fused loss where they build (:mod:`.soft_ce`), else in torch.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from speculative.heads.modules import HeadConfig, TrainableHead, prediction_rows, shifted
from speculative.training.features import Sequence_, iterate_chunks
from speculative.training.precision import RESOLVED
from speculative.training.soft_ce import (
    SoftCrossEntropy,
    soft_cross_entropy_for_this_machine,
    torch_soft_cross_entropy,
)

REGRESSION_WEIGHT = 0.2
STEP_DECAY = 0.8  # weight of unrolled step s: STEP_DECAY ** s
LOSS_ROWS = ("independent", "shared")  # how the unrolled steps draw their loss rows


@dataclass
class TrainSettings:
    method: str = "eagle"
    steps: int = 0  # 0: from epochs
    epochs: float = 2.0
    lr: float = 1e-3
    batch_tokens: int = 2048
    unroll: int = 3
    seed: int = 0
    checkpoint_every: int = 200
    eval_steps: int = 5
    loss_fraction: float = 0.5  # share of rows whose distributions enter the loss
    # "independent": each unrolled step draws its own rows; "shared": one draw for all
    # steps (step s scores the drawn rows still inside their sequence at its offset)
    loss_rows: str = "independent"
    matmul_precision: str = "fp32"  # "fp32" or "bf16" (resolved from "auto" by the caller)


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, L] int64 (0-padded)
    features: torch.Tensor  # [B, L, W] float32 (0-padded): W = H, or H * (1 + layers)
    greedy: torch.Tensor  # [B, L] int64
    lengths: torch.Tensor  # [B] int64


@dataclass
class Metrics:
    loss: float = 0.0
    top1: float = 0.0


@dataclass
class HeldOut:
    """Per draft step s: top-1 agreement with the target's greedy token, and the mean
    greedy chain length accepted out of ``len(top1)`` drafted."""

    top1: list[float] = field(default_factory=list)
    accepted: float = 0.0
    tokens: int = 0


def make_batches(
    sequences: Iterator[Sequence_], batch_tokens: int, rng: random.Random
) -> Iterator[Batch]:
    """Pack sequences (shuffled within a window) into padded batches of ~batch_tokens."""
    window: list[Sequence_] = []
    for item in sequences:
        window.append(item)
        if len(window) >= 64:
            rng.shuffle(window)
            yield from _pack(window[:32], batch_tokens)
            window = window[32:]
    rng.shuffle(window)
    yield from _pack(window, batch_tokens)


def _pack(items: list[Sequence_], batch_tokens: int) -> Iterator[Batch]:
    group: list[Sequence_] = []
    for item in sorted(items, key=lambda s: s.tokens.numel()):
        longest = max([s.tokens.numel() for s in group] + [item.tokens.numel()])
        if group and longest * (len(group) + 1) > batch_tokens:
            yield collate(group)
            group = []
        group.append(item)
    if group:
        yield collate(group)


def collate(items: Sequence[Sequence_]) -> Batch:
    length = max(s.tokens.numel() for s in items)
    hidden = items[0].features.shape[-1]
    tokens = torch.zeros(len(items), length, dtype=torch.long)
    greedy = torch.zeros(len(items), length, dtype=torch.long)
    features = torch.zeros(len(items), length, hidden)
    for i, s in enumerate(items):
        n = s.tokens.numel()
        tokens[i, :n], greedy[i, :n], features[i, :n] = s.tokens, s.greedy, s.features
    lengths = torch.tensor([s.tokens.numel() for s in items])
    return Batch(tokens, features, greedy, lengths)


def predictions(
    module: TrainableHead,
    batch: Batch,
    embedding: torch.Tensor,
    steps: int,
    wanted: list[torch.Tensor] | None = None,
) -> list[tuple[torch.Tensor, int]]:
    """Per draft step: (predicted features [B, T, H], offset o) of ``module`` over
    ``batch`` (:meth:`TrainableHead.teacher_forced`)."""
    return module.teacher_forced(batch.tokens, batch.features, embedding, steps, wanted)


@dataclass(frozen=True)
class LossPlan:
    """What :func:`batch_loss` scores in a batch, fixed for a whole run."""

    steps: int  # EAGLE: unrolled draft steps; Medusa: heads
    fraction: float = 1.0  # share of each step's rows whose distributions enter the loss
    shared_rows: bool = False  # one draw of rows for every step (``--loss-rows shared``)
    soft_ce: SoftCrossEntropy = torch_soft_cross_entropy


def batch_loss(
    module: TrainableHead,
    batch: Batch,
    embedding: torch.Tensor,  # [vocab, H] the target's input embedding
    rows: torch.Tensor,  # [N, H] the target's output rows of the draft vocabulary
    plan: LossPlan,
    generator: torch.Generator | None = None,  # the rows' draws; None: torch's global one
) -> tuple[torch.Tensor, float]:
    """Distillation (+ feature regression where the head regresses its predictions onto
    the target's features: EAGLE's) loss and step-0 top-1 agreement. Under
    autocast the head's products run at its dtype; the target's logits never do.
    The rows that enter the loss are drawn first (from ``generator``; once for every
    draft step with ``plan.shared_rows``), so the head computes only those (and what
    later draft steps read)."""
    total = torch.zeros(())
    top1 = 0.0
    hidden = rows.shape[1]
    last = batch.features[..., :hidden].reshape(-1, hidden)  # the last layer's [B * L, H]
    per_sequence = prediction_rows(module, batch.tokens.shape[1])
    picks = _draw_rows(per_sequence, batch, plan, generator)
    outputs = predictions(module, batch, embedding, plan.steps, [chosen for chosen, _ in picks])
    # the target's logits at every position some step scores, computed once
    needed, where = torch.unique(torch.cat([at for _, at in picks]), return_inverse=True)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        labels = last[needed] @ rows.T  # [U, N] float32
    student = _autocast_copy(rows)  # [N, H] cast once, not at each step's product
    start = 0
    for s, ((pred, _), (chosen, at)) in enumerate(zip(outputs, picks, strict=True)):
        pred_rows = pred.reshape(-1, hidden)[chosen]  # [M, H]
        index = where[start : start + at.numel()]  # [M] rows of labels
        start += at.numel()
        per_row, agree = plan.soft_ce(pred_rows @ student.T, labels, index)  # [M], [M]
        loss = per_row.mean()
        if module.regresses_features:
            loss = loss + REGRESSION_WEIGHT * F.smooth_l1_loss(pred_rows, last[at])
        total = total + STEP_DECAY**s * loss
        if s == 0:
            top1 = float(agree.float().mean())
    return total, top1


def _autocast_copy(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in the CPU autocast dtype when autocast is on (what each product under it
    would cast it to), else itself."""
    if not torch.is_autocast_enabled("cpu"):
        return weight
    return weight.to(torch.get_autocast_dtype("cpu"))


def _draw_rows(
    per_sequence: int, batch: Batch, plan: LossPlan, generator: torch.Generator | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per draft step s, the rows that enter its loss (see :func:`_pick`). Shared: one
    draw over step 0's valid rows, of which step s keeps those still inside their
    sequence at its offset (so every later step's rows are step 0's, and the head
    computes no row for later steps alone)."""
    fraction = plan.fraction
    if not plan.shared_rows:
        return [_pick(s + 1, per_sequence, batch, fraction, generator) for s in range(plan.steps)]
    drawn, _ = _pick(1, per_sequence, batch, fraction, generator)
    t = per_sequence
    picks = []
    for offset in range(1, plan.steps + 1):
        chosen = drawn[_valid_rows(offset, t, batch).reshape(-1)[drawn]]  # [M_s]
        picks.append((chosen, _positions(chosen, t, batch, offset)))
    return picks


def _pick(
    offset: int,
    per_sequence: int,
    batch: Batch,
    fraction: float,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of one draft step that enter the loss, of ``per_sequence`` prediction rows
    per sequence: their flat indices in [B * T] and the flat positions in [B * L] of the
    features they predict (row t of a sequence predicts position t + offset)."""
    valid = _valid_rows(offset, per_sequence, batch)  # [B, T]
    chosen = _loss_rows(valid, fraction, generator)  # [M] flat row indices of [B, T]
    return chosen, _positions(chosen, per_sequence, batch, offset)


def _valid_rows(offset: int, per_sequence: int, batch: Batch) -> torch.Tensor:
    """[B, T] bool: row t predicts a position inside its sequence (t + offset < length)."""
    return torch.arange(per_sequence) + offset < batch.lengths.unsqueeze(1)


def _positions(chosen: torch.Tensor, per_sequence: int, batch: Batch, offset: int) -> torch.Tensor:
    """[M] flat positions in [B * L] that rows ``chosen`` (flat in [B * T]) predict."""
    t = per_sequence
    return (chosen // t) * batch.tokens.shape[1] + chosen % t + offset


def _loss_rows(
    valid: torch.Tensor, fraction: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Flat indices of the valid rows, a random ``fraction`` of them (the output-head
    matmuls dominate training; every row still shapes the attention context)."""
    index = valid.reshape(-1).nonzero().squeeze(1)
    if fraction >= 1 or index.numel() < 2:
        return index
    keep = max(1, int(index.numel() * fraction))
    return index[torch.randperm(index.numel(), generator=generator)[:keep]]


@torch.no_grad()
def evaluate(
    module: TrainableHead,
    paths: Sequence[Path],
    embedding: torch.Tensor,
    rows: torch.Tensor,
    draft_to_target: torch.Tensor,
    steps: int,
    answer_marker: int | None = None,
) -> HeldOut:
    """Greedy agreement with the target on held-out sequences, per draft step, and the
    mean accepted length of a chain of ``steps`` drafts (a draft step counts only while
    the text follows the target's greedy choice, as greedy decoding would). With
    ``answer_marker`` (the chat template's turn-start token) only positions after its
    last occurrence count: the answer the drafter will meet, not the template."""
    module.eval()
    hits = torch.zeros(steps)
    seen = torch.zeros(steps)
    accepted_sum, chains, tokens = 0.0, 0, 0
    for item in iterate_chunks(paths):
        batch = collate([item])
        n = item.tokens.numel()
        start = _answer_start(item.tokens, answer_marker)
        tokens += n - start
        drafted, valids = [], []
        for pred, offset in predictions(module, batch, embedding, steps):
            t = pred.shape[1]
            ids = draft_to_target[(pred[0] @ rows.T).argmax(-1)]  # [T]
            want = shifted(batch.greedy, offset, t)[0]  # target's token after t + offset
            valid = (torch.arange(t) + offset < n) & (torch.arange(t) >= start)
            drafted.append((ids == want) & valid)
            valids.append(valid)
        chain = torch.ones(drafted[0].shape[0], dtype=torch.bool)
        follows = _follows_greedy(item, drafted[0].shape[0], steps, module.reads_next_token)
        length = torch.zeros(drafted[0].shape[0])
        for s, ok in enumerate(drafted):
            hits[s] += ok.float().sum()
            seen[s] += valids[s].float().sum()
            chain = chain & ok & follows[s]
            length += chain.float()
        index = torch.arange(length.numel())
        usable = (index + steps + 1 < n) & (index >= start)
        accepted_sum += float(length[usable].sum())
        chains += int(usable.sum())
    module.train()
    return HeldOut(
        top1=(hits / seen.clamp(min=1)).tolist(),
        accepted=accepted_sum / max(chains, 1),
        tokens=tokens,
    )


def _answer_start(tokens: torch.Tensor, marker: int | None) -> int:
    """Index of the first row after the last ``marker`` token plus the role line (the
    "assistant" and newline tokens), 0 without a marker."""
    if marker is None:
        return 0
    where = (tokens == marker).nonzero()
    return int(where[-1]) + 2 if where.numel() else 0


def _follows_greedy(item: Sequence_, rows: int, steps: int, reads_next: bool) -> list[torch.Tensor]:
    """follows[s][t]: the text tokens a draft at step s of row t is conditioned on are
    the target's greedy choices (a head that reads x_{t+1} with its true pair, EAGLE's,
    reads x_{t+2} .. x_{t+s+1} beyond it; one blind to x_{t+1}, Medusa's, needs x_{t+1} ..
    x_{t+s+1})."""
    greedy_text = torch.zeros(item.tokens.numel() + 1, dtype=torch.bool)
    greedy_text[1 : item.tokens.numel()] = item.tokens[1:] == item.greedy[:-1]  # x_j greedy
    out, ok = [], torch.ones(rows, dtype=torch.bool)
    index = torch.arange(rows)
    for s in range(steps):
        needed = index + s + 1  # the newest conditioning token
        if s > 0 or not reads_next:
            ok = ok & greedy_text[needed.clamp(max=item.tokens.numel())]
        out.append(ok.clone())
    return out


class Trainer:
    """The optimisation loop with checkpoints and resume."""

    def __init__(
        self,
        config: HeadConfig,
        module: nn.Module,
        embedding: torch.Tensor,  # [vocab, H] the target's input embedding
        rows: torch.Tensor,  # [N, H] the target's output rows of the draft vocabulary
        settings: TrainSettings,
        checkpoint: Path | None = None,
        soft_ce: SoftCrossEntropy | None = None,  # default: the C kernel where it builds
    ) -> None:
        if not isinstance(module, TrainableHead):
            raise TypeError(f"{type(module).__name__} is not a head the trainer can train")
        if settings.loss_rows not in LOSS_ROWS:
            raise ValueError(f"loss rows must be one of {', '.join(LOSS_ROWS)}")
        if settings.matmul_precision not in RESOLVED:
            raise ValueError(
                f"matmul precision must be fp32 or bf16, not {settings.matmul_precision!r}"
            )
        self.config, self.module, self.settings = config, module, settings
        self.embedding, self.rows = embedding, rows
        self.checkpoint = checkpoint
        self.loss_plan = LossPlan(
            steps=settings.unroll if config.method == "eagle" else config.medusa_heads,
            fraction=settings.loss_fraction,
            shared_rows=settings.loss_rows == "shared",
            soft_ce=soft_ce or soft_cross_entropy_for_this_machine(),
        )
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=settings.lr, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(settings.seed)  # the loss's rows
        self.step = 0
        self.seconds = 0.0
        self.history: list[dict[str, float]] = []

    def lr_at(self, step: int, total: int) -> float:
        warmup = min(50, total // 10 + 1)
        if step < warmup:
            return self.settings.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return self.settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def run(self, paths: Sequence[Path], total_steps: int, progress: bool = True) -> Metrics:
        rng = random.Random(self.settings.seed + self.step)
        metrics = Metrics()
        bar = tqdm(
            total=total_steps, initial=self.step, desc="train", unit="step", disable=not progress
        )
        started = time.perf_counter() - self.seconds
        while self.step < total_steps:
            order = list(paths)
            rng.shuffle(order)
            for batch in make_batches(iterate_chunks(order), self.settings.batch_tokens, rng):
                if self.step >= total_steps:
                    break
                value, top1 = self._step(batch, total_steps)
                metrics.loss = 0.9 * metrics.loss + 0.1 * value if self.step > 1 else value
                metrics.top1 = 0.9 * metrics.top1 + 0.1 * top1 if self.step > 1 else top1
                bar.set_postfix(loss=f"{metrics.loss:.3f}", top1=f"{metrics.top1:.3f}")
                bar.update(1)
                self.seconds = time.perf_counter() - started
                if self.checkpoint and self.step % self.settings.checkpoint_every == 0:
                    self.save(self.checkpoint)
        bar.close()
        if self.checkpoint:
            self.save(self.checkpoint)
        return metrics

    def _step(self, batch: Batch, total_steps: int) -> tuple[float, float]:
        """One optimizer step on ``batch``: (loss, step-0 top-1)."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step, total_steps)
        bf16 = self.settings.matmul_precision == "bf16"
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, top1 = batch_loss(
                self.module, batch, self.embedding, self.rows, self.loss_plan, self.generator
            )
        self.optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
        self.optimizer.step()
        self.step += 1
        return float(loss.detach()), top1

    def save(self, path: Path) -> None:
        torch.save(
            {
                "module": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "generator": self.generator.get_state(),
                "step": self.step,
                "seconds": self.seconds,
                "settings": asdict(self.settings),
            },
            path,
        )

    def load(self, path: Path) -> None:
        state = torch.load(path, weights_only=True)
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        if "generator" in state:  # checkpoints before it drew from torch's global generator
            self.generator.set_state(state["generator"])
        self.step = int(state["step"])
        self.seconds = float(state["seconds"])
