"""Self-distillation data: the target answers chat prompts; the transcripts (prompt plus
the target's own answer) become training text for a drafting head.

The answers come from the batched engine (:class:`~speculative.batch_jobs.RowDecoder`,
plain decoding at the target's precision): many prompts share each target pass, which on
a CPU is an order of magnitude more answer tokens per second than one prompt at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from speculative.training.prompts import prompt_key

SAMPLED_EVERY = 4  # every 4th prompt is answered at temperature 0.8 / top-p 0.95

Messages = list[dict[str, str]]


def answer_records(
    prompts: Sequence[Messages], max_new_tokens: int = 256, seed: int = 0
) -> list[dict[str, Any]]:
    """Batch-job records for ``prompts``: greedy mostly (what greedy decoding meets), a
    quarter sampled at temperature 0.8 / top-p 0.95 (what sampling meets)."""
    records = []
    for index, messages in enumerate(prompts):
        sampled = index % SAMPLED_EVERY == SAMPLED_EVERY - 1
        records.append(
            {
                "messages": messages,
                "max_new_tokens": max_new_tokens,
                "temperature": 0.8 if sampled else 0.0,
                "top_p": 0.95 if sampled else 1.0,
                "seed": seed + index,
            }
        )
    return records


def answer_prompts(
    decoder: Any,
    prompts: Sequence[Messages],
    max_new_tokens: int = 256,
    seed: int = 0,
    progress: bool = True,
) -> Iterator[tuple[Messages, int]]:
    """Yield (transcript with the target's answer appended, answer tokens) per prompt, in
    the order rows finish. ``decoder`` is a :class:`~speculative.batch_jobs.RowDecoder`."""
    records = answer_records(prompts, max_new_tokens, seed)
    bar = tqdm(total=len(records), desc="self-distill", unit="answer", disable=not progress)
    total = 0
    for line in decoder.run(enumerate(records)):
        count = len(line["token_ids"])
        total += count
        bar.update(1)
        bar.set_postfix(tokens=total)
        answer = {"role": "assistant", "content": line["text"]}
        yield [*records[line["index"]]["messages"], answer], count
    bar.close()


def answered(path: Path) -> set[str]:
    """The prompts (transcripts without their last answer) a transcript file already
    answers: a rerun skips them, so an interrupted run continues where it stopped."""
    if not Path(path).is_file():
        return set()
    return {prompt_key(messages[:-1]) for messages in read_transcripts(path)}


def read_transcripts(path: Path) -> Iterator[Messages]:
    """The ``messages`` of each line of a JSONL file (lines that hold none are skipped)."""
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            yield json.loads(line)["messages"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue


def first_turns(paths: Sequence[Path]) -> set[str]:
    """The first user turns (as :func:`prompt_key`) of the transcripts or prompts in JSONL
    files (``{"messages": [...]}`` a line): what earlier runs drew, for
    ``build_prompts(exclude=...)``."""
    return {
        prompt_key(messages[:1])
        for path in paths
        for messages in read_transcripts(path)
        if messages and messages[0].get("role") == "user"
    }


def unanswered(path: Path, prompts: Sequence[Messages]) -> list[Messages]:
    """The prompts the transcript file at ``path`` does not answer yet, in order."""
    done = answered(path)
    return [messages for messages in prompts if prompt_key(messages) not in done]


def write_transcripts(path: Path, transcripts: Iterator[tuple[Messages, int]]) -> int:
    """Append transcripts to a JSONL file as they come (a partial run stays usable);
    returns the answer tokens written."""
    tokens = 0
    with Path(path).open("a", encoding="utf-8") as handle:
        for messages, count in transcripts:
            handle.write(json.dumps({"messages": messages}) + "\n")
            handle.flush()
            tokens += count
    return tokens
