"""Training text for drafting heads: files (plain text or JSONL) -> token id sequences,
chat-templated the way the drafter will meet them."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

MIN_TOKENS = 16


def read_records(paths: Sequence[Path]) -> Iterator[dict[str, Any]]:
    """JSONL lines ({"messages": [...]}, {"prompt": ...}, {"text": ...} or {"ids": [...]})
    or plain text
    files (split into paragraphs groups of ~2000 characters)."""
    for path in paths:
        path = Path(path)
        try:
            text = path.read_text("utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"cannot read training data {path}: {error}") from None
        if path.suffix == ".jsonl":
            for number, line in enumerate(text.splitlines(), start=1):
                if line.strip():
                    yield _parse_line(line, f"{path} line {number}")
        else:
            yield from ({"text": block} for block in _blocks(text))


def _parse_line(line: str, where: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON ({error.msg})") from None
    if not isinstance(record, dict) or not ({"messages", "prompt", "text", "ids"} & record.keys()):
        raise ValueError(f"{where}: expected an object with messages, prompt, text or ids")
    return record


def _blocks(text: str, size: int = 2000) -> Iterator[str]:
    block = ""
    for paragraph in text.split("\n\n"):
        block = f"{block}\n\n{paragraph}" if block else paragraph
        if len(block) >= size:
            yield block
            block = ""
    if block.strip():
        yield block


def encode_record(tokenizer: Any, record: dict[str, Any], max_tokens: int) -> list[int]:
    """Token ids of one record: chat transcripts through the chat template (when the
    tokenizer has one), plain text as is, ``ids`` (pre-tokenized) as given; cut to
    ``max_tokens``."""
    if "ids" in record:
        return [int(t) for t in record["ids"]][:max_tokens]
    messages = record.get("messages")
    if messages is None and "prompt" in record:
        messages = [{"role": "user", "content": record["prompt"]}]
        if "response" in record:
            messages.append({"role": "assistant", "content": record["response"]})
    if messages is not None and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(list(messages), tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = record.get("text") or "\n".join(m["content"] for m in messages or [])
        ids = tokenizer(text)["input_ids"]
    return list(ids[:max_tokens])


def is_held_out(index: int, fraction: float) -> bool:
    """Deterministic split: every round(1 / fraction)-th record is held out."""
    if fraction <= 0:
        return False
    return index % max(2, round(1 / fraction)) == 1
