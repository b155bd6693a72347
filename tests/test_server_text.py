"""Incremental detokenization: the released pieces are always a prefix of the final text,
never contain a stop string or a broken UTF-8 character, and add up to it exactly."""

from __future__ import annotations

import random

import pytest

from speculative.engine.loop import Round
from speculative.server.text import (
    ACCEPTED,
    BONUS,
    RECOVERED,
    TARGET,
    TextAssembler,
    partial_stop_length,
    token_kinds,
)

TEXT = "Größe: 5 €, naïve café — 日本語 ok. The end is near; STOP here, then more text."


def byte_tokens(text: str, rng: random.Random) -> list[bytes]:
    """``text`` as UTF-8 byte chunks of 1-4 bytes (cutting characters apart)."""
    data, tokens, i = text.encode(), [], 0
    while i < len(data):
        n = rng.randint(1, 4)
        tokens.append(data[i : i + n])
        i += n
    return tokens


def run(tokens: list[bytes], stops: tuple[str, ...], rng: random.Random) -> list[str]:
    """Push the tokens in random-sized rounds; returns each round's released text."""
    vocab = {i: t for i, t in enumerate(tokens)}
    assembler = TextAssembler(
        lambda ids: b"".join(vocab[i] for i in ids).decode("utf-8", "replace"), stops
    )
    ids, released = list(range(len(tokens))), []
    while ids:
        size = rng.randint(1, 5)
        batch, ids = ids[:size], ids[size:]
        released.append("".join(p for p, _ in assembler.push(batch, [TARGET] * len(batch))))
    released.append("".join(p for p, _ in assembler.finish()))
    return released


@pytest.mark.parametrize("seed", range(20))
def test_pieces_add_up_to_the_final_text(seed: int) -> None:
    rng = random.Random(seed)
    tokens = byte_tokens(TEXT, rng)
    released = run(tokens, (), rng)
    assert "".join(released) == TEXT
    assert all("\ufffd" not in part for part in released)  # no half characters ever sent


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("stop", ["STOP", "near; S", "日本", "€,", "zzz"])
def test_stop_strings_cut_exactly(seed: int, stop: str) -> None:
    rng = random.Random(seed)
    released = run(byte_tokens(TEXT, rng), (stop, "never-there"), rng)
    expected = TEXT[: TEXT.find(stop)] if stop in TEXT else TEXT
    assert "".join(released) == expected
    sent = ""
    for part in released:
        sent += part
        assert TEXT.startswith(sent)  # only final text is ever released


def test_without_holding_back_a_stop_prefix_would_leak() -> None:
    """Control: the text before a stop string ends with the stop's first characters at
    some point; releasing everything decoded (no hold-back) would have sent them."""
    assert partial_stop_length("the end is near; S", ["near; STOP"]) == len("near; S")
    assert partial_stop_length("the end is near", ["STOP"]) == 0
    assert partial_stop_length("abcST", ["STOP", "TOPS"]) == 2


def test_token_kinds() -> None:
    assert token_kinds(Round([5, 6, 7], 2, 4, False)) == [ACCEPTED, ACCEPTED, RECOVERED]
    assert token_kinds(Round([5, 6, 7], 2, 2, False)) == [ACCEPTED, ACCEPTED, BONUS]
    assert token_kinds(Round([5], 0, 0, False)) == [TARGET]
    assert token_kinds(Round([5, 6], 2, 4, True, "stop")) == [ACCEPTED, ACCEPTED]


def test_pieces_keep_each_tokens_kind() -> None:
    words = {1: "the", 2: " cat", 3: " sat"}
    assembler = TextAssembler(lambda ids: "".join(words[i] for i in ids))
    assert assembler.push([1, 2], [ACCEPTED, BONUS]) == [("the", ACCEPTED), (" cat", BONUS)]
    assert assembler.push([3], [RECOVERED]) == [(" sat", RECOVERED)]
    assert assembler.finish() == []


def test_a_long_reply_decodes_a_window_per_token_not_the_whole_prefix() -> None:
    """1,200 byte tokens pushed in rounds of 2: the pieces add up to the text while the
    tokens decoded stay within a bounded window per token (the whole prefix after every
    token, what it cost before, is n²/2: 720,000 token decodes here)."""
    rng = random.Random(0)
    tokens = byte_tokens(TEXT * 40, rng)[:1200]
    assert len(tokens) == 1200
    vocab = dict(enumerate(tokens))
    decoded = []

    def decode(ids):
        decoded.append(len(ids))
        return b"".join(vocab[i] for i in ids).decode("utf-8", "replace")

    assembler = TextAssembler(decode, ("never-there",))
    sent = ""
    for k in range(0, len(tokens), 2):
        sent += "".join(p for p, _ in assembler.push([k, k + 1], [TARGET, TARGET]))
    sent += "".join(p for p, _ in assembler.finish())
    assert sent == decode(range(len(tokens)))
    assert sum(decoded) < 24 * len(tokens) * 2 < len(tokens) ** 2 / 2 / 10
