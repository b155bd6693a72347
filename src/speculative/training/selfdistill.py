"""Self-distillation data: the target answers chat prompts; the transcripts (prompt plus
the target's own answer) become training text for a drafting head."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

SAMPLED_EVERY = 4  # every 4th prompt is answered at temperature 0.8 / top-p 0.95


def answer_prompts(
    speculator: Any,
    prompts: Sequence[list[dict[str, str]]],
    max_new_tokens: int = 256,
    seed: int = 0,
    progress: bool = True,
) -> Iterator[tuple[list[dict[str, str]], int]]:
    """Yield (transcript with the target's answer appended, answer tokens) per prompt.

    Greedy answers mostly (what greedy decoding meets); a quarter sampled at
    temperature 0.8 / top-p 0.95 (what sampling meets).
    """
    bar = tqdm(prompts, desc="self-distill", unit="prompt", disable=not progress)
    total = 0
    for index, messages in enumerate(bar):
        sampled = index % SAMPLED_EVERY == SAMPLED_EVERY - 1
        out = speculator.generate(
            messages=messages,
            max_new_tokens=max_new_tokens,
            temperature=0.8 if sampled else 0.0,
            top_p=0.95 if sampled else 1.0,
            seed=seed + index,
        )
        total += len(out.token_ids)
        bar.set_postfix(tokens=total)
        answer = {"role": "assistant", "content": out.text}
        yield [*messages, answer], len(out.token_ids)


def write_transcripts(path: Path, transcripts: Iterator[tuple[list[dict[str, str]], int]]) -> int:
    """Append transcripts to a JSONL file as they come (a partial run stays usable);
    returns the answer tokens written."""
    tokens = 0
    with Path(path).open("a", encoding="utf-8") as handle:
        for messages, count in transcripts:
            handle.write(json.dumps({"messages": messages}) + "\n")
            handle.flush()
            tokens += count
    return tokens
