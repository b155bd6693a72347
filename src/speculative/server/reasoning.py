"""A reasoning model's thinking, split from its answer (vLLM's reasoning parsers).

Models such as Qwen3 and DeepSeek-R1 think first, between ``<think>`` and ``</think>``,
then answer. The thinking goes out as ``reasoning_content`` (the field vLLM and DeepSeek's
API use), the answer as ``content`` (where a tokenizer has the tags as special tokens,
which decoding leaves out, the reply's text keeps them). A reply thinks when it starts
with ``<think>``, or
when the chat template opened the block itself (DeepSeek-R1's generation prompt ends with
``<think>``): then everything up to ``</think>`` is thinking. A reply cut before its
``</think>`` is all thinking. Streamed, the pieces are routed as they come, holding back
what may be the start of ``</think>`` (or of ``<think>`` at the start).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from speculative.server.text import partial_stop_length, special_ids

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def template_thinks(tokenizer: object) -> bool:
    """Whether the tokenizer's chat template speaks of thinking blocks (the parser's
    ``auto``)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and THINK_CLOSE in template


def special_think_tags(tokenizer: Any) -> frozenset[int]:
    """The ids of ``<think>`` and ``</think>`` where the tokenizer has them as special
    tokens (which decoding leaves out); empty where it has them as text."""
    special = special_ids(tokenizer)
    vocab = tokenizer.get_vocab()
    return frozenset(vocab[tag] for tag in (THINK_OPEN, THINK_CLOSE) if vocab.get(tag) in special)


def opens_thinking(prompt_text: str) -> bool:
    """Whether the prompt (its generation prompt) opened a thinking block itself."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """(thinking, answer) of a whole reply; ``thinking``: the prompt opened the block.
    The answer's leading whitespace after ``</think>`` is dropped; no thinking: None."""
    if not thinking:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_OPEN):
            return None, text
        text, thinking = stripped[len(THINK_OPEN) :], True
    reasoning, closed, answer = text.partition(THINK_CLOSE)
    return reasoning, answer.lstrip() if closed else ""


@dataclass
class ReasoningStream:
    """Routes a reply's streamed text into (thinking, answer) pieces."""

    thinking: bool  # the prompt opened the block
    state: str = "start"  # "start" (unknown yet), "thinking", "answer"
    held: str = ""  # text not routed yet

    def __post_init__(self) -> None:
        if self.thinking:
            self.state = "thinking"

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        """The (thinking, answer) text that ``piece`` makes final (all of it when
        ``final``)."""
        self.held += piece
        reasoning, answer = "", ""
        if self.state == "start":
            stripped = self.held.lstrip()
            if stripped.startswith(THINK_OPEN):
                self.held, self.state = stripped[len(THINK_OPEN) :], "thinking"
            elif not final and (not stripped or THINK_OPEN.startswith(stripped)):
                return "", ""  # (may still become the opening tag)
            else:
                self.state = "answer"
        if self.state == "thinking":
            before, closed, after = self.held.partition(THINK_CLOSE)
            if closed:
                reasoning, self.held, self.state = before, after.lstrip(), "answer-start"
            else:
                cut = len(self.held) - (
                    0 if final else partial_stop_length(self.held, (THINK_CLOSE,))
                )
                reasoning, self.held = self.held[:cut], self.held[cut:]
                return reasoning, ""
        if self.state == "answer-start":  # the whitespace after </think> is dropped
            self.held = self.held.lstrip()
            if not self.held and not final:
                return reasoning, ""
            self.state = "answer"
        answer, self.held = self.held, ""
        return reasoning, answer
