"""The benchmark's prompt suite: JSONL records of ``{"category", "prompt" | "messages"}``.

The built-in suite (``data/prompts.jsonl``, written for this project) covers eight task
categories in the spirit of Spec-Bench, ten prompts each: multi-turn chat, translation,
summarization, question answering, math reasoning, retrieval-augmented QA, code
completion and code editing. A user's own file in the same format replaces it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

ROLES = frozenset({"system", "user", "assistant"})


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt: plain text or a chat transcript (``messages``), in a category."""

    category: str
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.messages is not None:
            return {"category": self.category, "messages": list(self.messages)}
        return {"category": self.category, "prompt": self.prompt}


def builtin_prompts_text() -> str:
    """The shipped suite's JSONL text."""
    return resources.files("speculative.bench").joinpath("data/prompts.jsonl").read_text("utf-8")


def load_prompts(path: Path | None = None) -> list[BenchPrompt]:
    """The prompts of ``path`` (a JSONL file), or the built-in suite when ``path`` is None."""
    if path is None:
        return parse_prompts(builtin_prompts_text(), "the built-in prompt suite")
    try:
        text = Path(path).read_text("utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read prompts file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"prompts file {path} is not UTF-8 text") from None
    return parse_prompts(text, str(path))


def parse_prompts(text: str, source: str = "prompts") -> list[BenchPrompt]:
    """Parse JSONL text; blank lines are skipped, any malformed line is a ValueError."""
    prompts = [
        parse_record(line, f"{source} line {number}")
        for number, line in enumerate(text.splitlines(), start=1)
        if line.strip()
    ]
    if not prompts:
        raise ValueError(f"{source} holds no prompts")
    return prompts


def parse_record(line: str, where: str) -> BenchPrompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    category = record.get("category")
    if not isinstance(category, str) or not category.strip():
        raise ValueError(f"{where}: 'category' must be a non-empty string")
    has_prompt, has_messages = "prompt" in record, "messages" in record
    if has_prompt == has_messages:
        raise ValueError(f"{where}: give exactly one of 'prompt' or 'messages'")
    if has_prompt:
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        return BenchPrompt(category=category.strip(), prompt=prompt)
    return BenchPrompt(
        category=category.strip(), messages=parse_messages(record["messages"], where)
    )


def parse_messages(messages: Any, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: messages[{i}] must be an object with role and content")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"{where}: messages[{i}].role must be one of {sorted(ROLES)}")
        if not isinstance(content, str) or not content.strip():
            raise ValueError(f"{where}: messages[{i}].content must be a non-empty string")
        parsed.append({"role": role, "content": content})
    return tuple(parsed)


def categories(prompts: Sequence[BenchPrompt]) -> list[str]:
    """Categories in order of first appearance."""
    return list(dict.fromkeys(p.category for p in prompts))


def take_per_category(prompts: Sequence[BenchPrompt], limit: int | None) -> list[BenchPrompt]:
    """The first ``limit`` prompts of each category (all when ``limit`` is None)."""
    if limit is None:
        return list(prompts)
    counts: dict[str, int] = {}
    kept = []
    for prompt in prompts:
        if counts.get(prompt.category, 0) < limit:
            counts[prompt.category] = counts.get(prompt.category, 0) + 1
            kept.append(prompt)
    return kept
