"""Teacher-forced target forwards -> features cached on disk in chunks (bounded memory).

Each chunk file holds several sequences: their tokens, the target's features (bf16) and
the target's greedy next token at every position. Soft labels are not stored: the
target's distribution at a position is ``softmax(feature @ W_out.T)``, recomputed from
the feature over the draft vocabulary when training.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from speculative.heads.store import require_features

CHUNK_TOKENS = 16384


@dataclass
class Sequence_:
    tokens: torch.Tensor  # [L] int64
    features: torch.Tensor  # [L, hidden] float32
    greedy: torch.Tensor  # [L] int64: the target's argmax after each position


@torch.no_grad()
def teacher_forced(model: object, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over ``tokens`` from an empty cache: (features [L, H], greedy [L])."""
    lm = require_features(model)
    lm.reset()  # type: ignore[attr-defined]
    logits, features = lm.forward_with_hidden(torch.tensor([list(tokens)], dtype=torch.long))
    lm.reset()  # type: ignore[attr-defined]
    return features[0], logits[0].argmax(-1)


class ChunkWriter:
    """Appends sequences to numbered chunk files in ``folder``."""

    def __init__(self, folder: Path, prefix: str) -> None:
        self.folder, self.prefix = Path(folder), prefix
        self.folder.mkdir(parents=True, exist_ok=True)
        self.pending: list[Sequence_] = []
        self.tokens = 0
        self.count = 0
        self.total = 0

    def add(self, item: Sequence_) -> None:
        self.pending.append(item)
        self.tokens += item.tokens.numel()
        self.total += item.tokens.numel()
        if self.tokens >= CHUNK_TOKENS:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.folder / f"{self.prefix}-{self.count:05d}.pt"
        torch.save(
            {
                "tokens": [s.tokens.to(torch.int32) for s in self.pending],
                "features": [s.features.to(torch.bfloat16) for s in self.pending],
                "greedy": [s.greedy.to(torch.int32) for s in self.pending],
            },
            path,
        )
        self.pending, self.tokens = [], 0
        self.count += 1


def extract(
    model: object,
    sequences: Sequence[tuple[list[int], bool]],
    folder: Path,
    progress: bool = True,
) -> tuple[Counter[int], int, int]:
    """Write train-* and heldout-* chunks for (tokens, held_out) sequences.

    Returns token counts over the training sequences (text tokens and the target's
    greedy tokens: what the draft vocabulary must cover) and the token totals.
    """
    train, held = ChunkWriter(folder, "train"), ChunkWriter(folder, "heldout")
    counts: Counter[int] = Counter()
    total = sum(len(t) for t, _ in sequences)
    bar = tqdm(total=total, desc="features", unit="tok", disable=not progress)
    for tokens, held_out in sequences:
        features, greedy = teacher_forced(model, tokens)
        item = Sequence_(torch.tensor(tokens), features, greedy)
        if held_out:
            held.add(item)
        else:
            train.add(item)
            counts.update(tokens)
            counts.update(greedy.tolist())
        bar.update(len(tokens))
    bar.close()
    train.flush()
    held.flush()
    return counts, train.total, held.total


def chunk_paths(folder: Path, prefix: str) -> list[Path]:
    return sorted(Path(folder).glob(f"{prefix}-*.pt"))


def iterate_chunks(paths: Sequence[Path]) -> Iterator[Sequence_]:
    """Sequences of the chunks, one chunk in memory at a time."""
    for path in paths:
        chunk = torch.load(path, weights_only=True)
        for tokens, features, greedy in zip(
            chunk["tokens"], chunk["features"], chunk["greedy"], strict=True
        ):
            yield Sequence_(tokens.long(), features.float(), greedy.long())


def draft_vocabulary(counts: Counter[int], size: int, vocab: int) -> torch.Tensor:
    """The ``size`` most frequent target ids (sorted), as EAGLE-3's reduced vocabulary."""
    size = min(size, vocab)
    chosen = [token for token, _ in counts.most_common(size)]
    if len(chosen) < size:  # pad with the lowest unused ids
        used = set(chosen)
        chosen += [t for t in range(vocab) if t not in used][: size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)
