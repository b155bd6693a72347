"""Documents of a drafting corpus from transcripts: each assistant turn's tokens, as the
target meets them when it answers (the generation prompt's header, then the answer)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

Messages = list[dict[str, str]]


def _encode(tokenizer: Any, messages: Messages, generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def answer_documents(tokenizer: Any, messages: Messages) -> Iterator[list[int]]:
    """One document per assistant turn of a chat transcript: the tokens the generation
    prompt adds (the assistant header), then the turn's own, up to the next turn."""
    for turn, message in enumerate(messages):
        if message.get("role") != "assistant" or turn == 0:
            continue
        before = _encode(tokenizer, messages[:turn], False)
        asked = _encode(tokenizer, messages[:turn], True)
        whole = _encode(tokenizer, messages[: turn + 1], False)
        if whole[: len(asked)] != asked or asked[: len(before)] != before:
            raise ValueError("the chat template does not extend a transcript turn by turn")
        yield asked[len(before) :] + whole[len(asked) :]


def record_documents(tokenizer: Any, records: Iterable[dict[str, Any]]) -> Iterator[list[int]]:
    """Documents of training-data records (:func:`speculative.training.data.read_records`):
    the assistant turns of chat transcripts (``messages``, or ``prompt`` + ``response``)
    where the tokenizer has a chat template; otherwise, and for ``text`` and ``ids``
    records, the record's whole token ids."""
    from speculative.training.data import encode_record

    chat = bool(getattr(tokenizer, "chat_template", None))
    for record in records:
        messages = record.get("messages")
        if messages is None and "response" in record:
            messages = [
                {"role": "user", "content": record.get("prompt", "")},
                {"role": "assistant", "content": record["response"]},
            ]
        if chat and messages is not None and "ids" not in record:
            yield from answer_documents(tokenizer, list(messages))
        else:
            ids = encode_record(tokenizer, record, 1 << 30)
            if ids:
                yield ids


def distinct(documents: Iterable[list[int]]) -> list[list[int]]:
    """The documents, each once (a follow-up transcript repeats its first turn's answer,
    which would otherwise count twice in every vote), in first-seen order."""
    seen: set[tuple[int, ...]] = set()
    kept = []
    for doc in documents:
        key = tuple(doc)
        if key not in seen:
            seen.add(key)
            kept.append(doc)
    return kept
