"""The benchmark's prompt suite: JSONL records of ``{"category", "prompt" | "messages"}``
and, optionally, the ``json_schema`` the output must satisfy.

The built-in suite (``data/prompts.jsonl``, written for this project) covers eight task
categories in the spirit of Spec-Bench, ten prompts each: multi-turn chat, translation,
summarization, question answering, math reasoning, retrieval-augmented QA, code
completion and code editing. A user's own file in the same format replaces it. The
structured suite (``data/structured.jsonl``) asks for JSON, each prompt with its schema:
extracting fields from a given text, and making up a record.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
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
    # the JSON schema the output must satisfy (structured outputs), or None: free text
    json_schema: dict[str, Any] | None = field(default=None, hash=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"category": self.category}
        if self.messages is not None:
            out["messages"] = list(self.messages)
        else:
            out["prompt"] = self.prompt
        if self.json_schema is not None:
            out["json_schema"] = self.json_schema
        return out


def builtin_prompts_text(name: str = "prompts") -> str:
    """A shipped suite's JSONL text: ``prompts`` (the eight categories) or ``structured``
    (JSON outputs, each prompt with its schema)."""
    data = resources.files("speculative.bench").joinpath(f"data/{name}.jsonl")
    return data.read_text("utf-8")


def load_prompts(path: Path | None = None, structured: bool = False) -> list[BenchPrompt]:
    """The prompts of ``path`` (a JSONL file), or a built-in suite when ``path`` is None
    (``structured``: the JSON-output suite)."""
    if path is None:
        name = "structured" if structured else "prompts"
        return parse_prompts(builtin_prompts_text(name), f"the built-in {name} suite")
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
    schema = record.get("json_schema")
    if schema is not None and not isinstance(schema, dict):
        raise ValueError(f"{where}: 'json_schema' must be a JSON schema object")
    if has_prompt:
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        return BenchPrompt(category=category.strip(), prompt=prompt, json_schema=schema)
    messages = parse_messages(record["messages"], where)
    return BenchPrompt(category=category.strip(), messages=messages, json_schema=schema)


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
